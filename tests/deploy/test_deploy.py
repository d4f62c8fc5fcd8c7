"""deploy/ and docker-compose.yml agree with the code and with each other.

The real tools check each file on its own (scripts/deploy_check.sh: compose binary,
hadolint, promtool, kubernetes-validate); these tests check what no single tool sees:
metric names against the metrics modules, ports and labels across files, the committed
dashboard JSON against its generator, and the container health check against a real
feeder. Nothing here needs Docker, a cluster or Prometheus.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import support
from support import free_port, registered_series
from support.feeders import running_feeder

ROOT = support.ROOT
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
RULES = DEPLOY / "prometheus" / "rules" / "tokenfeed.yml"
DASHBOARD_JSON = DEPLOY / "grafana" / "dashboards" / "tokenfeed.json"
K8S = DEPLOY / "k8s"
HEALTHCHECK = DEPLOY / "healthcheck.py"


# ------------------------------------------------------------------ shared helpers
# (tests/deploy/test_deploy_prometheus.py and test_deploy_compose.py import these)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def dashboard_generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tokenfeed_dashboard", DEPLOY / "grafana" / "dashboard.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel of the committed dashboard (rows flattened)."""
    out: list[dict[str, Any]] = []
    for panel in json.loads(DASHBOARD_JSON.read_text())["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the committed dashboard."""
    return [
        (p["title"], t["expr"])
        for p in dashboard_panels()
        for t in p.get("targets", [])
        if t.get("expr")
    ]


def rules() -> list[dict[str, Any]]:
    return [r for g in load_yaml(RULES)["groups"] for r in g["rules"]]


def _top_level_split(expr: str, pattern: re.Pattern[str]) -> list[str]:
    """Split `expr` where `pattern` matches outside (), [], {} and strings."""
    parts, depth, quote, last, i = [], 0, "", 0, 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            m = pattern.match(expr, i)
            if m:
                parts.append(expr[last:i])
                last = i = m.end()
                continue
        i += 1
    parts.append(expr[last:])
    return [p.strip() for p in parts]


_SET_OPS = re.compile(r"\s(and|or|unless)(\s+(on|ignoring)\s*\([^)]*\))?\s")
_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(\s*bool\b)?")
_NUMBER = re.compile(r"^-?[0-9.]+(e[+-]?[0-9]+)?$", re.IGNORECASE)


def alert_inner_expressions(expr: str) -> list[str]:
    """The parts of an alert expression that must return data in a healthy system.

    An alert is meant to be empty when all is well, so its expression alone proves
    nothing; the operands of its comparisons (`up{...}` of `up{...} == 0`) must exist,
    which catches a typo in a metric name. `absent(x)` contributes `x`.
    """
    out = []
    for part in _top_level_split(expr, _SET_OPS):
        for side in _top_level_split(part, _COMPARISON):
            m = re.fullmatch(r"absent\((.*)\)", side, re.DOTALL)
            side = m.group(1).strip() if m else side
            if side and not _NUMBER.match(side):
                out.append(side)
    return out


def metric_names(expr: str) -> set[str]:
    """Names a PromQL expression selects: tokenfeed_*, `up` and recorded `a:b:c` series."""
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    return set(
        re.findall(r"(?<![\w:])(tokenfeed_[a-z_]+|up|[a-z_]+:[a-z0-9_:]+)(?![\w:])", no_strings)
    )


# ------------------------------------------------------------------ dashboard


def test_committed_dashboard_is_what_the_generator_makes() -> None:
    assert DASHBOARD_JSON.read_text() == dashboard_generator().render(), (
        "deploy/grafana/dashboards/tokenfeed.json is stale: run python deploy/grafana/dashboard.py"
    )


def test_dashboard_covers_what_the_issue_asks_for() -> None:
    text = " ".join(expr for _, expr in dashboard_queries())
    for series in (
        "tokenfeed_server_tokens_sent_total",
        "tokenfeed_client_tokens_received_total",
        "tokenfeed_client_stall_fraction",
        "tokenfeed_client_wait_seconds_bucket",
        "tokenfeed_cache_hits_total",
        "tokenfeed_cache_misses_total",
        "tokenfeed_cache_resident_bytes",
        "tokenfeed_chunk_load_seconds_bucket",
        "tokenfeed_batch_build_seconds_bucket",
        "tokenfeed_server_streams_active",
        "tokenfeed_server_errors_total",
        "tokenfeed_client_reconnects_total",
    ):
        assert series in text, series


def test_dashboard_panels_use_the_datasource_variable_and_fit_the_grid() -> None:
    board = json.loads(DASHBOARD_JSON.read_text())
    assert board["uid"] == "tokenfeed"
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource"]
    cells: set[tuple[int, int]] = set()
    for panel in dashboard_panels():
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
        g = panel["gridPos"]
        assert 0 <= g["x"] <= g["x"] + g["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_every_metric_in_dashboard_and_rules_is_exported() -> None:
    known = registered_series() | {"up"} | {r["record"] for r in rules() if "record" in r}
    used = {(where, name) for where, expr in dashboard_queries() for name in metric_names(expr)}
    used |= {
        (r.get("record") or r["alert"], name) for r in rules() for name in metric_names(r["expr"])
    }
    unknown = sorted((where, name) for where, name in used if name not in known)
    assert not unknown, f"not exported by server/ or client/ metrics.py or recorded: {unknown}"


def test_recording_rules_cover_the_issue_and_alerts_have_runbook_text() -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    assert {
        "rank:tokenfeed_client_tokens_received:rate1m",
        "tokenfeed:client_tokens_received:rate1m",
        "rank:tokenfeed_client_stall_fraction:avg1m",
        "instance:tokenfeed_cache_hit_ratio:rate5m",
    } <= recorded
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert {
        "TokenfeedFeederDown",
        "TokenfeedRankStalled",
        "TokenfeedCacheHitRatioCollapsing",
        "TokenfeedErrorRate",
    } <= set(alerts)
    assert alerts["TokenfeedRankStalled"]["for"] == "5m"
    assert "> 0.05" in alerts["TokenfeedRankStalled"]["expr"]
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name
        assert rule["annotations"]["description"], name


def test_alert_inner_expressions() -> None:
    assert alert_inner_expressions('up{job="a"} == 0') == ['up{job="a"}']
    assert alert_inner_expressions('x{a=~"b|c"} > 0.05 and on (i) y < bool 3') == [
        'x{a=~"b|c"}',
        "y",
    ]
    assert alert_inner_expressions('up{job="a"} == 0 or absent(up{job="a"})') == [
        'up{job="a"}',
        'up{job="a"}',
    ]
    assert alert_inner_expressions("a / (b > 1) >= 2") == ["a / (b > 1)"]
    for rule in rules():
        if "alert" in rule:
            assert alert_inner_expressions(rule["expr"]), rule["alert"]


# ------------------------------------------------------------------ compose + prometheus


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


def test_env_example_lists_exactly_the_compose_variables() -> None:
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE.read_text()))
    example = {
        line.split("=", 1)[0]
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert used == example
    # and every variable has a default in the compose file itself
    without_default = set(re.findall(r"\$\{([A-Z0-9_]+)\}", COMPOSE.read_text()))
    assert not without_default


def test_prometheus_scrapes_the_compose_services_on_their_metrics_ports() -> None:
    services = compose()["services"]
    prom = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {
        j["job_name"]: [t for sc in j.get("static_configs", []) for t in sc["targets"]]
        for j in prom["scrape_configs"]
    }
    # the feeders (every profile's `serve` services) are found by DNS on the metrics port,
    # and keep their service name as `instance`
    metrics_port = services["feeder"]["environment"]["TOKENFEED_METRICS_PORT"]
    feeders = sorted(n for n, s in services.items() if s.get("command") == ["serve"])
    assert feeders == ["feeder", "feeder-2"]
    feeder_job = next(j for j in prom["scrape_configs"] if j["job_name"] == "tokenfeed-feeder")
    (sd,) = feeder_job["dns_sd_configs"]
    assert sorted(sd["names"]) == feeders
    assert sd["type"] == "A"
    assert sd["port"] == int(metrics_port)
    (relabel,) = feeder_job["relabel_configs"]
    assert relabel["source_labels"] == ["__meta_dns_name"]
    assert relabel["target_label"] == "instance"
    assert relabel["replacement"] == f"${{1}}:{metrics_port}"
    cmd = services["trainer"]["command"]
    first = int(next(a for a in cmd if a.startswith("--metrics-port=")).split("=")[1])
    assert "--metrics-host=0.0.0.0" in cmd
    # the demo runs two ranks; rank r exports on --metrics-port + r
    assert jobs["tokenfeed-trainer"] == [f"trainer:{first + r}" for r in range(2)]
    assert sorted(services["trainer"]["expose"]) == [str(first + r) for r in range(2)]
    # rules select the job names used here
    for rule in rules():
        for job in re.findall(r'job="([^"]+)"', rule["expr"]):
            assert job in jobs, rule


def test_compose_wiring() -> None:
    s = compose()["services"]
    assert s["feeder"]["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
    assert s["trainer"]["depends_on"]["feeder"]["condition"] == "service_healthy"
    assert s["prepare"]["restart"] == "no"
    assert s["feeder"]["healthcheck"]["test"] == ["CMD", "tokenfeed-healthcheck"]
    assert s["feeder"]["deploy"]["resources"]["limits"]
    assert "store:/data:ro" in s["feeder"]["volumes"]
    # prepare writes the demo stores under the data root: the trainer's mixture's sources
    assert s["prepare"]["command"][:3] == ["prepare", "--demo-root", "/data"]
    mixture = next(a for a in s["trainer"]["command"] if a.startswith("--mixture="))
    from tokenfeed.cli.demo import MIXTURE

    assert mixture == f"--mixture=${{DEMO_MIXTURE:-{MIXTURE}}}"  # `tokenfeed demo`'s
    # (the volume unless FEEDER_DATA_ROOT says otherwise: the `s3` profile)
    assert s["feeder"]["environment"]["TOKENFEED_DATA_ROOT"] == "${FEEDER_DATA_ROOT:-/data}"
    assert s["prepare-s3"]["command"][:3] == [
        "prepare",
        "--demo-root",
        "s3://${S3_BUCKET:-tokenfeed}",
    ]
    # grafana loads the provisioned dashboard from where the provider looks
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "tokenfeed.yml")
    path = provider["providers"][0]["options"]["path"]
    assert f"./deploy/grafana/dashboards:{path}:ro" in s["grafana"]["volumes"]
    home = s["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/{DASHBOARD_JSON.name}"
    assert s["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    ds = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"


def compose_check(name: str = "compose_check") -> Any:
    """scripts/<name>.py, imported as `python scripts/compose_check.py` would (its
    folder first on the path, where its sibling modules are)."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module(name)


def test_replicas_profile_is_a_second_feeder_that_trainers_and_compose_check_know() -> None:
    s = compose()["services"]
    feeder, second = s["feeder"], s["feeder-2"]
    assert second["profiles"] == ["replicas"]
    assert "profiles" not in feeder
    for key in (
        "image",
        "command",
        "environment",
        "volumes",
        "healthcheck",
        "depends_on",
        "deploy",
        "stop_grace_period",
    ):
        assert second[key] == feeder[key], key
    assert second["ports"] == []  # one published feeder port: no clash
    assert s["trainer"]["depends_on"]["feeder-2"] == {
        "condition": "service_healthy",
        "required": False,
    }
    assert "--address=${FEEDER_ADDRESSES:-feeder:50051}" in s["trainer"]["command"]
    # compose-check starts every profile it knows, with the trainers on every feeder
    profiles = {p.name: p for p in compose_check().PROFILES}
    assert profiles["default"].feeders == ("feeder",)
    replicas = profiles["replicas"]
    assert replicas.compose_profiles == ("replicas",)
    assert replicas.feeders == ("feeder", "feeder-2")
    assert replicas.env["FEEDER_ADDRESSES"] == ",".join(f"{f}:50051" for f in replicas.feeders)
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE.read_text()))
    for profile in profiles.values():
        assert set(profile.env) <= used, profile.name


def default(value: str) -> str:
    """What compose makes of `${NAME:-default}`s when no variable is set."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def test_tenants_profile_runs_two_jobs_with_different_grants(tmp_path: Path) -> None:
    from tokenfeed.server.tenants import load_tokens_file, token_digest

    s = compose()["services"]
    job, eval_, feeder, trainer = s["tenants"], s["trainer-eval"], s["feeder"], s["trainer"]
    assert job["profiles"] == eval_["profiles"] == ["tenants"]
    assert feeder["depends_on"]["tenants"] == {
        "condition": "service_completed_successfully",
        "required": False,
    }
    # the feeder checks tokens and the trainer sends one only when the variables say so
    assert feeder["environment"]["TOKENFEED_TOKENS_FILE"] == "${FEEDER_TOKENS_FILE:-}"
    assert "--token-file=${TRAINER_TOKEN_FILE:-}" in trainer["command"]
    assert "--token-file=/tenants/eval.token" in eval_["command"]
    assert "tenants:/tenants:ro" in feeder["volumes"]
    assert "tenants:/tenants" in job["volumes"]
    # the one-shot writes the example's jobs with fresh tokens; a second run keeps them
    example = DEPLOY / "tokens.example.yaml"
    out = tmp_path / "tenants"
    out.mkdir()
    for _ in range(2):
        subprocess.run(
            [sys.executable, str(DEPLOY / "tenants.py"), str(example), str(out)],
            check=True,
            capture_output=True,
            timeout=60,
        )
    written, template = load_tokens_file(out / "tokens.yaml"), load_tokens_file(example)
    assert [(j.name, j.datasets, j.weight) for j in written.jobs] == [
        (j.name, j.datasets, j.weight) for j in template.jobs
    ]
    for j in written.jobs:
        token = (out / f"{j.name}.token").read_text().strip()
        assert j.token_sha256 == token_digest(token)
        assert (out / f"{j.name}.token").stat().st_mode & 0o777 == 0o600
    # the example's digests match no token: a copy deployed as is lets nobody in
    assert {j.token_sha256.strip("01") for j in template.jobs} == {""}
    # two different grants: the trainer's mixture is pretrain's, eval reads the whole corpus
    jobs = written.by_name()
    mixture = default(next(a for a in trainer["command"] if a.startswith("--mixture=")))
    sources = [part.split("=")[0] for part in mixture.split("=", 1)[1].split(",")]
    assert all(jobs["pretrain"].allows(x) for x in sources)
    assert not jobs["pretrain"].allows("demo")
    assert jobs["eval"].allows("demo")
    # compose-check runs it with both jobs' tokens
    profile = {p.name: p for p in compose_check().PROFILES}["tenants"]
    assert profile.compose_profiles == ("tenants",)
    assert profile.jobs == ("prepare", "tenants")
    assert profile.clients == ("trainer-eval",)
    assert profile.env == {
        "FEEDER_TOKENS_FILE": "/tenants/tokens.yaml",
        "TRAINER_TOKEN_FILE": "/tenants/pretrain.token",
    }
    assert set(profile.tokens) == set(jobs)
    assert jobs[profile.asking].allows("no-such-dataset")  # its NOT_FOUND check
    assert not jobs[profile.forbidden[0]].allows(profile.forbidden[1])


def test_s3_profile_is_a_demo_s3_server_a_prepare_job_and_the_feeder_on_the_bucket() -> None:
    s = compose()["services"]
    server, job, feeder = s["seaweedfs"], s["prepare-s3"], s["feeder"]
    assert server["profiles"] == ["s3"]
    assert job["profiles"] == ["s3"]
    # the job waits for the server (healthy: S3 answers and the bucket exists), the feeder
    # for the job, but only where the profile runs
    assert job["depends_on"] == {"seaweedfs": {"condition": "service_healthy"}}
    assert feeder["depends_on"]["prepare-s3"] == {
        "condition": "service_completed_successfully",
        "required": False,
    }
    assert job["restart"] == "no"
    assert job["healthcheck"] == {"disable": True}
    # the job writes the demo stores (the trainers' mixture's sources) into the bucket, as
    # prepare does into the volume; FEEDER_DATA_ROOT=s3://BUCKET serves them
    root = job["command"][job["command"].index("--demo-root") + 1]
    assert root == "s3://${S3_BUCKET:-tokenfeed}"
    assert job["image"] == feeder["image"]
    assert server["environment"]["SEAWEEDFS_BUCKETS"] == "${S3_BUCKET:-tokenfeed}"
    # one set of S3 settings: what the server accepts is what the job and the feeder send
    client = {k: v for k, v in feeder["environment"].items() if k.startswith("AWS_")}
    assert set(client) == {
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
        "AWS_ALLOW_HTTP",
    }
    assert job["environment"] == client
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert server["environment"][key] == client[key]
    # the default endpoint is the server's S3 port on the compose network
    spec = importlib.util.spec_from_file_location("seaweedfs_demo", DEPLOY / "seaweedfs.py")
    assert spec is not None
    assert spec.loader is not None
    entrypoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entrypoint)
    assert default(client["AWS_ENDPOINT_URL"]) == f"http://seaweedfs:{entrypoint.S3_PORT}"
    assert server["expose"] == [str(entrypoint.S3_PORT)]
    assert "ports" not in server
    assert "seaweedfs-data:/data" in server["volumes"]
    assert "seaweedfs-data" in compose()["volumes"]
    # the image is built from its Dockerfile on the same base as the others
    assert server["build"] == {"context": "deploy", "dockerfile": "Dockerfile.seaweedfs"}
    text = (DEPLOY / "Dockerfile.seaweedfs").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert base
    assert f"ARG BASE_IMAGE={base.group(1)}" in text
    assert 'ENTRYPOINT ["seaweedfs-demo"]' in text
    assert "COPY --chmod=0755 seaweedfs.py" in text
    # the tokenfeed image can speak S3 unless told otherwise, everywhere the extras are set
    extras = re.search(r"^ARG EXTRAS=(\S+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert extras
    assert "s3" in extras.group(1).split(",")
    assert default(s["prepare"]["build"]["args"]["EXTRAS"]) == extras.group(1)
    assert f"TOKENFEED_EXTRAS={extras.group(1)}\n" in (ROOT / ".env.example").read_text()
    # compose-check runs it: the services, the data root, fresh credentials kept out of sight
    profile = {p.name: p for p in compose_check().PROFILES}["s3"]
    assert profile.compose_profiles == ("s3",)
    assert profile.jobs == ("prepare", "prepare-s3")
    assert profile.services == ("seaweedfs",)
    bucket = default(server["environment"]["SEAWEEDFS_BUCKETS"])
    assert profile.data_root == profile.env["FEEDER_DATA_ROOT"] == f"s3://{bucket}"
    for var in (*profile.credentials, *profile.secrets):
        assert var in profile.env, var
        assert profile.env[var] not in COMPOSE.read_text(), var
    assert set(profile.credentials) | set(profile.secrets) == {
        "S3_ACCESS_KEY_ID",
        "S3_SECRET_ACCESS_KEY",
    }


def test_seaweedfs_entrypoint_refuses_to_start_without_credentials() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [sys.executable, str(DEPLOY / "seaweedfs.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "AWS_ACCESS_KEY_ID is not set" in proc.stderr


def test_dockerfile_and_dockerignore() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert "EXPOSE 50051 9400" in text
    assert 'CMD ["tokenfeed-healthcheck"]' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    sources = re.search(r"^sources = \[(.*)\]$", pyproject, re.MULTILINE)
    assert sources
    allowed = (ROOT / ".dockerignore").read_text().splitlines()
    for src in re.findall(r'"([^"]+)"', sources.group(1)):
        assert f"!{src}/" in allowed, src
        assert f"COPY {src}/ {src}/" in text, src
    for f in ("pyproject.toml", "README.md", "deploy/healthcheck.py"):
        assert f"!{f}" in allowed, f


# ------------------------------------------------------------------ kubernetes


def k8s_docs() -> dict[str, dict[str, Any]]:
    """ "Kind/name" -> manifest, for every manifest under deploy/k8s."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in load_yaml_all(path):
                out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


def test_kustomization_lists_every_manifest_but_the_ordered_prepare_jobs() -> None:
    kust = load_yaml(K8S / "kustomization.yaml")
    listed = set(kust["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {"prepare-job.yaml", "merge-job.yaml"}


def test_the_autoscaler_example_scales_the_feeder_deployment() -> None:
    hpa = load_yaml(K8S / "examples" / "feeder-hpa.yaml")
    dep = k8s_docs()["Deployment/tokenfeed-feeder"]
    pdb = k8s_docs()["PodDisruptionBudget/tokenfeed-feeder"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", dep["metadata"]["name"])
    assert hpa["metadata"]["namespace"] == dep["metadata"]["namespace"]
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]
    assert hpa["spec"]["minReplicas"] <= dep["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def test_feeder_service_probes_and_monitor_match_the_pods() -> None:
    docs = k8s_docs()
    dep = docs["Deployment/tokenfeed-feeder"]
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": int(env["TOKENFEED_PORT"]),
        "metrics": int(env["TOKENFEED_METRICS_PORT"]),
    }
    assert env["TOKENFEED_HOST"] == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    assert container["resources"]["requests"]
    svc = docs["Service/tokenfeed-feeder"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: clients see every replica
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    mon = docs["PodMonitor/tokenfeed-feeder"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= labels.items()
    endpoint = mon["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics"
    assert {
        "action": "replace",
        "targetLabel": "job",
        "replacement": "tokenfeed-feeder",
    } in endpoint["relabelings"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["store"]["persistentVolumeClaim"]["claimName"] in {
        name.split("/")[1] for name in docs if name.startswith("PersistentVolumeClaim/")
    }
    # the image's numeric user (Dockerfile USER) is what the pod asserts
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001


def test_prepare_is_an_indexed_job_sharded_by_completion_index() -> None:
    docs = k8s_docs()
    job = docs["Job/tokenfeed-prepare"]["spec"]
    assert job["completionMode"] == "Indexed"
    (container,) = job["template"]["spec"]["containers"]
    args = container["args"]
    shards = int(next(a for a in args if a.startswith("--num-shards=")).split("=")[1])
    assert job["completions"] == job["parallelism"] == shards
    assert "--shard-index=$(JOB_COMPLETION_INDEX)" in args
    assert any(e["name"] == "JOB_COMPLETION_INDEX" for e in container["env"])
    output = next(a for a in args if a.startswith("--output=")).split("=")[1]
    (merge,) = docs["Job/tokenfeed-prepare-merge"]["spec"]["template"]["spec"]["containers"]
    assert merge["args"] == ["prepare", "merge", output]


# ------------------------------------------------------------------ container health check


def run_healthcheck(port: int, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENFEED_PORT": str(port), **env},
        timeout=60,
    )


def test_healthcheck_reports_serving_draining_and_down(feeder_root: Path) -> None:
    with running_feeder(feeder_root) as f:
        ok = run_healthcheck(f.port)
        assert ok.returncode == 0, ok.stderr
        f.call(f.server.health.enter_graceful_shutdown())  # what SIGTERM does first
        draining = run_healthcheck(f.port)
        assert draining.returncode == 1
        assert "NOT_SERVING" in draining.stderr
    down = run_healthcheck(free_port(), TOKENFEED_HEALTHCHECK_TIMEOUT="2")
    assert down.returncode == 1
    assert "unhealthy" in down.stderr


@pytest.mark.parametrize(
    "path",
    [
        HEALTHCHECK,
        DEPLOY / "seaweedfs.py",
        ROOT / "scripts" / "deploy_check.sh",
        ROOT / "scripts" / "compose_check.py",
    ],
)
def test_scripts_are_executable(path: Path) -> None:
    assert os.access(path, os.X_OK), f"chmod +x {path.relative_to(ROOT)}"


def test_the_only_panels_compose_check_lets_stay_empty_are_the_online_mixers() -> None:
    # the demo trainers mix by fixed weights: a panel may lack data in the compose stack
    # only when every metric it reads is one an OnlineMixer alone exports
    check = compose_check("compose_stack")
    mixer = (ROOT / "mixing" / "tokenfeed" / "mixing" / "mixer.py").read_text()
    exported = {
        name
        for name in check.MIXER_ONLY
        if name.removeprefix("tokenfeed_client_").removesuffix("_nats") in mixer
    }
    assert exported == set(check.MIXER_ONLY)
    exprs = [e for _, es in check.dashboard_panels() for e in es]
    for name in check.MIXER_ONLY:
        assert any(name in e for e in exprs), name
    assert "demo" in compose()["services"]["trainer"]["command"]
    assert "mixing" not in (ROOT / "cli" / "tokenfeed" / "cli" / "demo.py").read_text()
