from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("dataset", "split", "split_rate", "seq_len", "stride", "batch_size", "shift", "auto_shift", "seed", "shuffle", "shuffle_blocks", "world_size", "sources", "schedule", "runtime_segments")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    AUTO_SHIFT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    split_rate: float
    seq_len: int
    stride: int
    batch_size: int
    shift: int
    auto_shift: bool
    seed: int
    shuffle: bool
    shuffle_blocks: int
    world_size: int
    sources: _containers.RepeatedCompositeFieldContainer[MixtureWeight]
    schedule: _containers.RepeatedCompositeFieldContainer[MixtureSegment]
    runtime_segments: bytes
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ..., split_rate: _Optional[float] = ..., seq_len: _Optional[int] = ..., stride: _Optional[int] = ..., batch_size: _Optional[int] = ..., shift: _Optional[int] = ..., auto_shift: _Optional[bool] = ..., seed: _Optional[int] = ..., shuffle: _Optional[bool] = ..., shuffle_blocks: _Optional[int] = ..., world_size: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[MixtureWeight, _Mapping]]] = ..., schedule: _Optional[_Iterable[_Union[MixtureSegment, _Mapping]]] = ..., runtime_segments: _Optional[bytes] = ...) -> None: ...

class MixtureWeight(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class MixtureSegment(_message.Message):
    __slots__ = ("from_tokens", "weights")
    FROM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    from_tokens: int
    weights: _containers.RepeatedCompositeFieldContainer[MixtureWeight]
    def __init__(self, from_tokens: _Optional[int] = ..., weights: _Optional[_Iterable[_Union[MixtureWeight, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("dataset", "params", "rank", "budget_tokens")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    params: SamplingParams
    rank: int
    budget_tokens: int
    def __init__(self, dataset: _Optional[str] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., rank: _Optional[int] = ..., budget_tokens: _Optional[int] = ...) -> None: ...

class SplitInfo(_message.Message):
    __slots__ = ("name", "tokens", "windows", "steps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tokens: int
    windows: int
    steps: int
    def __init__(self, name: _Optional[str] = ..., tokens: _Optional[int] = ..., windows: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "total_tokens", "num_chunks", "dtype", "vocab_size", "eos_token_id", "tokenizer", "tokens_per_chunk", "splits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    total_tokens: int
    num_chunks: int
    dtype: str
    vocab_size: int
    eos_token_id: int
    tokenizer: str
    tokens_per_chunk: int
    splits: _containers.RepeatedCompositeFieldContainer[SplitInfo]
    def __init__(self, name: _Optional[str] = ..., total_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., tokenizer: _Optional[str] = ..., tokens_per_chunk: _Optional[int] = ..., splits: _Optional[_Iterable[_Union[SplitInfo, _Mapping]]] = ...) -> None: ...

class SourceInfo(_message.Message):
    __slots__ = ("name", "tokens", "windows", "windows_drawn", "tokens_drawn", "passes", "shares")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_DRAWN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DRAWN_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    name: str
    tokens: int
    windows: int
    windows_drawn: int
    tokens_drawn: int
    passes: float
    shares: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., tokens: _Optional[int] = ..., windows: _Optional[int] = ..., windows_drawn: _Optional[int] = ..., tokens_drawn: _Optional[int] = ..., passes: _Optional[float] = ..., shares: _Optional[_Iterable[float]] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("datasets", "sources")
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    sources: _containers.RepeatedCompositeFieldContainer[SourceInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[SourceInfo, _Mapping]]] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ("params", "epoch", "rank", "offset", "step", "batches_per_message", "max_message_bytes", "document_ends", "message_bytes", "describe")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ENDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    params: SamplingParams
    epoch: int
    rank: int
    offset: int
    step: int
    batches_per_message: int
    max_message_bytes: int
    document_ends: bool
    message_bytes: int
    describe: bool
    def __init__(self, params: _Optional[_Union[SamplingParams, _Mapping]] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., offset: _Optional[int] = ..., step: _Optional[int] = ..., batches_per_message: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., document_ends: _Optional[bool] = ..., message_bytes: _Optional[int] = ..., describe: _Optional[bool] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("epoch", "step", "offset", "shift", "rows", "cols", "dtype", "tokens", "starts", "sources", "document_ends")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ENDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    offset: int
    shift: int
    rows: int
    cols: int
    dtype: str
    tokens: bytes
    starts: _containers.RepeatedScalarFieldContainer[int]
    sources: _containers.RepeatedScalarFieldContainer[int]
    document_ends: bytes
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., offset: _Optional[int] = ..., shift: _Optional[int] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., dtype: _Optional[str] = ..., tokens: _Optional[bytes] = ..., starts: _Optional[_Iterable[int]] = ..., sources: _Optional[_Iterable[int]] = ..., document_ends: _Optional[bytes] = ...) -> None: ...

class StreamBatchesResponse(_message.Message):
    __slots__ = ("batches", "batches_per_message", "info")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[Batch]
    batches_per_message: int
    info: InfoResponse
    def __init__(self, batches: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., batches_per_message: _Optional[int] = ..., info: _Optional[_Union[InfoResponse, _Mapping]] = ...) -> None: ...
