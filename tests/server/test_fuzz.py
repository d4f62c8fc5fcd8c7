"""Fuzzing the wire API: random and adversarial requests against a real feeder.

Every request gets the status its content calls for, with a message; none crashes the
server, reads outside the data root, or disturbs a canary stream running beside it.
The expected status is derived here in the order the server checks: the request's
values (SamplingSpec), the dataset name (a mixture's: each source's), what depends on
the data (DatasetSampler / MixtureSampler are the oracles), then the stream position,
then the message size. A third of the requests are mixtures (sources and a schedule,
well-formed or not).
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfeed.core.errors import FeederError, InvalidArgument
from tokenfeed.core.limits import MAX_PARAM, MAX_TOKENS
from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import write_store
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

from support.feeders import feeder_params, running_feeder
from support.stores import make_positional_store, make_sampler

TOTAL = 10_000
MAX_BATCH_BYTES = 1 << 20
SECRET = 7777  # every token of the store outside the data root
INT64 = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([0, 1, 2, 8, 13, 1024, -1, 2**31, 2**40, 2**41, 2**62, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)
NAMES = st.one_of(
    st.sampled_from(
        [
            "positions",
            "nested/small",
            "",
            ".",
            "..",
            "../outside",
            "/etc",
            "/positions",
            "positions/",
            "positions/..",
            "nested//small",
            "escape",
            "escape/x",
            "a\\b",
            "x\x00y",
            "nope",
            "nested",
            "positions/chunk_000000.bin",
            "ünïcode",
            "a" * 5000,
        ]
    ),
    st.text(max_size=30),
)
DOUBLES = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.floats(allow_nan=True))


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fuzz")
    root = base / "root"
    make_positional_store(root / "positions", TOTAL, 1_000)
    make_positional_store(root / "nested" / "small", 300, 100)
    outside = base / "outside"
    write_store(outside, np.full(5000, SECRET), dtype="uint32", tokens_per_chunk=1000)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def fuzz_feeder(fuzz_root: Path):
    with running_feeder(fuzz_root, max_batch_bytes=MAX_BATCH_BYTES) as f:
        yield f


def _bad_name(name: str) -> bool:
    parts = name.split("/")
    return (
        not name
        or len(name) > 1024
        or name.startswith("/")
        or "\\" in name
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
        or any(x in ("", ".", "..") for x in parts)
    )


SIZES = {"positions": TOTAL, "nested/small": 300}
BLOCKS = {"positions": 1000, "nested/small": 100}


def _check_position(req: pb.StreamBatchesRequest) -> None:
    """The position's own bounds, checked before the plan's (InvalidArgument)."""
    if not 0 <= req.batches_per_message <= 1024 or req.epoch < 0 or req.step < 0:
        raise InvalidArgument("position")


def _message_status(req: pb.StreamBatchesRequest, batch_tokens: int) -> str:
    """The last check: a message of the request's batches (uint32) fits the limit."""
    per_message = max(1, req.batches_per_message)
    return "INVALID_ARGUMENT" if per_message * batch_tokens * 4 > MAX_BATCH_BYTES else "OK"


def expected_mixture_status(req: pb.StreamBatchesRequest) -> str:
    """A mixture's status, in the server's order: the request's values (SamplingSpec
    is the oracle), each source's name, its train windows, the stream position, the
    message size."""
    try:
        spec = SamplingSpec.from_proto(req.params)
    except FeederError as e:
        return e.code
    for name in spec.source_names:
        if _bad_name(name):
            return "INVALID_ARGUMENT"
        if name not in SIZES:
            return "NOT_FOUND"
    try:
        sampler = MixtureSampler(
            spec,
            tuple(SIZES[n] for n in spec.source_names),
            tuple(BLOCKS[n] for n in spec.source_names),
        )
        _check_position(req)
        if req.epoch != 0:
            raise InvalidArgument("epoch")
        sampler.check(req.rank, req.offset, req.step)
    except FeederError as e:
        return e.code
    return _message_status(req, spec.batch_size * (spec.seq_len + spec.max_shift))


def expected_status(req: pb.StreamBatchesRequest) -> str:
    """The status code the request calls for (see the module docstring)."""
    p = req.params
    if len(p.sources) or len(p.schedule):
        return expected_mixture_status(req)
    try:  # the server reads the request (SamplingSpec) before it looks the name up
        SamplingSpec.from_proto(p)
    except FeederError as e:
        return e.code
    name = p.dataset
    if _bad_name(name):
        return "INVALID_ARGUMENT"
    if name not in SIZES:
        return "NOT_FOUND"
    mode = p.WhichOneof("shift_mode")
    shift = int(p.shift) if mode == "shift" else ("auto" if mode and p.auto_shift else 1)
    try:
        # The .proto's documented defaults for unset fields.
        sampler = make_sampler(
            total_tokens=SIZES[name],
            split=p.split or "train",
            split_rate=p.split_rate if p.HasField("split_rate") else 1.0,
            seq_len=p.seq_len,
            stride=p.stride or p.seq_len,
            batch_size=p.batch_size,
            world_size=p.world_size or 1,
            shift=shift,
            seed=p.seed,
            shuffle=p.shuffle,
            shuffle_blocks=p.shuffle_blocks or 8,
            block_tokens=BLOCKS[name],
        )
        _check_position(req)
        sampler.steps(req.rank, req.offset)
        # the first round checks what keeps the sampling math inside int64
        if req.epoch > MAX_PARAM or req.step > MAX_TOKENS:
            raise InvalidArgument("epoch or step too large")
    except FeederError as e:
        return e.code
    return _message_status(req, sampler.batch_size * (sampler.seq_len + sampler.max_shift))


@st.composite
def stream_requests(draw) -> pb.StreamBatchesRequest:
    small = st.integers(1, 64)
    # Fields may be left unset (None): the wire's documented defaults apply.
    fields = dict(
        dataset=draw(NAMES),
        split=draw(st.sampled_from(["train", "validation", "", "test", "TRAIN"])),
        split_rate=draw(st.one_of(st.none(), DOUBLES)),
        seq_len=draw(st.one_of(small, INT64)),
        stride=draw(st.one_of(small, INT64, st.just(0))),
        batch_size=draw(st.one_of(st.integers(1, 8), INT64)),
        seed=draw(st.integers(0, 2**64 - 1)),
        shuffle=draw(st.booleans()),
        shuffle_blocks=draw(st.one_of(st.integers(0, 4), INT64)),
        world_size=draw(st.one_of(st.integers(0, 4), INT64)),
    )
    if draw(st.integers(0, 2)) == 0:  # a third are mixtures
        fields["dataset"] = draw(st.sampled_from(["", "", "", "positions"]))
        fields["split"] = draw(st.sampled_from(["train", "", "train", "validation"]))
    params = pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    if fields["dataset"] in ("", "positions") and fields["split"] in ("train", "", "validation"):
        draw_mixture(draw, params)
    mode = draw(st.sampled_from(["none", "shift", "auto", "auto_false"]))
    if mode == "shift":
        params.shift = draw(st.one_of(st.integers(-2, 8), INT64))
    elif mode in ("auto", "auto_false"):
        params.auto_shift = mode == "auto"
    return pb.StreamBatchesRequest(
        params=params,
        epoch=draw(st.one_of(st.integers(0, 3), INT64)),
        rank=draw(st.one_of(st.integers(0, 3), INT64)),
        offset=draw(st.one_of(st.integers(0, 50), INT64)),
        step=draw(st.one_of(st.integers(0, 5), INT64)),
        batches_per_message=draw(st.one_of(st.integers(0, 4), INT64)),
    )


SOURCE_NAMES = st.one_of(
    st.sampled_from(["positions", "nested/small", "positions", "nope", "", "../outside"]),
    NAMES,
)
WEIGHTS = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, 0.1, 0.7, 2.0, -1.0, 1 / 3]),
    st.floats(allow_nan=True),
)


def draw_mixture(draw, params: pb.SamplingParams) -> None:
    """Sources and a schedule: mostly well-formed, sometimes not (duplicates, a
    segment missing or adding a source, starts that do not increase, bad weights)."""
    k = draw(st.integers(0, 4))
    names = [draw(SOURCE_NAMES) for _ in range(k)]
    for name in names:
        params.sources.add(name=name, weight=draw(WEIGHTS))
    tok = 0
    for _ in range(draw(st.integers(0, 3))):
        near = st.integers(max(tok - 5, -(2**63)), min(tok + 10_000, 2**63 - 1))
        tok = draw(st.one_of(near, INT64))
        seg = params.schedule.add(from_tokens=tok)
        shuffled = draw(st.permutations(names)) if names else []
        kept = shuffled if draw(st.integers(0, 4)) else shuffled[1:]
        for name in kept:
            seg.weights.add(name=name, weight=draw(WEIGHTS))
        if not draw(st.integers(0, 6)):
            seg.weights.add(name=draw(SOURCE_NAMES), weight=1.0)


class Canary:
    """A well-behaved trainer streaming validation epochs and checking every token."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.batches = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        params = feeder_params(
            split="validation", split_rate=0.5, seq_len=16, stride=8, shuffle=True
        )
        with grpc.insecure_channel(self.address) as ch:
            stub = feeder_pb2_grpc.FeederStub(ch)
            epoch = 0
            while not self._stop.is_set():
                try:
                    for msg in stub.StreamBatches(
                        pb.StreamBatchesRequest(params=params, epoch=epoch), timeout=60
                    ):
                        for b in msg.batches:
                            rows = np.frombuffer(b.tokens, "<u4").reshape(b.rows, b.cols)
                            want = np.asarray(b.starts)[:, None] + np.arange(b.cols)
                            if not np.array_equal(rows, want):
                                self.errors.append(f"wrong tokens at step {b.step}")
                            self.batches += 1
                        if self._stop.is_set():
                            break
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code()}: {e.details()}")
                epoch += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _check(stub, req: pb.StreamBatchesRequest) -> None:
    want = expected_status(req)
    call = stub.StreamBatches(req, timeout=30)
    got, details = "OK", ""
    try:
        first = next(iter(call), None)
    except grpc.RpcError as e:
        got, details = e.code().name, e.details()
    finally:
        call.cancel()
    assert got == want, f"{req} -> {got}, expected {want}"
    if got != "OK":
        assert details, f"{got} without a message for {req}"
        assert "Traceback" not in details
        assert str(Path("/tmp")) not in details
    if got == "OK" and first is not None:
        for b in first.batches:
            rows = np.frombuffer(b.tokens, "<u4").reshape(b.rows, b.cols)
            assert not (rows == SECRET).all(), "served a store from outside the data root"
            assert np.array_equal(rows, np.asarray(b.starts)[:, None] + np.arange(b.cols))


@pytest.mark.slow
def test_thousands_of_random_requests_get_the_right_status(fuzz_feeder) -> None:
    canary = Canary(fuzz_feeder.address)
    counter = {"n": 0}
    examples = int(os.environ.get("TOKENFEED_FUZZ_EXAMPLES", "10000"))
    with grpc.insecure_channel(fuzz_feeder.address) as ch:
        stub = feeder_pb2_grpc.FeederStub(ch)

        # a campaign of its own size (the profile's count is for property tests), the
        # same requests each run
        @settings(max_examples=examples, derandomize=True)
        @given(stream_requests())
        def fuzz(req: pb.StreamBatchesRequest) -> None:
            counter["n"] += 1
            _check(stub, req)

        fuzz()
    canary.stop()
    assert counter["n"] >= examples
    assert canary.errors == []
    assert canary.batches > 0


def test_adversarial_requests_quick(fuzz_feeder) -> None:
    """The fixed adversarial cases, in the default run."""
    base = dict(split="train", split_rate=0.9, seq_len=16, stride=16, batch_size=2, world_size=1)
    cases = [
        dict(dataset="../outside"),
        dict(dataset="escape"),
        dict(dataset="/etc/passwd"),
        dict(dataset=""),
        dict(dataset="nope"),
        dict(dataset="positions", seq_len=-5),
        dict(dataset="positions", seq_len=2**63 - 1),
        dict(dataset="positions", stride=0),
        dict(dataset="positions", batch_size=2**62),
        dict(dataset="positions", world_size=-1),
        dict(dataset="positions", split_rate=math.nan),
        dict(dataset="positions", split="dev"),
        dict(dataset="positions", shift=3),
        dict(dataset="positions", seq_len=13, auto_shift=True),
        dict(dataset="positions", seq_len=5000),
        dict(dataset="positions"),
    ]
    with grpc.insecure_channel(fuzz_feeder.address) as ch:
        stub = feeder_pb2_grpc.FeederStub(ch)
        for case in cases:
            _check(stub, pb.StreamBatchesRequest(params=pb.SamplingParams(**(base | case))))
        for extra in (
            dict(rank=1),
            dict(offset=-1),
            dict(offset=10**9),
            dict(epoch=-1),
            dict(batches_per_message=5000),
        ):
            req = pb.StreamBatchesRequest(
                params=pb.SamplingParams(dataset="positions", **base), **extra
            )
            _check(stub, req)


def _raw_request(dataset: bytes) -> bytes:
    """A StreamBatchesRequest whose dataset name is arbitrary bytes (maybe not UTF-8)."""
    good = pb.SamplingParams(
        split="train", split_rate=0.9, seq_len=16, stride=16, batch_size=2, world_size=1
    ).SerializeToString()
    params = b"\x0a" + bytes([len(dataset)]) + dataset + good
    return b"\x0a" + bytes([len(params)]) + params


@pytest.mark.parametrize("name", [b"\xff\xfe", b"pos\x80itions", b"\xc0\xaf..", b"positions"])
def test_non_utf8_names_are_invalid_argument(fuzz_feeder, name: bytes) -> None:
    with grpc.insecure_channel(fuzz_feeder.address) as ch:
        call = ch.unary_stream("/tokenfeed.v1.Feeder/StreamBatches")(_raw_request(name), timeout=30)
        if name == b"positions":  # the same bytes, valid: proves the encoding is right
            assert next(iter(call))
            call.cancel()
            return
        with pytest.raises(grpc.RpcError) as err:
            next(iter(call))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "UTF-8" in err.value.details()


@given(name=NAMES, with_params=st.booleans(), rank=INT64)
def test_info_fuzz(fuzz_feeder, name: str, with_params: bool, rank: int) -> None:
    params = feeder_params(dataset=name, seq_len=16, stride=16, batch_size=2)
    req = pb.InfoRequest(dataset=name, rank=rank)
    if with_params:
        req.params.CopyFrom(params)
    # An empty name lists every dataset; otherwise the name decides as for a stream.
    want = "OK" if name == "" else expected_status(pb.StreamBatchesRequest(params=params))
    if want == "OK" and with_params and rank != 0:
        want = "INVALID_ARGUMENT"  # steps are reported for `rank`, which must be < world_size
    with grpc.insecure_channel(fuzz_feeder.address) as ch:
        got, details = "OK", ""
        try:
            resp = feeder_pb2_grpc.FeederStub(ch).Info(req, timeout=30)
        except grpc.RpcError as e:
            got, details = e.code().name, e.details()
    assert got == want, (name, rank, got, want)
    assert got == "OK" or details, f"{got} without a message"
    if got == "OK":
        names = [d.name for d in resp.datasets]
        assert "escape" not in names
        assert set(names) <= {"positions", "nested/small"}
