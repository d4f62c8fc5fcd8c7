"""The container engines `make compose-check` drives (scripts/compose_check.py).

`Podman` (the default; CI): Debian's podman run rootful with its own containers.conf
and storage, a base image built with mmdebstrap from the host's apt sources, the
project's images built on it and kept in an image cache keyed by what they are built
from, the Docker API served for compose, health checks run from a loop. `Docker`: an
existing engine builds the images and runs the health checks.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

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
