"""What the feeder says about a dataset and a request, as `DatasetInfo`: the answer of
its Info RPC, which a stream's first response also carries when asked (`describe`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenfeed.core.dtypes import itemsize
from tokenfeed.core.errors import NotFound
from tokenfeed.core.limits import MAX_TOKENS
from tokenfeed.v1 import feeder_pb2


@dataclass(frozen=True)
class DatasetInfo:
    """What the feeder says about the dataset and this request (`loader.dataset_info`)."""

    name: str
    total_tokens: int  # of the whole store
    vocab_size: int | None  # None when the store does not say
    eos_token_id: int | None
    dtype: str  # of the stored tokens: "uint16" or "uint32"
    tokenizer: str | None  # name or path it was prepared with
    split: str
    split_tokens: int  # tokens of this split
    windows: int  # windows of this split's epoch order (all ranks)
    steps: int  # steps of a full epoch for this rank at this world size (= len(loader))
    # a mixture's: each source's train windows (one pass), in `loader.sources` order
    source_windows: tuple[int, ...] = ()

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)


def mixture_info(response: feeder_pb2.InfoResponse, seq_len: int) -> DatasetInfo:
    """A mixture's DatasetInfo: its sources' shared dtype and vocabulary (the first
    source's metadata), the train split, and an endless stream (steps 0)."""
    if not response.datasets:
        raise NotFound("the feeder reports none of the mixture's sources")
    ds = response.datasets[0]
    return DatasetInfo(
        name=",".join(d.name for d in response.datasets),
        total_tokens=sum(int(d.total_tokens) for d in response.datasets),
        vocab_size=int(ds.vocab_size) or None,
        eos_token_id=None if ds.eos_token_id < 0 else int(ds.eos_token_id),
        dtype=ds.dtype,
        tokenizer=ds.tokenizer or None,
        split="train",
        split_tokens=sum(int(d.splits[0].tokens) for d in response.datasets if d.splits),
        windows=MAX_TOKENS // seq_len,
        steps=0,
        source_windows=tuple(int(s.windows) for s in response.sources),
    )


def dataset_info(response: feeder_pb2.InfoResponse, dataset: str, split: str) -> DatasetInfo:
    """One dataset's DatasetInfo for `split`; NotFound naming what the feeder lacks."""
    for ds in response.datasets:
        if ds.name == dataset:
            for s in ds.splits:
                if s.name == split:
                    return DatasetInfo(
                        name=ds.name,
                        total_tokens=int(ds.total_tokens),
                        vocab_size=int(ds.vocab_size) or None,
                        eos_token_id=None if ds.eos_token_id < 0 else int(ds.eos_token_id),
                        dtype=ds.dtype,
                        tokenizer=ds.tokenizer or None,
                        split=split,
                        split_tokens=int(s.tokens),
                        windows=int(s.windows),
                        steps=int(s.steps),
                    )
            raise NotFound(f"the feeder reports no split {split!r} for dataset {dataset!r}")
    names = [ds.name for ds in response.datasets]
    raise NotFound(f"the feeder has no dataset {dataset!r} (it has {names})")


class KnownInfo:
    """A client's DatasetInfo, learned once and kept (the store and the request do not
    change): told by a stream's first response (`told`), or asked with one Info call
    (`get`) when wanted before any stream told it."""

    def __init__(
        self,
        parse: Callable[[feeder_pb2.InfoResponse], DatasetInfo],
        ask: Callable[[], feeder_pb2.InfoResponse],
    ) -> None:
        self.parse, self.ask = parse, ask
        self.known: DatasetInfo | None = None

    def get(self) -> DatasetInfo:
        if self.known is None:
            self.known = self.parse(self.ask())
        return self.known

    def told(self, response: feeder_pb2.InfoResponse) -> DatasetInfo:
        if self.known is None:
            self.known = self.parse(response)
        return self.known
