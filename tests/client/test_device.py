"""The torch path on the CPU: which device a client stages on, the ring of staging
slots, the CUDA path's staging code driven by a device whose copies finish late
(support/late_device.py), and what a training loop does with the batches: the
nanoGPT loss line, an in-place label mask, torch.compile over auto shifts."""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.client import FeederClient
from tokenfeed.client.buffers import HostRing, NumpyStager, batch_array
from tokenfeed.client.device import resolve_device
from tokenfeed.core import documents
from tokenfeed.v1 import feeder_pb2

from support import fewer_examples
from support.feeders import running_feeder
from support.stores import DOCUMENT_EOS, make_document_store, make_positional_store

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tokenfeed.client.device import HostStager  # noqa: E402  (imports torch)
from tokenfeed.client.pinned import PinnedStager  # noqa: E402

from support.late_device import LateCopies  # noqa: E402

# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize(
    ("env", "visible", "want"),
    [
        ({"LOCAL_RANK": "3"}, 8, "cuda:3"),  # torchrun: every rank sees the node's GPUs
        ({"LOCAL_RANK": "3"}, 1, "cuda:0"),  # CUDA_VISIBLE_DEVICES gives each rank its own
        ({"LOCAL_RANK": " 0 "}, 1, "cuda:0"),
        ({}, 4, "cuda:2"),  # no LOCAL_RANK: the current device (set_device's)
        ({"LOCAL_RANK": ""}, 4, "cuda:2"),
    ],
)
def test_cuda_becomes_the_ranks_own_device(env, visible, want) -> None:
    assert resolve_device("cuda", env, lambda: (visible, 2)) == want


def test_local_rank_past_several_visible_devices_is_an_error_naming_both() -> None:
    with pytest.raises(ValueError, match=r"LOCAL_RANK=3, but this process sees 2 CUDA devices"):
        resolve_device("cuda", {"LOCAL_RANK": "3"}, lambda: (2, 0))
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an integer"):
        resolve_device("cuda", {"LOCAL_RANK": "x"}, lambda: (2, 0))


def test_other_devices_are_kept_as_given() -> None:
    def never() -> tuple[int, int]:
        raise AssertionError("torch asked about CUDA for a device that is not 'cuda'")

    assert resolve_device(None, {}, never) is None
    assert resolve_device("cuda:1", {"LOCAL_RANK": "3"}, never) == "cuda:1"
    assert resolve_device("cpu", {"LOCAL_RANK": "3"}, never) == "cpu"
    assert resolve_device(torch.device("cpu"), {}, never) == "cpu"
    # No CUDA device at all: left for check_device to explain.
    assert resolve_device("cuda", {"LOCAL_RANK": "3"}, lambda: (0, 0)) == "cuda"


# -------------------------------------------------------------------------------- ring


class Copy:
    """A ring slot's event: done until a copy is issued, then until the test says so."""

    def __init__(self) -> None:
        self.done = True
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def _ring(limit: int) -> tuple[HostRing, list[int]]:
    made: list[int] = []
    return HostRing(lambda n: made.append(n) or np.zeros(n, np.uint8), Copy, limit), made


def _in_flight(ring: HostRing, slot: Any) -> None:
    slot.event.done = False
    ring.release(slot)


def test_a_slot_in_flight_is_reused_only_after_its_copy_completes() -> None:
    ring, _ = _ring(3)
    a = ring.acquire(10)
    _in_flight(ring, a)
    b = ring.acquire(10)
    assert b is not a  # a's copy is still running: a new slot
    ring.release(b, in_flight=False)
    assert ring.acquire(10) is b  # free again at once: nothing read it
    a.event.done = True
    ring.release(b, in_flight=False)
    assert ring.acquire(10) is a
    assert len(ring) == 2
    assert a.event.waited == 0  # asked, never waited for


def test_a_full_ring_waits_for_the_copy_released_first() -> None:
    ring, _ = _ring(2)
    a, b = ring.acquire(10), ring.acquire(10)
    _in_flight(ring, b)
    _in_flight(ring, a)  # released after b
    c = ring.acquire(10)
    assert c is b
    assert (b.event.waited, a.event.waited) == (1, 0)
    assert len(ring) == 2


def test_a_held_slot_is_never_handed_out() -> None:
    ring, _ = _ring(1)
    held = ring.acquire(10)
    got: list[Any] = []
    other = threading.Thread(target=lambda: got.append(ring.acquire(10)))
    other.start()
    assert got == []  # the only slot is held: the other reader waits for it
    ring.release(held, in_flight=False)
    other.join(10)
    assert got == [held]


def test_a_slot_grows_with_room_to_spare() -> None:
    ring, made = _ring(2)
    slot = ring.acquire(10)
    ring.release(slot, in_flight=False)
    assert ring.acquire(9) is slot
    ring.release(slot, in_flight=False)
    slot = ring.acquire(10_000)
    assert len(slot.buffer) == slot.capacity >= 10_000 * 5 // 4
    assert made == [4096, slot.capacity]
    with pytest.raises(ValueError, match="at least one slot"):
        HostRing(lambda n: n, Copy, 0)


# ------------------------------------------------------------ the staging code on a CPU


def _message(tokens: np.ndarray, shift: int, eos: int | None = None) -> feeder_pb2.Batch:
    rows, cols = tokens.shape
    ends = documents.eos_ends(tokens, eos) if eos is not None else np.empty(0, np.int64)
    return feeder_pb2.Batch(
        shift=shift,
        rows=rows,
        cols=cols,
        dtype=str(tokens.dtype),
        tokens=tokens.tobytes(),
        document_ends=documents.ends_to_bytes(ends),
    )


def _expected(
    msg: feeder_pb2.Batch, seq_len: int, layout: str, outputs: tuple[str, ...], mask: bool
) -> dict[str, Any]:
    """The batch as the numpy path makes it, widened: the reference of the torch
    stagers (test_client_documents checks the numpy path against loop references)."""
    numpy = NumpyStager(seq_len, layout, outputs, mask)
    inputs, labels, docs, _ = numpy.stage(msg, batch_array(msg))
    return {"input_ids": inputs.astype(np.int64), "labels": labels.astype(np.int64), **(docs or {})}


def _assert_staged(staged: tuple[Any, Any, Any], want: dict[str, Any]) -> None:
    inputs, labels, docs = staged
    got = {"input_ids": inputs, "labels": labels, **(docs or {})}
    assert set(got) == set(want)
    for key, value in want.items():
        if key == "max_seqlen":
            assert got[key] == value
            continue
        tensor = got[key]
        assert tensor.is_contiguous(), key
        assert tensor.dtype == torch.from_numpy(np.asarray(value)).dtype, key
        np.testing.assert_array_equal(tensor.numpy(), value, err_msg=key)
    assert inputs.dtype == labels.dtype == torch.int64
    before = inputs.clone()
    labels.fill_(-100)  # what masking in a training loop does: the inputs never see it
    assert torch.equal(inputs, before)


@pytest.fixture(scope="module")
def late_device():
    device = LateCopies(latency=0.0)
    yield device
    device.close()


@fewer_examples(3)  # torch ops per example
@given(
    dtype=st.sampled_from(["uint16", "uint32"]),
    rows=st.integers(1, 4),
    seq_len=st.sampled_from([4, 8, 12]),
    shift=st.sampled_from([1, 2, 4]),
    layout=st.sampled_from(["flat", "grouped"]),
    outputs=st.sets(st.sampled_from(documents.OUTPUTS)).map(
        lambda s: tuple(o for o in documents.OUTPUTS if o in s)
    ),
    mask=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_cuda_staging_code_and_the_cpu_one_make_the_numpy_batch(
    late_device, dtype, rows, seq_len, shift, layout, outputs, mask, seed
) -> None:
    """Full-range ids (the narrow dtypes are read as signed on the way), documents
    ending anywhere, every output and layout: the pinned path's tensors (expanded from
    the sparse description) and the CPU path's equal the numpy batch's, each one a
    contiguous tensor of its own."""
    if seq_len % shift:
        shift = 1
    rng = np.random.default_rng(seed)
    high = np.iinfo(np.dtype(dtype)).max
    tokens = rng.integers(0, high, size=(rows, seq_len + shift), endpoint=True).astype(dtype)
    eos = int(tokens.flat[rng.integers(tokens.size)])  # some row holds a document end
    tokens[rng.random(tokens.shape) < 0.2] = eos
    msg = _message(tokens, shift, eos)
    want = _expected(msg, seq_len, layout, outputs, mask)
    for stager in (
        PinnedStager(late_device, seq_len, layout, outputs, mask),
        HostStager(torch, torch.device("cpu"), seq_len, layout, outputs, mask),
    ):
        *staged, pending = stager.stage(msg, batch_array(msg))
        if pending is not None:
            stager.ready(*pending)
        _assert_staged(tuple(staged), want)  # type: ignore[arg-type]
    assert late_device.violations == []


def test_two_readers_through_the_ring_while_copies_finish_late() -> None:
    """An epoch's reader and the next epoch's share one stager. Copies finish late, so
    slots are in flight when the readers come back for one: none may be handed out
    while another reader holds it or a copy still reads it (the device checks every
    source at completion), every batch must come out as it went in, and slots and
    events are reused."""
    device = LateCopies(latency=0.0005)
    stager = PinnedStager(device, 12, "flat", documents.OUTPUTS, True, slots=2)
    loop: queue.Queue[Any] = queue.Queue(maxsize=4)
    per_reader = 60

    def reader(k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            for i in range(per_reader):
                shift = (1, 3)[(i + k) % 2]  # both ways labels are masked
                tokens = rng.integers(0, 65_535, size=(3, 12 + shift), endpoint=True)
                tokens[rng.random(tokens.shape) < 0.15] = DOCUMENT_EOS
                msg = _message(tokens.astype(np.uint16), shift, DOCUMENT_EOS)
                loop.put((msg, stager.stage(msg, batch_array(msg))))
        except Exception as e:  # the loop re-raises it
            loop.put(e)

    readers = [threading.Thread(target=reader, args=(k,)) for k in range(2)]
    for t in readers:
        t.start()
    events = set()
    for _ in range(2 * per_reader):
        item = loop.get(timeout=60)
        if isinstance(item, Exception):
            raise item
        msg, (inputs, labels, docs, pending) = item
        stager.ready(*pending)
        events.add(id(pending[1]))
        _assert_staged((inputs, labels, docs), _expected(msg, 12, "flat", documents.OUTPUTS, True))
    for t in readers:
        t.join(10)
    device.close()
    assert device.violations == []
    assert device.issued == device.completed == 2 * per_reader
    assert len(stager.ring) == 2
    assert len(events) < 2 * per_reader


# ------------------------------------------------------------ what a training loop does


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory):
    """Positional tokens below 4,000 (an embedding of the vocabulary stays small), and
    a store of documents."""
    root = tmp_path_factory.mktemp("device-data")
    make_positional_store(root / "small", 4_000, 1_000, dtype="uint16")
    make_document_store(root / "docs", total=4_000, mean=20)
    with running_feeder(root) as f:
        yield f


def _loader(f, **kw: Any) -> FeederClient:
    args: dict[str, Any] = {
        "dataset": "small",
        "seq_len": 16,
        "batch_size": 4,
        "shift": "auto",
        "shuffle": True,
        "rank": 0,
        "world_size": 1,
        "device": "cpu",
        "lookahead": False,
    }
    args.update(kw)
    return FeederClient(f.address, **args)


class Tiny(torch.nn.Module):
    vocab = 4_000

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(self.vocab, 8)
        self.head = torch.nn.Linear(8, self.vocab)

    def forward(self, input_ids: Any) -> Any:
        return self.head(self.embed(input_ids))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"layout": "grouped"},
        {"dataset": "docs", "documents": True, "mask_cross_document_labels": True},
    ],
)
def test_the_nanogpt_loss_line_and_an_in_place_label_mask(small_vocab, kw) -> None:
    model = Tiny()
    with _loader(small_vocab, **kw) as loader:
        for step, b in enumerate(loader):
            inputs = b["input_ids"].clone()
            logits = model(b["input_ids"])
            V = logits.size(-1)
            loss = F.cross_entropy(logits.view(-1, V), b["labels"].view(-1), ignore_index=-100)
            assert torch.isfinite(loss)
            b["labels"][:, 0] = -100  # a loop masking labels in place
            b["labels"].view(-1)[-1] = -100
            assert torch.equal(b["input_ids"], inputs)  # the next positions' inputs are intact
            if step == 5:
                break


def test_torch_compile_does_not_recompile_when_the_shift_changes(small_vocab) -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    frames = CompileCounter()
    model = Tiny()

    @torch.compile(backend=frames)
    def loss_of(input_ids: Any, labels: Any) -> Any:
        logits = model(input_ids)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

    shifts = set()
    with _loader(small_vocab) as loader:
        for step, b in enumerate(loader):
            shifts.add(b["shift"])
            loss_of(b["input_ids"], b["labels"])
            if step == 7:
                break
    assert len(shifts) > 1
    assert frames.frame_count == 1
    torch._dynamo.reset()
