"""The demo path of docker-compose.yml, run as local processes (no Docker here).

The commands and environments are read from docker-compose.yml (with its `${VAR:-default}`
interpolation) and the image's ENV from deploy/Dockerfile, so what runs here is what the
containers run; only paths and ports are mapped to the test's temp dir and free ports:
`prepare` builds the demo store (and a second run leaves it as it is), `feeder` serves
it until the container health check passes, `trainer` streams an epoch on two ranks,
and the feeder stops cleanly on SIGTERM as `docker compose down` asks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_deploy import COMPOSE, DEPLOY, HEALTHCHECK, free_port, load_yaml

from tokenfeed.core.store import TokenStore

pytestmark = pytest.mark.slow

TIMEOUT = 600


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
    overrides = {"DEMO_EPOCHS": "1", "DEMO_STEP_TIME": "0"}  # one epoch, then exit
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
    store = TokenStore.open(data / "demo")
    assert store.meta.total_tokens > 1_000_000
    meta = data / "demo" / "meta.json"
    stamp = meta.stat().st_mtime_ns
    again = subprocess.run(
        tokenfeed_argv(prepare), env=base_env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert again.returncode == 0, again.stderr
    assert meta.stat().st_mtime_ns == stamp, "a complete demo store was rebuilt"

    # ---- feeder: the service's environment on the image's, ports mapped
    port, metrics_port = free_port(), free_port()
    feeder_env = {
        **base_env,
        **{k: mapped(v, {}) for k, v in services["feeder"]["environment"].items()},
    }
    assert feeder_env["TOKENFEED_DATA_ROOT"] == str(data)
    feeder_env.update(
        TOKENFEED_HOST="127.0.0.1",
        TOKENFEED_PORT=str(port),
        TOKENFEED_METRICS_PORT=str(metrics_port),
    )
    log = open(tmp_path / "feeder.log", "wb")
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
            assert feeder.poll() is None and time.monotonic() < deadline, (
                tmp_path / "feeder.log"
            ).read_text()
            time.sleep(0.5)

        # ---- trainer: two ranks for one epoch against the feeder
        trainer_metrics = free_port()
        ports = {
            "feeder:50051": f"127.0.0.1:{port}",
            "--metrics-port=9401": f"--metrics-port={trainer_metrics}",
            "--metrics-host=0.0.0.0": "--metrics-host=127.0.0.1",
        }
        trainer = [mapped(a, ports) for a in services["trainer"]["command"]]
        assert "--epochs=1" in trainer and f"--address=127.0.0.1:{port}" in trainer
        run = subprocess.run(
            tokenfeed_argv(trainer), env=base_env, capture_output=True, text=True, timeout=TIMEOUT
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "each exactly once" in run.stdout, run.stdout

        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        sent = re.search(
            r'^tokenfeed_server_tokens_sent_total\{dataset="demo",[^}]*split="train"\} '
            r"(\S+)$",
            text,
            re.MULTILINE,
        )
        assert sent and float(sent.group(1)) > 0, text
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
