"""FeederClient's arguments other than the connection, checked before any feeder is
contacted: the request (a SamplingSpec), the rank, and how batches are delivered.

Every check raises TypeError for a wrong type and ValueError for a value out of range,
naming the argument. The sampling fields are SamplingSpec's (InvalidArgument, a
ValueError, naming the field), with its defaults, the same in every client and on
the wire (docs/request.md, "SamplingParams: what defines an order").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from tokenfeed.client.buffers import DOCUMENT_OUTPUTS, LAYOUTS
from tokenfeed.client.checks import check_int, check_type
from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.limits import MAX_PACKED_BATCHES, packed_batches
from tokenfeed.core.mixture.files import load_mixture
from tokenfeed.core.request import SamplingSpec

MAX_PREFETCH = 1024
MAX_BATCHES_PER_MESSAGE = 1024  # the server's limit
# Auto batches_per_message packs this many bytes per message (core.limits.packed_batches):
# gRPC's cost is per message, on the feeder and in the client (a thread hop and a parse
# each), so batches travel several to a message. 1 MiB: a quarter of 256 KiB's
# per-message share of the CPU per token, and still a message the feeder builds on its
# event loop (service.INLINE_MAX_BYTES) and a stock gRPC client accepts (4 MiB).
MESSAGE_TARGET_BYTES = 1 << 20
MAX_AUTO_BATCHES_PER_MESSAGE = MAX_PACKED_BATCHES


@dataclass(frozen=True)
class Options:
    """How batches are delivered: their layout, the buffer (`prefetch`), gRPC packing
    (`batches_per_message`, None: ~1 MiB a message), streaming the next epoch
    ahead, the document outputs (a tuple of `DOCUMENT_OUTPUTS`; see
    `document_outputs` for what users pass) and label masking, and the metrics'
    registry and HTTP port."""

    layout: str = "flat"
    prefetch: int = 2
    batches_per_message: int | None = None
    lookahead: bool = True
    documents: tuple[str, ...] = ()
    mask_cross_document_labels: bool = False
    registry: CollectorRegistry | None = None
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        check_int("prefetch", self.prefetch, 1, MAX_PREFETCH)
        check_int("batches_per_message", self.batches_per_message, 1, MAX_BATCHES_PER_MESSAGE, True)
        check_int("metrics_port", self.metrics_port, 0, 65535, none_ok=True)
        check_type("metrics_addr", self.metrics_addr, str, "a host name or IP string")
        if self.registry is not None and not isinstance(self.registry, CollectorRegistry):
            raise TypeError(
                f"registry must be a prometheus_client.CollectorRegistry, got {self.registry!r}"
            )
        if not set(self.documents) <= set(DOCUMENT_OUTPUTS):
            raise ValueError(f"documents must be some of {list(DOCUMENT_OUTPUTS)}")
        for name in ("lookahead", "mask_cross_document_labels"):
            check_type(name, getattr(self, name), bool, "True or False")

    @property
    def document_ends(self) -> bool:
        """Whether a stream asks the feeder for each batch's document ends."""
        return bool(self.documents) or self.mask_cross_document_labels

    def message_batches(self, batch_size: int, seq_len: int, itemsize: int) -> int:
        """Batches per gRPC message: `batches_per_message`, or as many batches as fit
        MESSAGE_TARGET_BYTES (1 to 64; what the feeder picks when the stream asks it to
        pack by bytes)."""
        return self.batches_per_message or packed_batches(
            MESSAGE_TARGET_BYTES, batch_size, seq_len, itemsize
        )


def document_outputs(documents: Any) -> tuple[str, ...]:
    """`documents=` as the outputs to build: True is all of them, False none."""
    if isinstance(documents, bool):
        return DOCUMENT_OUTPUTS if documents else ()
    if (
        isinstance(documents, str)
        or not isinstance(documents, Sequence)
        or not documents
        or not all(d in DOCUMENT_OUTPUTS for d in documents)
    ):
        raise ValueError(
            f"documents must be True, False or a non-empty list of some of "
            f"{list(DOCUMENT_OUTPUTS)}, got {documents!r}"
        )
    return tuple(documents)


def sampling_spec(
    spec: SamplingSpec | None,
    world_size: int | None,
    environ: Mapping[str, str],
    *,
    dataset: str | None,
    mixture: Any,
    schedule: Any,
    seq_len: int | None,
    batch_size: int | None,
    split: str,
    split_rate: float,
    stride: int | None,
    shift: int | str,
    seed: int,
    shuffle: bool,
    shuffle_blocks: int,
) -> SamplingSpec:
    """The request: `spec` (with `world_size` if given), or one built from the
    sampling keywords; the world size defaults to WORLD_SIZE in `environ` (torchrun)."""
    if spec is not None:
        if not isinstance(spec, SamplingSpec):
            raise TypeError(f"spec must be a SamplingSpec, got {spec!r}")
        spec = spec if world_size is None else spec.with_(world_size=world_size)
        spec.check_size()
        return spec
    if dataset is not None and (mixture is not None or schedule is not None):
        raise InvalidArgument(
            "dataset= and mixture= are mutually exclusive: stream one dataset, or "
            "name it among the mixture's sources",
            field="mixture",
        )
    if (dataset is None and mixture is None) or seq_len is None or batch_size is None:
        raise TypeError(
            "FeederClient needs dataset (or mixture), seq_len and batch_size (or spec=)"
        )
    sources: Any = ()
    if mixture is not None or schedule is not None:
        sources, schedule = load_mixture(mixture, schedule)
    built = SamplingSpec(
        dataset=dataset or "",
        sources=sources,
        schedule=schedule or (),
        seq_len=seq_len,
        batch_size=batch_size,
        split=split,
        split_rate=split_rate,
        stride=stride or 0,
        shift=shift,
        seed=seed,
        shuffle=shuffle,
        shuffle_blocks=shuffle_blocks,
        world_size=env_int(environ, "WORLD_SIZE", 1) if world_size is None else world_size,
    )
    built.check_size()  # a request over the feeder's limit: refused here, never retried
    return built


def resolve_rank(rank: int | None, world_size: int, environ: Mapping[str, str]) -> int:
    """`rank`, or RANK in `environ` (torchrun), checked against the world size."""
    check_int("rank", rank, 0, 1 << 31, none_ok=True)
    resolved = env_int(environ, "RANK", 0) if rank is None else rank
    if not 0 <= resolved < world_size:
        raise ValueError(
            f"need 0 <= rank < world_size, got rank={resolved}, world_size={world_size}"
        )
    return resolved


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
