"""One running compose stack and its checks from outside (scripts/compose_check.py).

`Profile` is a variant of the stack; `Stack` starts one with an engine
(scripts/compose_engines.py), checks it as a user would see it (services healthy,
trainers streaming, Prometheus targets, rules and dashboard panels, what the profile
adds), then takes it down.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from compose_engines import DEPLOY, ROOT, Engine, log, run

RATE_INTERVAL = "20s"  # Grafana's $__rate_interval at the 5 s scrape interval (4 x 5 s)
TRAINER_METRICS_PORTS = (9401, 9402)  # the demo's ranks 0 and 1
SOURCE_PANEL = "Tokens/s by source"  # the dashboard panel of a mixture's sources


@dataclass(frozen=True)
class Profile:
    """One variant of the stack that compose-check starts and checks."""

    name: str
    compose_profiles: tuple[str, ...] = ()
    feeders: tuple[str, ...] = ("feeder",)  # services that must turn healthy and serve
    env: dict[str, str] = field(default_factory=dict)  # compose variables it sets
    # Every feeder must have served tokens: rank r starts on address r mod n, so the
    # demo's two ranks spread over two replicas.
    every_feeder_serves: bool = True
    jobs: tuple[str, ...] = ("prepare",)  # one-shot services: each must exit 0
    services: tuple[str, ...] = ()  # other services it adds: each must turn healthy
    images: tuple[str, ...] = ()  # images beyond tokenfeed and Prometheus ("seaweedfs")
    # where the feeders' data root must be (their log names it) and hold the demo store
    data_root: str | None = None
    # variables whose values must appear in no metric and no log of a tokenfeed service;
    # `secrets` not even in the log of any other service
    credentials: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    # a feeder that checks tokens: each job's token file in the feeder's container (its
    # streams must show on /status.json; the tokens are secrets), the job whose token
    # compose-check's own requests carry, a (job, dataset) outside that job's grant,
    # and services that stream as further jobs (no health check: /status shows them)
    tokens: dict[str, str] = field(default_factory=dict)
    asking: str | None = None
    forbidden: tuple[str, str] | None = None
    clients: tuple[str, ...] = ()


# Every profile compose-check runs, in order. To add one: a compose profile in
# docker-compose.yml (its services carry `profiles: [name]`), then an entry here naming
# the compose profiles to enable, the feeder services that must be healthy, the


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- checks


class Results:
    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[tuple[str, str]] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        if ok:
            self.passed.append(name)
            print(f"PASSED {name}{f' ({detail})' if detail else ''}", flush=True)
        else:
            self.failed.append((name, detail))
            print(f"FAILED {name}: {detail}", flush=True)
        return ok


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {body}")
    return body["data"]


def until(
    deadline: float, probe: Callable[[], tuple[bool, str]], every: float = 2.0
) -> tuple[bool, str]:
    """Call `probe` until it says ok or the deadline passes; its last answer."""
    while True:
        try:
            ok, detail = probe()
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        if ok or time.monotonic() > deadline:
            return ok, detail
        time.sleep(every)


# metrics exported only by a trainer running an OnlineMixer (docs/mixing.md); the demo
# trainers mix by fixed weights, so their panels are checked to evaluate, not to have data
MIXER_ONLY = ("tokenfeed_client_mixer_loss_nats",)


def dashboard_panels() -> list[tuple[str, list[str]]]:
    """(title, PromQL queries) of every panel, from the dashboard generator."""
    sys.path.insert(0, str(DEPLOY / "grafana"))
    import dashboard  # deploy/grafana/dashboard.py (grafanalib)

    out = []
    for panel in json.loads(dashboard.render())["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            exprs = [t["expr"] for t in p.get("targets", []) if t.get("expr")]
            if exprs:
                out.append((p["title"], exprs))
    return out


def mixture_sources(setting: str | None) -> list[str]:
    """The source names of the trainers' mixture: DEMO_MIXTURE, else the compose file's
    default (`tokenfeed demo`'s)."""
    if not setting:
        from tokenfeed.cli.demo import MIXTURE

        setting = MIXTURE
    return [part.split("=")[0].strip() for part in setting.split(",") if part.strip()]


def rules_in_files() -> list[str]:
    import yaml

    names = []
    for f in sorted((DEPLOY / "prometheus" / "rules").glob("*.yml")):
        for group in yaml.safe_load(f.read_text())["groups"]:
            names += [r.get("record") or r["alert"] for r in group["rules"]]
    return names


class Stack:
    """One profile of the compose project, up until `down`."""

    def __init__(
        self, engine: Engine, compose: list[str], profile: Profile, results: Results
    ) -> None:
        self.engine, self.profile, self.results = engine, profile, results
        self.ports = {
            "FEEDER_PORT": free_port(),
            "FEEDER_METRICS_PORT": free_port(),
            "PROMETHEUS_PORT": free_port(),
        }
        self.env = {
            **engine.env,
            **engine.compose_env(),
            **profile.env,
            **{k: str(v) for k, v in self.ports.items()},
        }
        self.compose = [
            *compose,
            "-p",
            engine.project,
            "-f",
            str(ROOT / "docker-compose.yml"),
            *(a for p in profile.compose_profiles for a in ("--profile", p)),
        ]
        self.services = [
            *profile.jobs,
            *profile.services,
            *profile.feeders,
            "trainer",
            *profile.clients,
            "prometheus",
        ]
        self.tokens: dict[str, str] = {}  # job -> its token, read from the feeder's container

    def prom(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return http_json(f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}{path}{query}")

    def container(self, service: str) -> dict[str, Any]:
        ids = self.engine.podman_like(
            "ps",
            "-a",
            "-q",
            "--filter",
            f"label=com.docker.compose.project={self.engine.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        ).stdout.split()
        if len(ids) != 1:
            raise RuntimeError(f"{len(ids)} containers for service {service}")
        return json.loads(self.engine.podman_like("inspect", ids[0]).stdout)[0]

    def up(self) -> bool:
        log(f"[{self.profile.name}] up {' '.join(self.services)}")
        t0 = time.monotonic()
        proc = run(
            [*self.compose, "up", "--detach", "--no-build", *self.services],
            env=self.env,
            check=False,
            capture=True,
            timeout=600,
        )
        return self.results.check(
            f"[{self.profile.name}] compose up",
            proc.returncode == 0,
            f"{time.monotonic() - t0:.0f} s"
            if proc.returncode == 0
            else (proc.stdout + proc.stderr)[-3000:],
        )

    def trainer_metrics(self) -> dict[int, str]:
        """Each rank's /metrics text, read in the trainer container (ports not published)."""
        cid = self.container("trainer")["Id"]
        script = (
            "import json, sys, urllib.request\n"
            "print(json.dumps({p: urllib.request.urlopen(f'http://127.0.0.1:{p}/metrics',"
            " timeout=5).read().decode() for p in sys.argv[1:]}))\n"
        )
        out = self.engine.podman_like(
            "exec", cid, "python", "-c", script, *map(str, TRAINER_METRICS_PORTS)
        ).stdout
        return {int(p): text for p, text in json.loads(out).items()}

    def trainer_tokens(self) -> dict[int, float]:
        """tokenfeed_client_tokens_received_total per rank."""
        return {
            p: sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("tokenfeed_client_tokens_received_total")
            )
            for p, text in self.trainer_metrics().items()
        }

    def compose_logs(self, *services: str) -> str:
        proc = run(
            [*self.compose, "logs", "--no-color", *services],
            env=self.env,
            capture=True,
            timeout=120,
        )
        return proc.stdout + proc.stderr

    def checks(self) -> None:
        name, r = self.profile.name, self.results
        for job in self.profile.jobs:
            state = self.container(job)["State"]
            ok = state["Status"] == "exited" and state["ExitCode"] == 0
            # a failed job's last lines first: CI shows the summary's end, not the logs
            tail = "" if ok else " | ".join(self.compose_logs(job).splitlines()[-6:]) + " | "
            r.check(
                f"[{name}] {job} exited 0",
                ok,
                f"{tail}status {state['Status']}, exit code {state['ExitCode']}",
            )
        for service in (*self.profile.services, *self.profile.feeders):
            ok, detail = until(
                time.monotonic() + 60,
                lambda f=service: (
                    (s := self.container(f)["State"].get("Health", {}).get("Status")) == "healthy",
                    f"health {s}",
                ),
            )
            r.check(f"[{name}] {service} healthy", ok, detail)

        def streaming() -> tuple[bool, str]:
            first = self.trainer_tokens()
            time.sleep(3)
            second = self.trainer_tokens()
            rising = {p: second[p] - first[p] for p in TRAINER_METRICS_PORTS}
            return (
                all(second[p] > 0 and rising[p] > 0 for p in TRAINER_METRICS_PORTS),
                ", ".join(
                    f"port {p}: {second[p]:.0f} tokens, +{rising[p]:.0f} in 3 s"
                    for p in TRAINER_METRICS_PORTS
                ),
            )

        ok, detail = until(time.monotonic() + 60, streaming)
        r.check(f"[{name}] every trainer rank streams", ok, detail)
        if self.profile.data_root:
            self.check_data_root(self.profile.data_root)
        if self.profile.tokens:
            self.check_tenants()

        # events a healthy stack never shows, so the dashboard's panels for them have
        # data: a request for a missing dataset (an error by code) and a feeder restart
        # (every rank reconnects and resumes)
        r.check(
            f"[{name}] a request for a missing dataset fails with NOT_FOUND",
            *self.request_missing_dataset(),
        )
        feeder = self.container("feeder")["Id"]
        self.engine.podman_like("restart", "--time", "30", feeder)
        ok, detail = until(time.monotonic() + 90, streaming)
        r.check(f"[{name}] every rank streams again after a feeder restart", ok, detail)

        expected = len(self.profile.feeders) + len(TRAINER_METRICS_PORTS) + 1

        def targets() -> tuple[bool, str]:
            active = self.prom("/api/v1/targets")["activeTargets"]
            health = sorted(
                f"{t['labels']['job']}/{t['labels']['instance']}={t['health']}"
                + (f" ({t['lastError']})" if t.get("lastError") else "")
                for t in active
            )
            return (
                len(active) == expected and all(t["health"] == "up" for t in active),
                ", ".join(health),
            )

        r.check(
            f"[{name}] Prometheus: all {expected} targets up",
            *until(time.monotonic() + 90, targets),
        )

        want = rules_in_files()

        def rules() -> tuple[bool, str]:
            loaded = [x for g in self.prom("/api/v1/rules")["groups"] for x in g["rules"]]
            bad = [
                f"{x['name']}: {x['health']} {x.get('lastError', '')}"
                for x in loaded
                if x["health"] != "ok"
            ]
            names = sorted(x["name"] for x in loaded)
            if names != sorted(want):
                return False, f"loaded {names}, files have {sorted(want)}"
            return not bad, "; ".join(bad) or f"{len(loaded)} rules evaluate"

        r.check(
            f"[{name}] Prometheus: every rule loads and evaluates",
            *until(time.monotonic() + 60, rules),
        )

        panels = dashboard_panels()
        empty: dict[str, str] = {}

        def queries() -> tuple[bool, str]:
            # every query must evaluate (http_json raises on an error); every panel but
            # those fed only by an OnlineMixer must also have data
            empty.clear()
            for title, exprs in panels:
                results = [
                    self.prom("/api/v1/query", query=e.replace("$__rate_interval", RATE_INTERVAL))[
                        "result"
                    ]
                    for e in exprs
                ]
                if not any(results) and not any(m in e for e in exprs for m in MIXER_ONLY):
                    empty[title] = exprs[0]
            return not empty, (
                f"{len(panels)} panels evaluate, all but the mixer's have data"
                if not empty
                else f"no data: {empty}"
            )

        r.check(
            f"[{name}] a query of every dashboard panel returns data",
            *until(time.monotonic() + 90, queries, every=5),
        )

        # the trainers stream a mixture: the tokens-by-source panel's mixture query (the
        # panel's first) has a series for each of its sources, not only the single
        # dataset one
        want_sources = mixture_sources(self.env.get("DEMO_MIXTURE"))
        (by_source,) = [exprs[0] for title, exprs in panels if title.startswith(SOURCE_PANEL)]

        def sources() -> tuple[bool, str]:
            result = self.prom(
                "/api/v1/query", query=by_source.replace("$__rate_interval", RATE_INTERVAL)
            )["result"]
            seen = {x["metric"].get("source", ""): float(x["value"][1]) for x in result}
            return set(want_sources) <= {k for k, v in seen.items() if v > 0}, (
                f"want {want_sources}; tokens/s by source: "
                + (", ".join(f"{k}={v:.0f}" for k, v in sorted(seen.items())) or "none")
            )

        r.check(
            f"[{name}] the tokens-by-source panel shows every source of the mixture",
            *until(time.monotonic() + 60, sources, every=5),
        )

        # the feeders served (see Profile.every_feeder_serves), and the ranks still
        # stream at the end
        served = {
            s["metric"]["instance"]: float(s["value"][1])
            for s in self.prom(
                "/api/v1/query",
                query="max by (instance) (max_over_time(tokenfeed_server_tokens_sent_total[10m]))",
            )["result"]
        }
        serving = [served.get(f"{f}:9400", 0) > 0 for f in self.profile.feeders]
        every = self.profile.every_feeder_serves
        r.check(
            f"[{name}] {'every' if every else 'a'} feeder served tokens",
            all(serving) if every else any(serving),
            ", ".join(f"{k}: {v:.0f}" for k, v in sorted(served.items())),
        )
        r.check(f"[{name}] every rank still streams at the end", *streaming())

        alerts = self.prom("/api/v1/alerts")["alerts"]
        firing = [a["labels"]["alertname"] for a in alerts if a["state"] == "firing"]
        pending = [a["labels"]["alertname"] for a in alerts if a["state"] == "pending"]
        r.check(
            f"[{name}] no alert fires",
            not firing,
            f"firing {firing}" if firing else f"pending: {pending or 'none'}",
        )
        if self.profile.credentials or self.profile.secrets or self.tokens:
            r.check(f"[{name}] no credential in a log or a metric", *self.credentials_hidden())

    def check_data_root(self, root: str) -> None:
        """Every feeder serves `root` (its start-up log line names the data root), and
        `tokenfeed info` in the feeder's container finds the complete demo store there."""
        name, r = self.profile.name, self.results
        for feeder in self.profile.feeders:
            lines = [
                line.split("tokenfeed.server: ", 1)[-1]
                for line in self.compose_logs(feeder).splitlines()
                if "tokenfeed feeder serving" in line
            ]
            r.check(
                f"[{name}] {feeder} serves {root}",
                bool(lines) and all(f"serving {root} on " in line for line in lines),
                "; ".join(lines) or "no start-up line in its log",
            )
        cid = self.container(self.profile.feeders[0])["Id"]
        failed: list[str] = []

        def info() -> tuple[bool, str]:
            proc = self.engine.podman_like(
                "exec", cid, "tokenfeed", "info", f"{root}/demo", check=False
            )
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            tokens = [" ".join(x.split()) for x in lines if "tokens" in x]
            if proc.returncode == 0 and tokens:
                return True, tokens[0]
            failed.append(f"exit {proc.returncode}: " + " | ".join(lines[-4:]))
            return False, failed[-1]

        # (tokenfeed's own retries span ~30 s; a second try after that is reported)
        ok, detail = until(time.monotonic() + 90, info, every=5)
        if failed:
            detail += f" (after {len(failed)} failed attempt(s); the first: {failed[0]})"
            for service in self.profile.services:  # what the storage side said meanwhile
                text = self.compose_logs(service)
                print(f"--- {service}: warnings and errors in its log", flush=True)
                print("\n".join(x for x in text.splitlines() if "| I" not in x)[-5000:])
        r.check(f"[{name}] {root}/demo holds the demo store (tokenfeed info)", ok, detail)

    def metadata(self, job: str | None) -> list[tuple[str, str]]:
        """A job's call metadata (none without a tokens file)."""
        return [("authorization", f"Bearer {self.tokens[job]}")] if job else []

    def check_tenants(self) -> None:
        """Every job streams (the feeder's /status.json has its rows), and a job asking
        for a dataset outside its grant gets PERMISSION_DENIED naming both."""
        import grpc

        from tokenfeed.v1 import feeder_pb2 as pb
        from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

        name, r = self.profile.name, self.results
        cid = self.container(self.profile.feeders[0])["Id"]
        for job, path in self.profile.tokens.items():
            self.tokens[job] = self.engine.podman_like("exec", cid, "cat", path).stdout.strip()
        url = f"http://127.0.0.1:{self.ports['FEEDER_METRICS_PORT']}/status.json"

        # An epoch of the small demo store fits in a client's flow-control windows, so
        # eval's stream is open a moment per epoch: the rows seen over the polls count.
        seen: set[str] = set()

        def rows() -> tuple[bool, str]:
            with urllib.request.urlopen(url, timeout=10) as page:
                streams = json.loads(page.read())["streams"]
            seen.update(s["job"] for s in streams)
            return seen == set(self.tokens), f"rows of jobs {sorted(seen)} seen"

        r.check(
            f"[{name}] /status shows every job's streams",
            *until(time.monotonic() + 60, rows, every=0.2),
        )
        assert self.profile.forbidden is not None
        job, dataset = self.profile.forbidden
        request = pb.InfoRequest(dataset=dataset)
        address = f"127.0.0.1:{self.ports['FEEDER_PORT']}"
        with grpc.insecure_channel(address) as channel:
            try:
                pb_grpc.FeederStub(channel).Info(request, metadata=self.metadata(job), timeout=10)
                ok, detail = False, "answered"
            except grpc.RpcError as e:
                ok = e.code() == grpc.StatusCode.PERMISSION_DENIED and f"{job!r}" in e.details()
                detail = f"{e.code().name}: {e.details()}"
        r.check(f"[{name}] {job} may not read {dataset}", ok, detail)

    def credentials_hidden(self) -> tuple[bool, str]:
        """No value of the profile's credential variables in a metric or a tokenfeed log,
        and no secret in any log: every service's whole log, the feeder's metrics (the
        published port) and every trainer rank's metrics."""
        values = {v: self.env[v] for v in (*self.profile.credentials, *self.profile.secrets)}
        values |= {f"{job}'s token": token for job, token in self.tokens.items()}
        tokenfeed = [*self.profile.jobs, *self.profile.feeders, "trainer", *self.profile.clients]
        texts = {f"{s} log": self.compose_logs(s) for s in self.services}
        texts["feeder metrics"] = (
            urllib.request.urlopen(
                f"http://127.0.0.1:{self.ports['FEEDER_METRICS_PORT']}/metrics", timeout=10
            )
            .read()
            .decode()
        )
        for port, text in self.trainer_metrics().items():
            texts[f"trainer metrics :{port}"] = text
        if self.tokens:
            status = f"http://127.0.0.1:{self.ports['FEEDER_METRICS_PORT']}/status"
            texts["feeder status page"] = urllib.request.urlopen(status, timeout=10).read().decode()
        found, named = [], []
        for where, text in texts.items():
            for var, value in values.items():
                # other services' logs may name an access key (the S3 server names its
                # identity): listed, which also shows the search finds what is there
                may_name = where.endswith(" log") and where[:-4] not in tokenfeed
                if value in text:
                    if may_name and var in self.profile.credentials:
                        named.append(f"{var} in {where}")
                    else:
                        found.append(f"{var} in {where}")
        return not found, (
            f"found {found}"
            if found
            else f"{', '.join(values)} in none of {len(texts)} logs and metrics pages"
            + (f" (as allowed: {', '.join(named)})" if named else "")
        )

    def request_missing_dataset(self) -> tuple[bool, str]:
        """A StreamBatches for a dataset the store lacks, sent to the published port."""
        import grpc

        from tokenfeed.v1 import feeder_pb2 as pb
        from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

        address = f"127.0.0.1:{self.ports['FEEDER_PORT']}"
        request = pb.StreamBatchesRequest(
            params=pb.SamplingParams(
                dataset="no-such-dataset",
                split="train",
                split_rate=1.0,
                seq_len=64,
                stride=64,
                batch_size=1,
                world_size=1,
            )
        )
        with grpc.insecure_channel(address) as channel:
            try:
                metadata = self.metadata(self.profile.asking)
                list(
                    pb_grpc.FeederStub(channel).StreamBatches(
                        request, metadata=metadata, timeout=10
                    )
                )
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.NOT_FOUND, f"{e.code().name}"
        return False, "the stream succeeded"

    def logs(self) -> None:
        proc = run(
            [*self.compose, "logs", "--no-color", "--tail", "40", *self.services],
            env=self.env,
            check=False,
            capture=True,
            timeout=120,
        )
        print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\n", flush=True)

    def down(self) -> None:
        t0 = time.monotonic()
        proc = run(
            [*self.compose, "down", "--volumes", "--remove-orphans", "--timeout", "30"],
            env=self.env,
            check=False,
            capture=True,
            timeout=300,
        )
        self.results.check(
            f"[{self.profile.name}] compose down -v",
            proc.returncode == 0,
            f"{time.monotonic() - t0:.0f} s"
            if proc.returncode == 0
            else (proc.stdout + proc.stderr)[-2000:],
        )
