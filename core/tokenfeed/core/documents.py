"""Document structure of a packed batch: position ids, document ids, cu_seqlens and the
cross-document label mask (docs/documents.md). Pure numpy, no I/O.

A batch is a buffer W of [rows, cols] tokens, cols = seq_len + shift; `input_ids` is
W[:, :seq_len] and `labels` is W[:, shift:]. A token *ends a document* when it is an
EOS (stores whose documents end in EOS) or the last token before a recorded document
offset (Megatron indexed datasets: no EOS needed).

Everything goes through one sparse description of where documents end, the same for
both kinds of store: `ends`, the ascending flat indices `r * cols + c` of the tokens
of the buffer that end a document. The feeder finds them (it knows the store) and
sends them with each batch; the client builds the dense outputs from them:

    ends = eos_ends(tokens, eos_id)                     # EOS stores: one scan
    ends = offset_ends(starts, cols, doc_ends)          # recorded offsets: searchsorted
    ends = indexed_ends(starts, cols, sentences)        # a Megatron index, in place
    seqs = sequences(ends, rows, seq_len, shift)        # the core, O(ends)
    seqs.cu_seqlens, seqs.max_seqlen                    # FlashAttention varlen
    position_ids(seqs), document_ids(seqs)              # dense [rows, seq_len]
    masked_labels(labels, seqs)                         # int64 copy with -100

Definitions, for row r and input position j (0 <= j < seq_len); a *sequence* is a run
of one row's input tokens within one document (FlashAttention's word: cu_seqlens,
max_seqlen):

- a sequence starts at j = 0 and at j = c + 1 for every end at c <= seq_len - 2 (an end
  at the last input token opens nothing; ends at c >= seq_len only affect labels);
- position_ids[r, j] = j - (start of j's sequence), int64;
- document_ids[r, j] = index of j's sequence within row r, int32;
- cu_seqlens = the sequence starts over the flattened [rows * seq_len] batch, then
  rows * seq_len, int32; max_seqlen = the longest sequence (a Python int);
- labels[r, j] = -100 exactly when an end lies among W[r, j .. j + shift - 1].

Per-call overhead, not arithmetic, dominates a batch's sparse work (a numpy call on a
few hundred elements costs about as much as the arithmetic of the whole batch), so the
sparse part keeps the number of calls small and the dense outputs are a few np.repeat
passes over rows * seq_len elements whatever the number of documents; no Python loop
runs over rows or tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from tokenfeed.core import native

IGNORE_INDEX = -100  # PyTorch's cross-entropy and Hugging Face models ignore it
OUTPUTS = ("position_ids", "document_ids", "cu_seqlens", "max_seqlen")
ENDS_DTYPE = np.dtype("<u4")  # on the wire: little-endian uint32 flat indices
_IGNORE = np.int64(IGNORE_INDEX)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _check_shape(rows: int, seq_len: int, shift: int) -> int:
    if rows < 1 or seq_len < 1:
        raise ValueError(f"a batch needs rows >= 1 and seq_len >= 1, got {rows} x {seq_len}")
    if shift < 1:
        raise ValueError(f"shift must be >= 1, got {shift}")
    if rows * (seq_len + shift) > _INT32_MAX:
        raise ValueError(f"{rows} x {seq_len + shift} tokens do not fit int32 indices")
    return seq_len + shift


# ----------------------------------------------------------------- where documents end


def eos_ends(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Ascending flat indices (int64) of the EOS tokens of a batch buffer (any shape:
    it is read flat, row after row)."""
    return (tokens.reshape(-1) == eos_id).nonzero()[0]


def recorded_ends(doc_ends: np.ndarray) -> np.ndarray:
    """A store's recorded document end offsets (exclusive, non-decreasing: an empty
    document repeats the previous end) as strictly ascending positive int64 offsets,
    what `offset_ends` takes. Made once per store."""
    d = np.asarray(doc_ends, dtype=np.int64).reshape(-1)
    if len(d) and (d[0] < 0 or (len(d) > 1 and bool((d[1:] < d[:-1]).any()))):
        raise ValueError("document end offsets must be non-negative and non-decreasing")
    keep = np.ones(len(d), dtype=np.bool_)
    keep[1:] = d[1:] != d[:-1]
    keep &= d > 0  # an empty first document ends nothing
    return d[keep]


def offset_ends(starts: np.ndarray, cols: int, doc_ends: np.ndarray) -> np.ndarray:
    """Ends of documents recorded as offsets, as ascending flat indices (int64) into a
    [rows, cols] batch.

    `starts`: [rows] absolute store offset of each row's first token (the batch's
    `starts`); `doc_ends`: strictly ascending exclusive end offsets of the store's
    documents (`recorded_ends`): document i is T[doc_ends[i-1] : doc_ends[i]]. The
    token at absolute offset p ends a document when p + 1 is in doc_ends. Two binary
    searches and a ragged gather, whatever the number of rows.
    """
    starts = np.asarray(starts, dtype=np.int64)
    if starts.ndim != 1 or doc_ends.ndim != 1:
        raise ValueError("starts and doc_ends must be 1-d")
    if cols < 1:
        raise ValueError(f"cols must be >= 1, got {cols}")
    # Row r holds T[s, s + cols): the ends e - 1 with s + 1 <= e <= s + cols.
    lo = np.searchsorted(doc_ends, starts + 1, side="left")
    hi = np.searchsorted(doc_ends, starts + cols, side="right")
    counts = hi - lo
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    # Entry k of row r is doc_ends[lo[r] + (k - first[r])], first[r] its row's first k.
    first = np.cumsum(counts) - counts
    index = np.arange(total, dtype=np.int64) + np.repeat(lo - first, counts)
    rowbase = np.repeat(np.arange(len(starts), dtype=np.int64) * cols - starts - 1, counts)
    return doc_ends[index] + rowbase


class Sentences(NamedTuple):
    """Documents recorded as runs of sentences (a Megatron index's arrays, which call
    them sequences; any alignment): sentence k starts at token pointers[k] // itemsize
    (pointers in bytes, ascending; k = S, one past the last, at `total`); document d is
    sentences [doc_indices[d], doc_indices[d + 1]) (non-decreasing from 0 to S), so it
    ends where sentence doc_indices[d + 1] starts."""

    pointers: np.ndarray  # int64 [S]
    doc_indices: np.ndarray  # int64 [D + 1]
    itemsize: int
    total: int


def indexed_ends(starts: np.ndarray, cols: int, index: Sentences) -> np.ndarray:
    """Ends of documents recorded as runs of sentences, as ascending flat indices (int64)
    into a [rows, cols] batch: what `offset_ends` gives over the store's whole list,
    searched in the index in place.

    The arrays may be the index file's own, memory-mapped and unaligned: a row costs four
    binary searches over them, whatever their length, and nothing is made per document.
    ValueError when what the search finds contradicts the layout (an index `verify`
    reports). Compiled (_documents.c) when built; the reference is `indexed_ends_py`.
    """
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    if cols < 1:
        raise ValueError(f"cols must be >= 1, got {cols}")
    if _indexed_ends_c is None or not native.enabled():
        return indexed_ends_py(starts, cols, index)
    out = np.empty(starts.size * cols, dtype=np.int64)
    n = _indexed_ends_c(starts, cols, *index, out)
    return out[:n]


def indexed_ends_py(starts: np.ndarray, cols: int, index: Sentences) -> np.ndarray:
    """`indexed_ends`'s reference, in numpy: the same binary searches, every row at
    once (np.searchsorted would copy an unaligned array whole first)."""
    pointers, doc_indices, itemsize, total = index
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    if len(doc_indices) < 1 or itemsize < 1 or total < 0:
        raise ValueError("at least one document index, itemsize >= 1 and total >= 0")
    num_sent, ends = len(pointers), doc_indices[1:]
    k = _lower_bound(pointers, np.concatenate([starts + 1, starts + cols + 1]) * itemsize)
    ka, kb = np.split(k, 2)
    kb = kb + ((kb == num_sent) & (starts + 1 <= total) & (total <= starts + cols))
    ja, jb = np.split(_lower_bound(ends, np.concatenate([ka, kb])), 2)
    counts = jb - ja
    n = int(counts.sum())
    if n == 0:
        return np.empty(0, dtype=np.int64)
    first = np.cumsum(counts) - counts
    sent = ends[np.arange(n, dtype=np.int64) + np.repeat(ja - first, counts)].astype(np.int64)
    inside = (sent >= 0) & (sent < num_sent)
    p = np.full(n, total * itemsize, dtype=np.int64)
    p[inside] = pointers[sent[inside]]
    c = p // itemsize - np.repeat(starts + 1, counts)
    flat = c + np.repeat(np.arange(len(starts), dtype=np.int64) * cols, counts)
    if (
        (sent < 0).any()
        or (sent > num_sent).any()
        or (p < 0).any()
        or (c < 0).any()
        or (c >= cols).any()
        or (flat[1:] < flat[:-1]).any()
    ):
        raise ValueError("sentence pointers or document indices out of order or out of range")
    keep = np.ones(n, dtype=np.bool_)
    keep[1:] = flat[1:] != flat[:-1]  # empty documents and sentences end where others do
    return flat[keep]


def _lower_bound(a: np.ndarray, v: np.ndarray) -> np.ndarray:
    """For each v, the first i with a[i] >= v (len(a) if none), a ascending: a binary
    search by fancy indexing, which reads a in place whatever its alignment."""
    lo = np.zeros(len(v), dtype=np.int64)
    hi = np.full(len(v), len(a), dtype=np.int64)
    while True:
        live = lo < hi
        if not live.any():
            return lo
        mid = (lo + hi) // 2
        below = live & (a[np.where(live, mid, 0)] < v)
        lo = np.where(below, mid + 1, lo)
        hi = np.where(live & ~below, mid, hi)


_indexed_ends_c: Callable[..., int] | None
try:
    from tokenfeed.core._documents import indexed_ends as _indexed_ends_c
except ImportError:  # built without the extension (TOKENFEED_PURE_PYTHON=1 at install)
    _indexed_ends_c = None


# ---------------------------------------------------- a store's ends, batch by batch


class EndSearch(ABC):
    """A store's recorded document ends, searched batch by batch: the ends of rows
    `cols` tokens wide starting at `starts`, as `offset_ends` gives them over the
    store's whole list, without that list when the store can search its own."""

    @abstractmethod
    def ends(self, starts: np.ndarray, cols: int) -> np.ndarray:
        """Ascending flat end indices (int64) into a [len(starts), cols] batch."""


class ArrayEnds(EndSearch):
    """The ends as one array (`recorded_ends` of a store's list)."""

    def __init__(self, doc_ends: np.ndarray) -> None:
        self.array = recorded_ends(doc_ends)

    def ends(self, starts: np.ndarray, cols: int) -> np.ndarray:
        return offset_ends(starts, cols, self.array)


def ends_to_bytes(ends: np.ndarray) -> bytes:
    """Flat end indices as the wire's little-endian uint32 bytes."""
    return np.asarray(ends).astype(ENDS_DTYPE).tobytes()


def ends_from_bytes(data: bytes | memoryview) -> np.ndarray:
    """The wire's little-endian uint32 bytes as flat end indices (a read-only view)."""
    if len(data) % ENDS_DTYPE.itemsize:
        raise ValueError(f"document ends of {len(data)} bytes: not a whole number of uint32")
    return np.frombuffer(data, dtype=ENDS_DTYPE)


# ------------------------------------------------------------------------- the core

_ARANGES: dict[tuple[int, int], np.ndarray] = {}


def _arange(n: int, dtype: type[np.integer]) -> np.ndarray:
    """A read-only arange(n) of `dtype`, cached (batches repeat their shapes)."""
    key = (n, np.dtype(dtype).num)
    a = _ARANGES.get(key)
    if a is None:
        if len(_ARANGES) > 64:
            _ARANGES.clear()
        a = np.arange(n, dtype=dtype)
        a.flags.writeable = False
        _ARANGES[key] = a
    return a


class Sequences(NamedTuple):
    """The document sequences of one batch, all sparse (sizes ~ sequences, not tokens).

    cu_seqlens: int32 [sequences + 1], the sequence starts over the flattened batch, then
    rows * seq_len; cu: the same, int64. max_seqlen: the longest sequence. lengths:
    int64 [sequences]. first: int32 [rows], the index of each row's first sequence.
    local: int32 [sequences], each sequence's document index within its row.
    ends: the flat end indices into the [rows, seq_len + shift] buffer; label_at: the
    input-space indices r * seq_len + c of the ends among input tokens (c < seq_len),
    the labels a shift of 1 masks.
    (A NamedTuple: made once per batch, and a frozen dataclass's __init__ costs
    several microseconds.)
    """

    rows: int
    seq_len: int
    shift: int
    cu_seqlens: np.ndarray
    cu: np.ndarray
    max_seqlen: int
    lengths: np.ndarray
    first: np.ndarray
    local: np.ndarray
    ends: np.ndarray
    label_at: np.ndarray


# Up to this many ends a batch's sequences are found by a Python loop over the ends and
# rows, above it by numpy: the numpy path takes about fifteen calls, each with a fixed
# cost on small arrays, so a loop over the few dozen ends
# of a batch of ordinary documents is several times cheaper (see
# benchmarks/trainer_loop.py). Both give identical results (tested).
LOOP_MAX_ENDS = 256


def _bad_ends(rows: int, cols: int) -> ValueError:
    return ValueError(
        f"document ends must be strictly ascending flat indices in "
        f"[0, {rows * cols}) of a {rows} x {cols} buffer"
    )


def sequences(
    ends: np.ndarray, rows: int, seq_len: int, shift: int, validate: bool = True
) -> Sequences:
    """The document sequences of a batch from the ascending flat end indices into its
    [rows, seq_len + shift] buffer (the module docstring has the definitions).

    `validate=False` skips the check that `ends` ascend strictly inside the buffer, for
    ends made here (eos_ends, offset_ends); keep it for ends that travelled. The
    numpy path checks them anyway when it is cheaper (the loop always does).
    """
    cols = _check_shape(rows, seq_len, shift)
    ends = np.asarray(ends)
    if ends.ndim != 1:
        raise ValueError(f"ends must be 1-d flat indices, got shape {ends.shape}")
    if len(ends) <= LOOP_MAX_ENDS:
        return _sequences_loop(ends, rows, seq_len, shift, cols)
    return _sequences_numpy(ends, rows, seq_len, shift, cols, validate)


def _sequences_loop(ends: np.ndarray, rows: int, seq_len: int, shift: int, cols: int) -> Sequences:
    """sequences() by one pass over the ends and rows in Python (few ends).

    Kept to few bytecodes per row and per end (bound appends, the next end held in a
    local, no row arithmetic for an end past the row), and every sparse result goes
    through one list into one numpy array plus one int32 copy: converting Python ints
    costs per element, each extra numpy call a fixed microsecond or more."""
    flat = ends.tolist()
    n = len(flat)
    cu: list[int] = []  # sequence starts over the flattened input
    local: list[int] = []  # each sequence's document index within its row
    first: list[int] = []  # each row's first sequence
    label_at: list[int] = []
    add_cu, add_local, add_first, add_label = cu.append, local.append, first.append, label_at.append
    k, prev, last = 0, -1, seq_len - 1
    e = flat[0] if n else rows * cols  # the next end (past the buffer: none)
    for r in range(rows):
        row_start = r * seq_len
        add_first(len(cu))
        add_cu(row_start)
        add_local(0)
        base = r * cols  # the row's first buffer index
        end = base + cols
        d = 0
        while e < end:
            if e <= prev:
                raise _bad_ends(rows, cols)
            prev = e
            c = e - base
            if c < seq_len:  # an input token: it masks its own label at shift 1
                add_label(row_start + c)
                if c < last:  # not the last input token: the next one opens a sequence
                    add_cu(row_start + c + 1)
                    d += 1
                    add_local(d)
            k += 1
            e = flat[k] if k < n else rows * cols
    if k < n:
        raise _bad_ends(rows, cols)
    cu.append(rows * seq_len)
    s = len(cu)  # sequences + 1
    # One array for all, sliced: [cu | local | first | label_at]; its first three parts
    # again as int32 (cu_seqlens, local, first). Each slice is contiguous.
    packed = np.array(cu + local + first + label_at, dtype=np.int64)
    narrow = packed[: 2 * s - 1 + rows].astype(np.int32)
    cu64 = packed[:s]
    lengths = cu64[1:] - cu64[:-1]
    return Sequences(
        rows,
        seq_len,
        shift,
        narrow[:s],
        cu64,
        max(lengths.tolist()),
        lengths,
        narrow[2 * s - 1 :],
        narrow[s : 2 * s - 1],
        ends,
        packed[2 * s - 1 + rows :],
    )


def _sequences_numpy(
    ends: np.ndarray, rows: int, seq_len: int, shift: int, cols: int, validate: bool
) -> Sequences:
    """sequences() in about fifteen numpy calls, whatever the number of ends."""
    ends = ends.astype(np.int64, copy=False)
    if (
        validate
        and len(ends)
        and (ends[0] < 0 or ends[-1] >= rows * cols or bool((ends[1:] <= ends[:-1]).any()))
    ):
        raise _bad_ends(rows, cols)
    total = rows * seq_len
    r, c = np.divmod(ends, cols)
    at = ends - r * shift  # input-space index r * seq_len + c
    # Sequence starts: every row start, and after each end among input tokens
    # 0..seq_len-2 (at + 1). With `total` appended, one sort gives cu_seqlens.
    inner = at[c < seq_len - 1]
    inner += 1
    cu = np.concatenate((_arange(total + seq_len, np.int64)[::seq_len], inner))
    cu.sort()
    lengths = cu[1:] - cu[:-1]
    first = cu.searchsorted(_arange(total, np.int64)[::seq_len]).astype(np.int32)
    local = _arange(len(lengths), np.int32) - first[cu[:-1] // seq_len]
    return Sequences(
        rows,
        seq_len,
        shift,
        cu.astype(np.int32),
        cu,
        int(lengths.max()),
        lengths,
        first,
        local,
        ends,
        at[c < seq_len],
    )


# ------------------------------------------------------------------ dense outputs


def position_ids(seqs: Sequences) -> np.ndarray:
    """[rows, seq_len] int64: j minus the start of j's sequence."""
    out = seqs.cu[:-1].repeat(seqs.lengths)
    np.subtract(_arange(seqs.rows * seqs.seq_len, np.int64), out, out=out)
    return out.reshape(seqs.rows, seqs.seq_len)


def document_ids(seqs: Sequences) -> np.ndarray:
    """[rows, seq_len] int32: each token's document index within its row (one pass)."""
    return seqs.local.repeat(seqs.lengths).reshape(seqs.rows, seqs.seq_len)


# Labels. Label j of row r is ignored when an end lies among buffer columns
# j .. j + shift - 1, i.e. an end at flat buffer index e masks buffer positions
# e - shift + 1 .. e (label j of row r taken to sit at r * cols + j). In buffer
# coordinates no row logic is needed: an interval that starts before its row's column
# 0 reaches only the previous row's columns >= seq_len + 1, which hold no label.

_PATTERN = np.zeros(1 << 16, dtype=np.bool_)
_PATTERN[1::2] = True  # unmasked, masked, unmasked, ... run values
_PATTERN.flags.writeable = False


def label_runs(seqs: Sequences) -> np.ndarray:
    """int64 [2 * ends + 1]: alternating unmasked / masked run lengths over the flattened
    [rows, seq_len + shift] buffer (they sum to rows * cols). Ends ascend, so clipping
    each interval's start to the previous end + 1 leaves disjoint ascending intervals;
    the size depends on the number of ends, not on the shift."""
    ends = seqs.ends.astype(np.int64, copy=False)
    n = len(ends)
    size = seqs.rows * (seqs.seq_len + seqs.shift)
    runs = np.empty(2 * n + 1, dtype=np.int64)
    if n == 0:
        runs[0] = size
        return runs
    hi = ends + 1
    lo = ends - (seqs.shift - 1)
    np.maximum(lo[1:], hi[:-1], out=lo[1:])
    lo[0] = max(int(lo[0]), 0)
    runs[1::2] = hi - lo
    runs[2:-1:2] = lo[1:] - hi[:-1]
    runs[0] = lo[0]
    runs[-1] = size - hi[-1]
    return runs


def label_mask(seqs: Sequences) -> np.ndarray:
    """bool [rows, seq_len] (a view): True where the label's target lies in another
    document. One np.repeat of the runs, whatever the shift."""
    runs = label_runs(seqs)
    pattern = (
        _PATTERN[: len(runs)]
        if len(runs) <= len(_PATTERN)
        else (np.arange(len(runs)) & 1).astype(np.bool_)
    )
    flat = pattern.repeat(runs)
    return flat.reshape(seqs.rows, seqs.seq_len + seqs.shift)[:, : seqs.seq_len]


def masked_labels(labels: np.ndarray, seqs: Sequences) -> np.ndarray:
    """A new contiguous int64 [rows, seq_len] copy of `labels` with -100 where the
    target lies in another document (`labels`, a view sharing input_ids' buffer, is
    never written). Shift 1 scatters at the ends themselves (they are the masked
    labels); a larger shift masks whole runs, a cost that does not grow with it."""
    if labels.shape != (seqs.rows, seqs.seq_len):
        raise ValueError(
            f"labels of shape {labels.shape}, sequences of {seqs.rows} x {seqs.seq_len}"
        )
    out = labels.astype(np.int64)  # always a copy
    if seqs.shift == 1:
        out.reshape(-1)[seqs.label_at] = IGNORE_INDEX
    else:
        np.copyto(out, _IGNORE, where=label_mask(seqs))
    return out


def from_ends(
    ends: np.ndarray,
    rows: int,
    seq_len: int,
    shift: int,
    labels: np.ndarray | None = None,
    validate: bool = True,
    outputs: tuple[str, ...] = OUTPUTS,
) -> dict[str, object]:
    """The `outputs` asked for (OUTPUTS: position_ids, document_ids, cu_seqlens,
    max_seqlen) and, with `labels`, the masked labels, of a batch with these ends."""
    seqs = sequences(ends, rows, seq_len, shift, validate)
    out: dict[str, object] = {}
    if "position_ids" in outputs:
        out["position_ids"] = position_ids(seqs)
    if "document_ids" in outputs:
        out["document_ids"] = document_ids(seqs)
    if "cu_seqlens" in outputs:
        out["cu_seqlens"] = seqs.cu_seqlens
    if "max_seqlen" in outputs:
        out["max_seqlen"] = seqs.max_seqlen
    if labels is not None:
        out["labels"] = masked_labels(labels, seqs)
    return out
