"""`tokenfeed serve` as a real process: flags, metrics port, SIGTERM drain, restart."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import free_port, registered_series, wait_until
from support.feeders import FEEDER_DATASET, FeederProcess, feeder_params

# one step per message, ~8,900 of them: a stream that is still open when SIGTERM comes
LONG = pb.StreamBatchesRequest(params=feeder_params(stride=1, batch_size=1))


def wait_for_log(proc: FeederProcess, text: str) -> None:
    def logged() -> bool:
        assert proc.proc.poll() is None or text in proc.log(), proc.log()
        return text in proc.log()

    wait_until(logged, 60, f"{text!r} in the feeder's log")


def test_sigterm_drains_and_exits_zero(feeder_root: Path) -> None:
    metrics_port = free_port()
    with FeederProcess(
        feeder_root, grace_seconds=2, metrics_port=metrics_port, cache_bytes="1M"
    ) as proc:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        for name in registered_series(client=False):
            assert name in text
        assert "tokenfeed_cache_capacity_bytes 1.048576e+06" in text
        with grpc.insecure_channel(proc.address) as ch:
            s = pb_grpc.FeederStub(ch)
            open_stream = s.StreamBatches(LONG)
            first = next(open_stream)
            assert first.batches[0].step == 0
            proc.proc.send_signal(15)
            wait_for_log(proc, "draining")
            # new work is refused while the open stream drains
            with pytest.raises(grpc.RpcError) as info:
                list(s.StreamBatches(LONG, timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # the open stream keeps delivering in order until it ends or the grace is over
            steps, ended = [first.batches[0].step], grpc.StatusCode.OK
            try:
                for msg in open_stream:
                    steps.append(msg.batches[0].step)
            except grpc.RpcError as e:
                ended = e.code()
            ok = (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            assert ended in (*ok, grpc.StatusCode.ABORTED), ended
            assert steps == list(range(len(steps)))
        assert proc.proc.wait(60) == 0
        assert "stopped" in proc.log()
        assert proc.terminate() == 0  # a second SIGTERM after the drain is harmless


def test_restart_on_the_same_port(feeder_root: Path) -> None:
    with FeederProcess(feeder_root) as proc:
        address = proc.address
        proc.kill()
        proc.restart()
        assert proc.address == address
        with grpc.insecure_channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            info = pb_grpc.FeederStub(ch).Info(pb.InfoRequest(), timeout=10)
            assert [d.name for d in info.datasets] == [FEEDER_DATASET]


def test_bad_flags_exit_2_with_a_message(feeder_root: Path) -> None:
    with pytest.raises(RuntimeError, match="--cache-bytes must be in"):
        FeederProcess(feeder_root, cache_bytes=0)
