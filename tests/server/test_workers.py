"""`tokenfeed serve --workers N`: real supervisor and worker processes on one port.

Which worker serves a connection is the kernel's choice (SO_REUSEPORT hashes the
connection), so where a test needs both workers, or the one serving a client, it
looks at the sockets each worker process owns (/proc), never at timing.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from pathlib import Path

import grpc
import pytest

from tokenfeed.client import Backoff, FeederClient
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import free_port, registered_series, wait_until
from support.feeders import FEEDER_DATASET, FeederProcess, running_feeder, scrape
from support.stores import make_positional_store

FAST = Backoff(initial=0.05, maximum=0.5, deadline=60)
KW = {"seq_len": 64, "stride": 8, "batch_size": 4, "shuffle": True, "seed": 3}


# ------------------------------------------------------------------------- helpers


def worker_pids(proc: FeederProcess) -> list[int]:
    """The supervisor's worker processes (its children running tokenfeed.server.worker)."""
    assert proc.proc is not None
    pid = proc.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    out = []
    for c in children:
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            continue
        if b"tokenfeed.server.worker" in cmd:
            out.append(int(c))
    return sorted(out)


def _sockets(port: int, states: set[str]) -> set[int]:
    """Inodes of the TCP sockets with local port `port` in one of `states` (hex codes)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] in states:
                inodes.add(int(f[9]))
    return inodes


def owned(pid: int, inodes: set[int]) -> int:
    """How many of `inodes` process `pid` holds open."""
    n = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and int(link[8:-1]) in inodes:
            n += 1
    return n


def connections(pid: int, port: int) -> int:
    """Established connections to `port` that process `pid` serves."""
    return owned(pid, _sockets(port, {"01"}))


def listeners(port: int) -> int:
    return len(_sockets(port, {"0A"}))


def expected_starts(root: Path, dataset: str, world: int) -> list[list[int]]:
    """Each rank's window starts for one epoch, from an in-process single feeder."""
    with running_feeder(root) as f:
        out = []
        for r in range(world):
            with FeederClient(f.address, dataset=dataset, rank=r, world_size=world, **KW) as c:
                out.append([s for b in c for s in b["starts"].tolist()])
        return out


def stream_request(stride: int = 8) -> pb.StreamBatchesRequest:
    """One rank's epoch of `positions`, one batch per message (stride 1: ~2,500 messages)."""
    params = pb.SamplingParams(
        dataset=FEEDER_DATASET, split="train", seq_len=64, stride=stride, batch_size=4, world_size=1
    )
    return pb.StreamBatchesRequest(params=params, batches_per_message=1)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A `--workers 2` feeder with a metrics port, shared by the tests that only read."""
    root = tmp_path_factory.mktemp("workers-data")
    make_positional_store(root / FEEDER_DATASET, 10_000, 1_000)
    metrics_port = free_port()
    with FeederProcess(root, workers=2, cache_bytes="1M", metrics_port=metrics_port) as proc:
        proc.metrics_port = metrics_port  # type: ignore[attr-defined]
        yield proc


def test_two_workers_listen_on_one_port_and_serve_every_rank_exactly_once(node) -> None:  # type: ignore[no-untyped-def]
    pids = worker_pids(node)
    assert len(pids) == 2
    assert listeners(node.port) == 2  # two listening sockets on one port: SO_REUSEPORT
    world = 4
    expected = expected_starts(node.data_root, FEEDER_DATASET, world)
    got: dict[int, list[int]] = {}

    def rank(r: int) -> None:
        with FeederClient(
            node.address, dataset=FEEDER_DATASET, rank=r, world_size=world, **KW
        ) as c:
            got[r] = [s for b in c for s in b["starts"].tolist()]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[r] for r in range(world)] == expected


def test_one_metrics_endpoint_sums_every_worker(node) -> None:  # type: ignore[no-untyped-def]
    before = scrape(node.metrics_port)
    labels = (("dataset", FEEDER_DATASET), ("source", ""), ("split", "train"))
    key = ("tokenfeed_server_tokens_sent_total", labels)
    pids = worker_pids(node)
    # Open channels until each worker serves at least one (the kernel spreads them).
    channels: list[grpc.Channel] = []
    try:
        while not all(connections(p, node.port) for p in pids):
            assert len(channels) < 64, "the kernel never gave the second worker a connection"
            ch = grpc.insecure_channel(
                node.address, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            grpc.channel_ready_future(ch).result(timeout=30)
            channels.append(ch)
        received = 0
        bad = stream_request()
        bad.params.dataset = "missing"
        with pytest.raises(grpc.RpcError):  # an error, so errors_total has a series too
            list(pb_grpc.FeederStub(channels[0]).StreamBatches(bad, timeout=60))
        for ch in channels:
            for msg in pb_grpc.FeederStub(ch).StreamBatches(stream_request(), timeout=60):
                received += sum(b.rows * b.cols for b in msg.batches)
    finally:
        for ch in channels:
            ch.close()
    after = scrape(node.metrics_port)
    assert after[key] - before.get(key, 0.0) == received  # one summed series, exact
    names = {name for name, _ in after}
    for series in registered_series(client=False, supervisor=True):
        assert series in names or series.endswith("_bucket"), series
    assert after[("tokenfeed_cache_capacity_bytes", ())] == 1 << 20  # 2 x 512 KiB
    assert after[("tokenfeed_server_workers", ())] == 2
    assert after[("tokenfeed_server_streams_active", ())] == 0
    assert after[("tokenfeed_cache_hits_total", ())] > 0


def test_so_reuseport_only_in_workers_mode(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_positional_store(root / FEEDER_DATASET, 10_000, 1_000)
    with FeederProcess(root) as single:  # the default: one process, SO_REUSEPORT off
        assert listeners(single.port) == 1
        with pytest.raises(RuntimeError, match="exited"):
            FeederProcess(root, port=single.port)
        with pytest.raises(RuntimeError, match="exited"):
            FeederProcess(root, port=single.port, workers=2)
    port = free_port()
    with FeederProcess(root, port=port, workers=2) as node:
        assert listeners(node.port) == 2
        with pytest.raises(RuntimeError, match="exited") as info:
            FeederProcess(root, port=port)
        assert "address already in use" in str(info.value).lower()
        with pytest.raises(RuntimeError, match="another server on it"):
            FeederProcess(root, port=port, workers=2)
        assert listeners(node.port) == 2


@pytest.mark.slow
def test_sigterm_drains_every_worker_and_exits_zero(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_positional_store(root / FEEDER_DATASET, 10_000, 1_000)
    with FeederProcess(root, workers=2, grace_seconds=2) as node:
        pids = worker_pids(node)
        with grpc.insecure_channel(node.address) as ch:
            stream = pb_grpc.FeederStub(ch).StreamBatches(stream_request(stride=1))
            first = next(stream)  # an open stream on one of the workers
            assert first.batches[0].step == 0
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)
            steps, ended = [first.batches[0].step], grpc.StatusCode.OK
            try:
                for msg in stream:  # it keeps delivering, in order, while it drains
                    steps.append(msg.batches[0].step)
            except grpc.RpcError as e:
                ended = e.code()
            ok = (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            assert ended in ok, ended
            assert steps == list(range(len(steps)))
        assert node.proc.wait(60) == 0
        log = node.log()
        assert "draining 2 workers" in log
        assert log.count("[worker 0]: stopped") == 1
        assert log.count("[worker 1]: stopped") == 1
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def test_sigusr1_is_forwarded_and_every_worker_dumps_its_stacks(node) -> None:  # type: ignore[no-untyped-def]
    """A stuck node is diagnosed by one signal to the process its operator knows: each
    worker dumps its threads and its tasks, and serves on."""
    assert node.proc is not None
    before = node.log()
    node.proc.send_signal(signal.SIGUSR1)

    def dumped() -> list[str]:
        text = node.log()[len(before) :]
        return re.findall(
            r"\[worker (\d)\]: SIGUSR1: threads .*\n\d+ tasks on the event loop", text
        )

    wait_until(lambda: len(dumped()) == 2, 30, "both workers' task lists")
    assert sorted(dumped()) == ["0", "1"]
    after = node.log()[len(before) :]
    assert "SIGUSR1: forwarded to 2 workers" in after
    assert after.count("Thread 0x") >= 2 * 2  # faulthandler's: every thread of both
    with grpc.insecure_channel(node.address) as ch:
        assert pb_grpc.FeederStub(ch).Info(pb.InfoRequest(), timeout=30).datasets


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow
def test_killed_worker_is_replaced_and_its_clients_finish_exactly_once(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_positional_store(root / "big", 200_000, 20_000)
    world, pause_at = 4, 20
    expected = expected_starts(root, "big", world)
    metrics_port = free_port()
    with FeederProcess(root, workers=2, metrics_port=metrics_port, cache_bytes="4M") as node:
        pids = worker_pids(node)
        paused = [threading.Event() for _ in range(world)]
        go = threading.Event()
        got: dict[int, list[int]] = {}
        reconnects: dict[int, int] = {}

        def rank(r: int) -> None:
            with FeederClient(
                node.address,
                dataset="big",
                rank=r,
                world_size=world,
                backoff=FAST,
                prefetch=2,
                batches_per_message=1,
                **KW,
            ) as c:
                seen: list[int] = []
                for i, b in enumerate(c):
                    seen += b["starts"].tolist()
                    if i + 1 == pause_at:  # mid-epoch: the stream is open, held by flow control
                        paused[r].set()
                        go.wait(120)
                got[r], reconnects[r] = seen, c.reconnects

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        try:
            for e in paused:
                assert e.wait(120)
            victim = max(pids, key=lambda p: connections(p, node.port))
            served = connections(victim, node.port)
            assert served >= 1
            os.kill(victim, signal.SIGKILL)
        finally:
            go.set()
            for t in threads:
                t.join(120)
        assert [got[r] for r in range(world)] == expected
        assert sum(reconnects.values()) >= 1
        wait_until(lambda: len(worker_pids(node)) == 2, 60, "a replacement worker")
        replacement = set(worker_pids(node)) - set(pids)
        assert len(replacement) == 1
        assert victim not in worker_pids(node)
        wait_until(
            lambda: scrape(metrics_port).get(("tokenfeed_server_workers", ())) == 2,
            60,
            "the replacement to serve",
        )
        m = scrape(metrics_port)
        assert m[("tokenfeed_server_worker_restarts_total", ())] == 1
        assert m[("tokenfeed_server_streams_active", ())] == 0  # the dead worker's gauge went
        assert f"worker {pids.index(victim)} (pid {victim}) was killed by SIGKILL" in node.log()
        assert node.terminate() == 0


@pytest.mark.slow
def test_a_killed_supervisors_state_folder_is_removed_once_its_workers_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor killed outright leaves its state folder (metric files, status) in
    $TMPDIR; the next supervisor to start removes it, but not while one of its workers
    still runs (drains), and never the folder of a supervisor that runs."""
    root = tmp_path / "data"
    make_positional_store(root / FEEDER_DATASET, 10_000, 1_000)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the supervisors' temporary directory

    def folders() -> set[Path]:
        return set(tmp.glob("tokenfeed-workers-*"))

    killed = FeederProcess(root, workers=2)
    (left,) = folders()
    pids = worker_pids(killed)
    try:
        os.kill(pids[0], signal.SIGSTOP)  # a worker that has not finished draining
        killed.kill()
        with FeederProcess(root, workers=2) as second:
            (own,) = folders() - {left}  # the stopped worker holds `left`'s lock
            os.kill(pids[0], signal.SIGKILL)
            wait_until(lambda: _state(pids[0]) in ("Z", "gone"), 30, "the worker gone")
            with FeederProcess(root, workers=2) as third:
                assert left not in folders()
                assert own in folders()  # a running supervisor's is kept
                assert f"removing {left}, left by a supervisor that was killed" in third.log()
                assert second.terminate() == 0
                assert third.terminate() == 0
        assert folders() == set()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGKILL)
        killed.stop()
