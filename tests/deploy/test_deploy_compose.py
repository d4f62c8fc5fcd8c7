"""The demo path of docker-compose.yml, run as local processes (no Docker here).

The commands and environments are read from docker-compose.yml (with its `${VAR:-default}`
interpolation) and the image's ENV from deploy/Dockerfile, so what runs here is what the
containers run; only paths and ports are mapped to the test's temp dir and free ports:
`prepare` builds the demo stores (and a second run leaves them as they are), `feeder`
serves them until the container health check passes, `trainer` streams the demo
mixture on two ranks until every source has been passed once, each pass exactly once,
the feeder counts the tokens it sent by source, and it stops cleanly on SIGTERM as
`docker compose down` asks.
The `s3` profile's path runs the same way against the tests' SeaweedFS: `prepare-s3`
writes the demo stores into the bucket and the feeder, given
FEEDER_DATA_ROOT=s3://BUCKET, serves them from there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_deploy import COMPOSE, DEPLOY, HEALTHCHECK, free_port, load_yaml

from tokenfeed.core.store import TokenStore

pytestmark = pytest.mark.slow

TIMEOUT = 600
STORES = ("demo", "comedies", "tragedies")  # what the prepare service builds


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${NAME:-default}` / `${NAME}` substitution."""

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default

    return re.sub(r"\$\{([A-Z0-9_]+)(:-([^}]*))?\}", sub, value)


def image_env() -> dict[str, str]:
    """The runtime stage's ENV of deploy/Dockerfile (PATH aside)."""
    text = (DEPLOY / "Dockerfile").read_text().split("AS runtime", 1)[1]
    block = re.search(r"^ENV ((?:.*\\\n)*.*)$", text, re.MULTILINE)
    assert block
    pairs = dict(re.findall(r"([A-Z_]+)=(\S+)", block.group(1).replace("\\\n", " ")))
    pairs.pop("PATH")
    return pairs


def tokenfeed_argv(args: list[str]) -> list[str]:
    """The image's ENTRYPOINT ["tokenfeed"] with the service's command."""
    script = Path(sys.executable).with_name("tokenfeed")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "tokenfeed", *args]


def test_compose_demo_path_as_processes(tmp_path: Path) -> None:
    overrides = {"DEMO_EPOCHS": "1", "DEMO_STEP_TIME": "0"}  # one pass of each, then exit
    services = load_yaml(COMPOSE)["services"]
    data = tmp_path / "data"  # the `store` volume
    data.mkdir()

    def mapped(arg: str, ports: dict[str, str]) -> str:
        arg = interpolate(str(arg), overrides)
        arg = re.sub(r"^/data\b", str(data), arg)
        for old, new in ports.items():
            arg = arg.replace(old, new)
        return arg

    base_env = {**os.environ, **image_env()}

    # ---- prepare: one-shot, then a second run that finds the store complete
    prepare = [mapped(a, {}) for a in services["prepare"]["command"]]
    done = subprocess.run(
        tokenfeed_argv(prepare), env=base_env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr
    tokens = {name: TokenStore.open(data / name).meta.total_tokens for name in STORES}
    assert tokens["demo"] > 1_000_000
    # the mixture's sources are disjoint parts of the corpus
    assert tokens["comedies"] > 200_000
    assert tokens["tragedies"] > 200_000
    assert tokens["comedies"] + tokens["tragedies"] < tokens["demo"]
    stamps = {name: (data / name / "meta.json").stat().st_mtime_ns for name in STORES}
    again = subprocess.run(
        tokenfeed_argv(prepare), env=base_env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert again.returncode == 0, again.stderr
    for name in STORES:
        assert (data / name / "meta.json").stat().st_mtime_ns == stamps[name], (
            f"a complete demo store was rebuilt: {name}"
        )

    # ---- feeder: the service's environment on the image's, ports mapped
    feeder_env = {
        **base_env,
        **{k: mapped(v, {}) for k, v in services["feeder"]["environment"].items()},
    }
    assert feeder_env["TOKENFEED_DATA_ROOT"] == str(data)
    feeder_serves_the_trainer(tmp_path, services, feeder_env, base_env, mapped)


def feeder_serves_the_trainer(
    tmp_path: Path,
    services: dict[str, Any],
    feeder_env: dict[str, str],
    base_env: dict[str, str],
    mapped: Callable[[str, dict[str, str]], str],
) -> str:
    """Run the feeder service's command until its health check passes, the trainer's
    for one epoch against it, then stop the feeder with SIGTERM; the feeder's log."""
    port, metrics_port = free_port(), free_port()
    feeder_env.update(
        TOKENFEED_HOST="127.0.0.1",
        TOKENFEED_PORT=str(port),
        TOKENFEED_METRICS_PORT=str(metrics_port),
    )
    log = open(tmp_path / "feeder.log", "wb")  # noqa: SIM115 - the feeder writes it until the end
    feeder = subprocess.Popen(
        tokenfeed_argv(services["feeder"]["command"]),
        env=feeder_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # the compose healthcheck: `tokenfeed-healthcheck` in the feeder's environment
        assert services["feeder"]["healthcheck"]["test"] == ["CMD", "tokenfeed-healthcheck"]
        deadline = time.monotonic() + 60
        while (
            subprocess.run(
                [sys.executable, str(HEALTHCHECK)], env=feeder_env, capture_output=True, timeout=60
            ).returncode
            != 0
        ):
            assert feeder.poll() is None, (tmp_path / "feeder.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "feeder.log").read_text()
            time.sleep(0.5)

        # ---- trainer: two ranks, one pass over each source of the mixture
        trainer_metrics = free_port()
        ports = {
            "feeder:50051": f"127.0.0.1:{port}",
            "--metrics-port=9401": f"--metrics-port={trainer_metrics}",
            "--metrics-host=0.0.0.0": "--metrics-host=127.0.0.1",
        }
        trainer = [mapped(a, ports) for a in services["trainer"]["command"]]
        assert "--epochs=1" in trainer
        assert f"--address=127.0.0.1:{port}" in trainer
        run = subprocess.run(
            tokenfeed_argv(trainer), env=base_env, capture_output=True, text=True, timeout=TIMEOUT
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "mixture over 2 ranks: comedies" in run.stdout, run.stdout
        assert "each pass exactly once" in run.stdout, run.stdout

        # the tokens-by-source dashboard panel's series: the mixture's, by source
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        for source in ("comedies", "tragedies"):
            sent = re.search(
                rf'^tokenfeed_server_tokens_sent_total\{{dataset="{source}",source="{source}",'
                r'split="train"\} (\S+)$',
                text,
                re.MULTILINE,
            )
            assert sent, text
            assert float(sent.group(1)) > 0, text
    finally:
        # `docker compose down`: SIGTERM, the feeder drains and exits 0
        if feeder.poll() is None:
            feeder.send_signal(signal.SIGTERM)
        try:
            code = feeder.wait(60)
        except subprocess.TimeoutExpired:
            feeder.kill()
            feeder.wait()
            code = None
        log.close()
    assert code == 0, (tmp_path / "feeder.log").read_text()
    return (tmp_path / "feeder.log").read_text()


def test_compose_s3_path_as_processes(tmp_path: Path, s3: Any) -> None:
    # compose's S3 settings pointed at the tests' server; S3_BUCKET may carry a prefix
    bucket = f"{s3.bucket}/compose-{uuid.uuid4().hex[:8]}"
    overrides = {
        "DEMO_EPOCHS": "1",
        "DEMO_STEP_TIME": "0",
        "S3_BUCKET": bucket,
        "FEEDER_DATA_ROOT": f"s3://{bucket}",
        "S3_ENDPOINT_URL": s3.endpoint,
        "S3_ACCESS_KEY_ID": s3.access_key,
        "S3_SECRET_ACCESS_KEY": s3.secret_key,
        "S3_REGION": s3.region,
    }
    services = load_yaml(COMPOSE)["services"]

    def mapped(arg: str, ports: dict[str, str]) -> str:
        arg = interpolate(str(arg), overrides)
        for old, new in ports.items():
            arg = arg.replace(old, new)
        return arg

    # no AWS settings but the service's: no profile or credentials file of this machine
    base_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        **image_env(),
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }

    # ---- prepare-s3: the demo stores into the bucket, and again: left as they are
    job = services["prepare-s3"]
    job_env = {**base_env, **{k: mapped(v, {}) for k, v in job["environment"].items()}}
    prepare = [mapped(a, {}) for a in job["command"]]
    assert f"s3://{bucket}" in prepare
    for _ in range(2):
        done = subprocess.run(
            tokenfeed_argv(prepare), env=job_env, capture_output=True, text=True, timeout=TIMEOUT
        )
        assert done.returncode == 0, done.stderr
    for name in STORES:  # the trainer's mixture's sources are there
        assert f"s3://{bucket}/{name}: {name}, " in done.stdout, done.stdout

    # ---- feeder on the bucket; the trainer streams an epoch from it
    feeder_env = {
        **base_env,
        **{k: mapped(v, {}) for k, v in services["feeder"]["environment"].items()},
    }
    assert feeder_env["TOKENFEED_DATA_ROOT"] == f"s3://{bucket}"
    assert feeder_env["AWS_ENDPOINT_URL"] == s3.endpoint
    log = feeder_serves_the_trainer(tmp_path, services, feeder_env, base_env, mapped)
    assert f"serving s3://{bucket} on " in log
    for text in (log, done.stdout, done.stderr):
        assert s3.secret_key not in text
        assert s3.access_key not in text
