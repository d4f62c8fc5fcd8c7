"""Every dashboard query and every rule returns data from a real Prometheus.

A real feeder (`tokenfeed serve` subprocess) and three real streaming clients (ranks 0
and 1 of a dataset, and a mixture driven by an online mixer, each exporting its own
/metrics) are scraped every second by the Debian `prometheus` binary on 127.0.0.1,
which loads deploy/prometheus/rules and the job names
of deploy/prometheus/prometheus.yml. Then each PromQL expression of the dashboard and of
the recording rules is queried through the HTTP API and must return at least one finite
sample; each alert's operands (the part before its comparison, see
`alert_inner_expressions`) must too, because an alert is empty when all is well and
so proves nothing by itself. All rules must evaluate without error.

The traffic covers the series that only appear after an event: one client is given a
dead address first (a reconnect), one request names a missing dataset (an error by
code), and the cache is far smaller than the shuffled working set (misses, evictions).
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from test_deploy import (
    DEPLOY,
    RULES,
    alert_inner_expressions,
    dashboard_queries,
    free_port,
    load_yaml,
    rules,
)

from tokenfeed.client import FeederClient
from tokenfeed.mixing import Bandit, OnlineMixer
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support.feeders import FeederProcess, feeder_params
from support.stores import make_positional_store

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="needs the prometheus binary "
        "(apt-get install prometheus; CI installs it in .ci/run)",
    ),
]

RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval
DEADLINE = 120.0  # seconds for all queries to show data (normally a few)


def prometheus_config(feeder_metrics: int, trainer_metrics: list[int], rule_file: Path) -> dict:
    """The committed config with local targets, 1 s intervals and absolute rule paths."""
    cfg = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {
        "tokenfeed-feeder": [f"127.0.0.1:{feeder_metrics}"],
        "tokenfeed-trainer": [f"127.0.0.1:{p}" for p in trainer_metrics],
    }
    jobs = [j for j in cfg["scrape_configs"] if j["job_name"] in targets]
    assert {j["job_name"] for j in jobs} == set(targets), "job names changed in prometheus.yml"
    for job in jobs:  # (the feeder job finds compose's feeders by DNS: not here)
        job.pop("dns_sd_configs", None)
        job.pop("relabel_configs", None)
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    cfg["scrape_configs"] = jobs
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(rule_file)]
    return cfg


class Prometheus:
    def __init__(self, workdir: Path, config: dict) -> None:
        self.port = free_port()
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url("/-/ready"), timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"prometheus did not start:\n{self.log()}") from None
                time.sleep(0.2)

    def url(self, path: str, **params: str) -> str:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return f"http://127.0.0.1:{self.port}{path}{query}"

    def api(self, path: str, **params: str) -> Any:
        with urllib.request.urlopen(self.url(path, **params), timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("/api/v1/query", query=expr)["result"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Trainer(threading.Thread):
    """One rank streaming epoch after epoch until stopped, like the demo trainer; a
    mixture's with an online mixer fed a made-up loss per row."""

    def __init__(self, address: str, rank: int, metrics_port: int | None, **sampling) -> None:
        super().__init__(name=f"trainer-{rank}", daemon=True)
        sampling = {"dataset": "positions", "world_size": 2} | sampling
        self.client = FeederClient(
            address,
            seq_len=64,
            batch_size=4,
            shuffle=True,
            seed=1,
            rank=rank,
            metrics_port=metrics_port,
            **sampling,
        )
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.batches = 0
        self.mixer = OnlineMixer(self.client, Bandit(), every=5) if self.client.is_mixture else None

    def run(self) -> None:
        try:
            # a mixture's stream is endless: one iteration, no epochs
            for epoch in [0] if self.client.is_mixture else itertools.count():
                self.client.set_epoch(epoch)
                for batch in self.client:
                    self.batches += 1
                    if self.mixer is not None:
                        self.mixer.observe(batch, 2.0 + batch["sources"])
                        self.mixer.step()
                    if self.stop_event.wait(0.002):  # a little "training"
                        return
        except BaseException as e:  # re-raised by the test
            self.error = e

    def stop(self) -> None:
        self.stop_event.set()
        self.join(60)
        self.client.close()


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Prometheus]:
    root = tmp_path / "data"
    # 40 chunks of 20 KB, a cache of ~3: the shuffled working set never fits
    make_positional_store(root / "positions", 200_000, 5_000)
    make_positional_store(root / "other", 50_000, 5_000)  # a mixture's second source
    with FeederProcess(root, metrics_port=free_port(), cache_bytes="64K") as feeder:
        feeder_metrics = int(feeder.flags["metrics_port"])
        dead = f"127.0.0.1:{free_port()}"
        trainer_ports = [free_port(), free_port(), free_port()]
        trainers = [
            Trainer(f"{dead},{feeder.address}", 0, trainer_ports[0]),
            Trainer(feeder.address, 1, trainer_ports[1]),
            # a mixture with an online mixer: the mixtures panels have data
            Trainer(
                feeder.address,
                0,
                trainer_ports[2],
                dataset=None,
                world_size=1,
                mixture={"positions": 0.7, "other": 0.3},
            ),
        ]
        for t in trainers:
            t.start()
        with grpc.insecure_channel(feeder.address) as ch:  # an error counted by code
            bad = pb.StreamBatchesRequest(params=feeder_params(dataset="no-such-dataset"))
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.FeederStub(ch).StreamBatches(bad, timeout=10))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        prom = Prometheus(
            tmp_path, prometheus_config(feeder_metrics, trainer_ports, RULES.resolve())
        )
        try:
            yield prom
        finally:
            prom.stop()
            for t in trainers:
                t.stop()
            for t in trainers:
                assert t.error is None, t.error
                assert t.batches > 0


def wait_for_data(prom: Prometheus, exprs: dict[str, str]) -> dict[str, Any]:
    """Query each expression until it has a finite sample; returns the ones that never did."""
    pending = dict(exprs)
    last: dict[str, Any] = {}
    deadline = time.monotonic() + DEADLINE
    while pending and time.monotonic() < deadline:
        for where, expr in list(pending.items()):
            last[where] = prom.query(expr)
            if finite(last[where]):
                del pending[where]
        time.sleep(1)
    return {where: (pending[where], last.get(where)) for where in pending}


def test_every_dashboard_query_and_rule_returns_data(stack: Prometheus) -> None:
    prom = stack
    targets = prom.api("/api/v1/targets")["activeTargets"]
    exprs: dict[str, str] = {}
    for title, expr in dashboard_queries():
        exprs[f"dashboard {title}: {expr}"] = expr.replace("$__rate_interval", RATE_INTERVAL)
    for rule in rules():
        if "record" in rule:
            exprs[f"record {rule['record']}"] = rule["expr"]
            exprs[f"recorded series {rule['record']}"] = rule["record"]
        else:
            for i, inner in enumerate(alert_inner_expressions(rule["expr"])):
                exprs[f"alert {rule['alert']} operand {i}: {inner}"] = inner
    missing = wait_for_data(prom, exprs)
    assert not missing, (
        "no data for:\n"
        + "\n".join(f"  {w}\n    -> {r}" for w, r in missing.items())
        + f"\ntargets: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}"
    )

    # every target is up, and every rule evaluates without error
    targets = prom.api("/api/v1/targets")["activeTargets"]
    assert [t["health"] for t in targets] == ["up"] * 4, targets
    groups = prom.api("/api/v1/rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    assert len(loaded) == len(rules())
    bad = [(r["name"], r["health"], r.get("lastError")) for r in loaded if r["health"] != "ok"]
    assert not bad, bad
    # the healthy system fires nothing but the cache alert's pending state is allowed
    firing = [r["name"] for r in loaded if r.get("state") == "firing"]
    assert firing == [], firing
    # the events the traffic provoked are visible by their labels
    assert prom.query('tokenfeed_server_errors_total{code="NOT_FOUND"}')
    assert prom.query('tokenfeed_client_reconnects_total{rank="0",reason="unavailable"}')
    per_rank = prom.query("rank:tokenfeed_client_tokens_received:rate1m")
    ranks = {s["metric"]["rank"] for s in per_rank}
    assert ranks == {"0", "1"}
