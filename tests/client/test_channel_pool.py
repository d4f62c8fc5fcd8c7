"""The clients of one process share one gRPC channel per destination (channel_pool).

Real feeders on loopback: two clients share a channel (the pool says so, and the feeder
sees both streams come from one connection) and each gets exactly its batches; one
client closed mid-stream leaves the other streaming; a client that fails over retires
the channel without breaking the others, and dials a fresh connection, not one in
gRPC's reconnect backoff; a forked child dials its own. A replica killed under two
clients sharing a channel: tests/e2e/test_replicas.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from tokenfeed.client import Backoff, Connection, FeederClient
from tokenfeed.client.channel_pool import POOL
from tokenfeed.client.transport import Channels
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import free_port, wait_until
from support.feeders import FEEDER_DATASET, InProcessFeeder, running_feeder
from support.stores import make_positional_store, make_sampler

TOKENS, CHUNK = 400_000, 40_000
# ~12,500 batches of 1 KiB rows per rank: far more than flow control lets ahead, so a
# stream is still open on the feeder after its first batch
SPEC: dict[str, Any] = {"dataset": "big", "seq_len": 256, "stride": 8, "batch_size": 4}
KW: dict[str, Any] = {**SPEC, "world_size": 2, "prefetch": 2, "lookahead": False}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    make_positional_store(tmp_path / "big", TOKENS, CHUNK)
    return tmp_path


def expected(rank: int, world: int = 2) -> list[int]:
    sampler = make_sampler(TOKENS, block_tokens=CHUNK, world_size=world, **SPEC)
    return [s for b in sampler.batches(0, rank) for s in b.starts.tolist()]


def starts(batches: Any) -> list[int]:
    return [s for b in batches for s in b["starts"].tolist()]


def info(stub: pb_grpc.FeederStub) -> list[str]:
    return [d.name for d in stub.Info(pb.InfoRequest(), timeout=10).datasets]


def test_two_clients_share_one_channel_and_each_gets_exactly_its_batches(root: Path) -> None:
    with (
        running_feeder(root) as f,
        FeederClient(f.address, rank=0, **KW) as a,
        FeederClient(f.address, rank=1, **KW) as b,
    ):
        ia, ib = iter(a), iter(b)
        got = {0: starts([next(ia)]), 1: starts([next(ib)])}
        (shared,) = POOL.pooled(f.address)
        assert shared.holders == 2
        streams = f.server.service.streams.rows()
        assert len(streams) == 2
        assert len({s["peer"] for s in streams}) == 1  # one connection carries both
        got[0] += starts(ia)
        got[1] += starts(ib)
    assert got == {0: expected(0), 1: expected(1)}
    assert POOL.pooled(f.address) == []  # the last client closed it


def test_a_client_closed_mid_stream_leaves_the_other_streaming(root: Path) -> None:
    with running_feeder(root) as f:
        with FeederClient(f.address, rank=1, **KW) as b:
            ib = iter(b)
            got = starts([next(ib)])
            a = FeederClient(f.address, rank=0, **KW)
            next(iter(a))
            (shared,) = POOL.pooled(f.address)
            assert shared.holders == 2
            a.close()
            assert shared.holders == 1
            assert POOL.pooled(f.address) == [shared]  # still the one new clients share
            streams = f.server.service.streams
            wait_until(lambda: len(streams.rows()) == 1, 30, "the closed client's stream to end")
            got += starts(ib)
        assert got == expected(1)
        assert shared.holders == 0
        assert POOL.pooled(f.address) == []
        with pytest.raises(ValueError, match=r"(?i)closed"):
            info(shared.stub)  # closed by the last client to release it


def test_a_client_refused_retires_the_channel_while_two_others_stream_on_it(
    root: Path,
) -> None:
    """The feeder's stream limit refuses the third client (RESOURCE_EXHAUSTED, retried):
    its failure retires the channel the three shared, the other two keep streaming on
    it, and once one of them ends, the third gets in; all three exactly."""
    kw = {**KW, "world_size": 3}
    with (
        running_feeder(root, max_streams=2) as f,
        FeederClient(f.address, rank=0, **kw) as a,
        FeederClient(f.address, rank=1, **kw) as b,
        FeederClient(f.address, rank=2, backoff=Backoff(initial=0.05, maximum=0.2), **kw) as c,
    ):
        ia, ib = iter(a), iter(b)
        got = {0: starts([next(ia)]), 1: starts([next(ib)])}
        (shared,) = POOL.pooled(f.address)
        third = threading.Thread(target=lambda: got.__setitem__(2, starts(c)))
        third.start()
        # refused, c retires the channel: it comes back on a fresh one
        wait_until(lambda: shared not in POOL.pooled(f.address), 60, "the channel retired")
        assert c.reconnects > 0
        assert shared.holders == 2  # a and b stream on
        got[0] += starts(ia)
        a.close()
        got[1] += starts(ib)
        third.join(120)
    assert got == {r: expected(r, world=3) for r in range(3)}


def test_failing_over_retires_the_channel_without_closing_it_for_others(feeder) -> None:
    a, b = Channels(Connection(feeder.address)), Channels(Connection(feeder.address))
    try:
        old = a.stub()
        assert b.stub() is old
        a.rotate()  # what a client does after a failure on its stream
        assert POOL.pooled(feeder.address) == []  # the next acquirer dials afresh
        fresh = a.stub()
        assert fresh is not old
        c = Channels(Connection(feeder.address))
        assert c.stub() is fresh
        c.close()
        assert info(b.stub()) == info(fresh)  # b's stream on the retired channel goes on
        b.close()
        with pytest.raises(ValueError, match=r"(?i)closed"):
            info(old)  # b was its last holder
        assert info(a.stub()) == [FEEDER_DATASET]
    finally:
        a.close()
        b.close()


def test_a_fresh_channel_is_a_fresh_connection_not_one_in_reconnect_backoff(
    feeder_root: Path,
) -> None:
    """A retired channel another client still holds has its connection in gRPC's
    reconnect backoff; the failing client's fresh channel must not share it."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    a, b = Channels(Connection(address)), Channels(Connection(address))
    try:
        assert b.stub() is a.stub()
        with pytest.raises(grpc.RpcError) as refused:
            info(a.stub())  # nothing listens: the connection goes into backoff (>= 10 s)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        f = InProcessFeeder(feeder_root, port=port)
        try:
            a.rotate()
            assert info(a.stub()) == [FEEDER_DATASET]  # at once, on a connection of its own
        finally:
            f.stop()
    finally:
        a.close()
        b.close()


# A process with a client that holds a pooled channel forks; the child streams as rank
# 1, the parent (after the child exits) as rank 0, on the channel it had before.
FORKING = """
import json, os, sys
from tokenfeed.client import FeederClient
from tokenfeed.client.channel_pool import POOL
address, kw = sys.argv[1], json.loads(sys.argv[2])
a = FeederClient(address, rank=0, **kw)
a.dataset_info  # an Info call: the channel is open and pooled, no call in flight
(parents,) = POOL.pooled(address)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    inherited = len(POOL.pooled())
    with FeederClient(address, rank=1, **kw) as b:
        starts = [s for batch in b for s in batch["starts"].tolist()]
        pids = [s.key[0] for s in POOL.pooled(address)]
    os.write(write, json.dumps([inherited, pids, os.getpid(), starts]).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as f:
    inherited, pids, child, child_starts = json.loads(f.read())
assert os.waitpid(pid, 0)[1] == 0
assert POOL.pooled(address) == [parents]
starts = [s for batch in a for s in batch["starts"].tolist()]
a.close()
print(json.dumps({"inherited": inherited, "pids": pids, "child": child, "parent": os.getpid(),
                  "child_starts": child_starts, "parent_starts": starts}))
"""


def test_a_forked_child_dials_its_own_channel(root: Path) -> None:
    """gRPC supports a fork after channels exist with its fork support on (its
    GRPC_ENABLE_FORK_SUPPORT and GRPC_POLL_STRATEGY=poll): the child then dials its own
    channel, and the parent's still serves the parent."""
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "true", "GRPC_POLL_STRATEGY": "poll"}
    with running_feeder(root) as f:
        run = subprocess.run(
            [sys.executable, "-c", FORKING, f.address, json.dumps(KW)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["inherited"] == 0  # the child starts with an empty pool
    assert got["pids"] == [got["child"]]  # and dials a channel of its own
    assert got["child"] != got["parent"]
    assert got["child_starts"] == expected(1)
    assert got["parent_starts"] == expected(0)


def test_streams_whose_readers_wait_receive_a_bounded_window_on_a_shared_connection() -> None:
    """64 streams on one of the client's channels, each read once and then left: a server
    sending 1 MiB messages as fast as flow control lets it gets a few windows ahead per
    stream and then waits. (With gRPC's default BDP-probed windows the connection took
    ~1 GiB a second and the sends never stopped.)"""
    from concurrent import futures

    from tokenfeed.client import Security, Timeouts
    from tokenfeed.client.transport import STREAM_WINDOW_BYTES, Endpoint, channel_options

    streams, message = 64, bytes(1 << 20)
    sent = [0] * streams
    bound = streams * (STREAM_WINDOW_BYTES + 4 * len(message)) // len(message)

    def send(request: bytes, context: grpc.ServicerContext) -> Any:
        i = int(request)
        while context.is_active():
            sent[i] += 1
            yield message

    server = grpc.server(futures.ThreadPoolExecutor(streams + 4))
    identity = lambda b: b  # noqa: E731
    method = grpc.unary_stream_rpc_method_handler(send, identity, identity)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"S": method})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    target = f"127.0.0.1:{port}"
    options = channel_options(Timeouts(), Endpoint(target), Security())
    try:
        with grpc.insecure_channel(target, options) as ch:
            call = ch.unary_stream("/t.T/S", identity, identity)
            its = [iter(call(str(i).encode())) for i in range(streams)]
            for it in its:
                assert next(it) == message
            last, still = -1, 0
            while still < 5:  # unchanged for a second: every send waits for a window
                time.sleep(0.2)
                total = sum(sent)
                assert total <= bound, f"{total} MiB sent to 64 waiting readers"
                last, still = total, still + 1 if total == last else 0
    finally:
        server.stop(0)
