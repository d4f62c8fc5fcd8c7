"""The bounds every part checks a request against, each defined once.

They keep the sampling math inside int64 (numpy's fast integers) and the wire's
fields inside their types; docs/request.md, "SamplingParams: what defines an order"
states them for users.
"""

from __future__ import annotations

# Token offsets and positions * seq_len stay below this: with MAX_PARAM, every product
# the sampling math forms fits int64.
MAX_TOKENS = 1 << 62
# seq_len, stride, batch_size, world_size, shuffle_blocks, block sizes, epochs: small
# enough that a product of two of them with a position stays inside int64.
MAX_PARAM = 1 << 40
# A seed is any unsigned 64-bit integer: the key chain (keyed.py) reads it modulo 2**64.
MAX_SEED = (1 << 64) - 1
# Sources of a mixture: each costs work in every round (its counts, its passes).
MAX_SOURCES = 1 << 12
# Bytes of a request on the wire (StreamBatchesRequest, InfoRequest): the feeder's
# receive limit, which the Python client checks before it sends. A mixture of 1,000
# sources with 100 schedule segments is about 2.5 MB, and a run's weight changes grow
# it (a client refuses a change that would take its request past this); a request
# over the limit is refused at once, never retried. Responses are bounded by
# --max-batch-bytes.
MAX_REQUEST_BYTES = 16 << 20
# What a request holds beside its SamplingParams (rank, epoch, offset, ...): at most.
REQUEST_FIELDS_BYTES = 1 << 10
# Batches per message when they are packed by bytes (StreamBatchesRequest.message_bytes,
# the client's default): gRPC's cost is per message, so small batches travel several
# to a message, up to this many.
MAX_PACKED_BATCHES = 64


def packed_batches(message_bytes: int, batch_size: int, seq_len: int, itemsize: int) -> int:
    """Batches per message packed by bytes: as many batches of batch_size x (seq_len +
    1) tokens of `itemsize` bytes as fit `message_bytes`, 1 to MAX_PACKED_BATCHES. The
    client and the feeder both count with this, so either may pick."""
    batch_bytes = batch_size * (seq_len + 1) * itemsize
    return max(1, min(MAX_PACKED_BATCHES, message_bytes // batch_bytes))
