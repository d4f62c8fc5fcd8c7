"""A stream that needs no Info call first: the feeder's first response tells the client
what Info would (`describe`) and picks the batches per message by bytes
(`message_bytes`); against a feeder that predates both the client asks Info.

Info calls are counted by wrapping the real servicer's `Info` before the feeder starts
(its answer is the real one)."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import grpc
import pytest

from tokenfeed.client import FeederClient
from tokenfeed.core.limits import packed_batches
from tokenfeed.server.service import FeederService, Received
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

from support.feeders import FEEDER_DATASET, feeder_params, running_feeder
from support.stores import make_positional_store


@pytest.fixture
def info_calls(monkeypatch: pytest.MonkeyPatch) -> list[pb.InfoRequest]:
    """The Info requests every feeder started after this fixture answers."""
    calls: list[pb.InfoRequest] = []
    real = FeederService.Info

    async def counted(self, request, context):  # type: ignore[no-untyped-def]
        calls.append(request)
        return await real(self, request, context)

    monkeypatch.setattr(FeederService, "Info", counted)
    return calls


@pytest.fixture
def predating(monkeypatch: pytest.MonkeyPatch) -> None:
    """Feeders started after this fixture read requests as a feeder built before
    `describe` and `message_bytes` did: both fields unknown, so unset."""
    real = FeederService._prepare_stream

    def old(self, request, entry):  # type: ignore[no-untyped-def]
        if isinstance(request, Received):
            request.message.ClearField("describe")
            request.message.ClearField("message_bytes")
        return real(self, request, entry)

    monkeypatch.setattr(FeederService, "_prepare_stream", old)


def _client(address: str, **kw) -> FeederClient:  # type: ignore[no-untyped-def]
    args = {"dataset": FEEDER_DATASET, "seq_len": 16, "batch_size": 4, "world_size": 1, **kw}
    return FeederClient(address, **args)


def _epochs(client: FeederClient, n: int) -> list[list[int]]:
    out = []
    for epoch in range(n):
        client.set_epoch(epoch)
        out.append([s for batch in client for s in batch["starts"].tolist()])
    return out


def _responses(address: str, **request) -> Iterator[pb.StreamBatchesResponse]:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(address) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        yield from stub.StreamBatches(pb.StreamBatchesRequest(**request))


KW = {"shuffle": True, "seed": 3, "stride": 8, "world_size": 2, "rank": 1}


def test_iterating_first_makes_no_info_call_and_len_is_what_the_stream_told(
    feeder_root: Path, info_calls: list[pb.InfoRequest]
) -> None:
    with running_feeder(feeder_root) as f:
        with _client(f.address, **KW) as asked:  # the old order: Info, then the stream
            steps, info = len(asked), asked.dataset_info
            expected = _epochs(asked, 3)
        assert len(info_calls) == 1
        for per_message in (None, 3):
            with _client(f.address, batches_per_message=per_message, **KW) as c:
                assert _epochs(c, 3) == expected  # lookahead streams the next epochs
                assert (len(c), c.dataset_info, c.steps_left) == (steps, info, 0)
        assert len(info_calls) == 1  # told by the streams
        assert [len(e) for e in expected] == [steps * 4] * 3


def test_resume_mid_epoch_with_no_info_call(
    feeder_root: Path, info_calls: list[pb.InfoRequest]
) -> None:
    with running_feeder(feeder_root) as f, _client(f.address, **KW) as c:
        whole = _epochs(c, 2)
        with _client(f.address, **KW) as first:
            assert len(list(islice(first, 3))) == 3
            state = first.state_dict()
        with _client(f.address, **KW) as resumed:
            resumed.load_state_dict(state)
            rest = _epochs(resumed, 2)
        assert rest == [whole[0][12:], whole[1]]
        with _client(f.address, **KW) as at_end:  # an epoch's end: the stream tells only
            at_end.load_state_dict(resumed.state_dict() | {"epoch": 0})
            assert [b["step"] for b in at_end] == []
            assert at_end.steps_left == 0
        assert info_calls == []


def test_the_first_response_tells_info_and_packs_by_bytes(feeder_root: Path) -> None:
    params = feeder_params(seq_len=16, stride=8, world_size=2)
    with running_feeder(feeder_root) as f:
        with grpc.insecure_channel(f.address) as channel:
            info = feeder_pb2_grpc.FeederStub(channel).Info(
                pb.InfoRequest(dataset=FEEDER_DATASET, params=params, rank=1)
            )
        for message_bytes in (0, 1, 2000, 1 << 20):
            got = list(
                _responses(
                    f.address,
                    params=params,
                    rank=1,
                    batches_per_message=2,
                    message_bytes=message_bytes,
                    describe=True,
                )
            )
            header = got[0]
            per_message = packed_batches(message_bytes, 4, 16, 4) if message_bytes else 2
            assert len(header.batches) == 1  # the first batch travels alone
            assert header.info == info  # what Info answers
            assert header.batches_per_message == per_message
            assert not any(r.batches_per_message or r.HasField("info") for r in got[1:])
            sizes = [len(r.batches) for r in got]
            assert max(sizes) == per_message
            assert sum(sizes) == info.datasets[0].splits[0].steps
        # packing by bytes alone: the count, without Info's answer
        header = next(_responses(f.address, params=params, rank=1, message_bytes=2000))
        assert len(header.batches) == 1
        assert not header.HasField("info")
        assert header.batches_per_message == packed_batches(2000, 4, 16, 4) == 7
        # an epoch with no step left from the offset: the answer alone
        (last,) = _responses(
            f.address,
            params=params,
            rank=1,
            offset=info.datasets[0].splits[0].windows,
            describe=True,
        )
        assert not last.batches
        assert last.info == info
        # a request with neither (an older or other-language client): batches at once
        first = next(_responses(f.address, params=params, rank=1, batches_per_message=2))
        assert first.batches
        assert not first.batches_per_message
        with pytest.raises(grpc.RpcError) as e:
            next(_responses(f.address, params=params, message_bytes=-1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "message_bytes" in (e.value.details() or "")


def test_a_feeder_that_predates_describe_is_asked_info(
    feeder_root: Path, info_calls: list[pb.InfoRequest], predating: None
) -> None:
    with running_feeder(feeder_root) as f:
        with _client(f.address, **KW) as c:
            got = _epochs(c, 3)
            assert len(info_calls) == 1  # by the first stream, on its first batches
            steps = len(c)
        assert len(info_calls) == 1
        with _client(f.address, **KW) as asked:
            assert len(asked) == steps
            assert _epochs(asked, 3) == got
        assert [len(e) for e in got] == [steps * 4] * 3


def test_a_mixture_streams_with_no_info_call(
    tmp_path: Path, info_calls: list[pb.InfoRequest]
) -> None:
    for name in ("a", "b"):
        make_positional_store(tmp_path / name, 5_000, 1_000)
    mixture = {"a": 0.7, "b": 0.3}
    with running_feeder(tmp_path) as f:
        with _client(f.address, dataset=None, mixture=mixture) as c:
            it = iter(c)
            first = [next(it)["sources"].tolist() for _ in range(20)]
        assert info_calls == []
        with _client(f.address, dataset=None, mixture=mixture) as c:
            assert c.dataset_info.source_windows  # asked when wanted
            it = iter(c)
            assert [next(it)["sources"].tolist() for _ in range(20)] == first
        assert len(info_calls) == 1
        # asked for on the wire, a mixture's first response tells what Info says too
        params = c.spec.to_proto()
        with grpc.insecure_channel(f.address) as channel:
            info = feeder_pb2_grpc.FeederStub(channel).Info(pb.InfoRequest(params=params))
        header = next(_responses(f.address, params=params, describe=True))
        assert header.info == info
        assert header.batches_per_message == 1
