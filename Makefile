# timeslice: co-operative accelerator time-slicing for RL jobs.
# `make test` and `make demo` work on a fresh machine: they create .venv; `make test` installs
# everything (.[dev]), `make demo` only what the demo runs (.[demo]: services, tools, etcd).

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PKGS   := -p timeslice -p timeslice_tools -p timeslice_orchestrator -p timeslice_agent

.PHONY: venv test test-fast fuzz faults lint typecheck protos demo demo-rl cluster bench bench-quick soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

# The demo's own, smaller install (no test, lint or ML toolchain); .[dev] includes it.
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[demo]'
	touch $(DEMO_STAMP)

test: $(STAMP) lint
	$(BIN)/pytest -n auto --dist worksteal -q --durations=30

test-fast: $(STAMP)
	$(BIN)/pytest -n auto -q -m "not slow"

# Property-based fuzzing of every RPC of both services with many random cases (make test runs
# a small derandomized corpus of the same tests).
fuzz: $(STAMP)
	TIMESLICE_FUZZ_PROFILE=fuzz TIMESLICE_FUZZ_EXAMPLES=$${TIMESLICE_FUZZ_EXAMPLES:-5000} \
		$(BIN)/pytest -q -s -p no:cacheprovider --timeout 3600 tests/fuzz

# The fault scenarios that race real timing, ten times each instead of make test's two.
faults: $(STAMP)
	TIMESLICE_FAULT_REPEATS=$${TIMESLICE_FAULT_REPEATS:-10} $(BIN)/pytest -n auto -q tests/faults

lint: $(STAMP)
	$(BIN)/ruff check libs/timeslice libs/timeslice_tools services tests scripts bench
	$(BIN)/ruff format --check libs/timeslice libs/timeslice_tools services tests scripts bench
	PATH=$(abspath $(BIN)):$$PATH MYPYPATH=libs:services $(BIN)/mypy --strict $(PKGS)
	PATH=$(abspath $(BIN)):$$PATH MYPYPATH=libs:services $(BIN)/mypy --strict bench tests

typecheck: lint

# Regenerates the betterproto2 code under libs/timeslice_proto (never edit it by hand).
protos: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(PY) scripts/protogen.py libs/timeslice_proto

demo: $(DEMO_STAMP)
	$(PY) -m timeslice_tools.dev.demo

# Two real GRPO jobs (TRL, CPU) time-sliced on one group through the app backend; exits
# non-zero unless both trained bit-identically to their runs alone.
demo-rl: $(STAMP)
	$(PY) -m timeslice_tools.dev.rl

cluster: $(STAMP)
	$(BIN)/timeslice dev cluster

# Benchmarks on the real stack (sim backend: emulated data movement); results in bench/results.
bench: $(STAMP)
	$(PY) -m bench.run --suite full --out bench/results

bench-quick: $(STAMP)
	$(PY) -m bench.run --suite quick --out bench/results
	$(PY) -m bench.floor --rounds 1 --json bench/results/floor-quick.json

soak: $(STAMP)
	$(PY) -m bench.soak --duration 600 --out bench/results/soak-600s.json

# The published distributions (packaging/README.md): timeslice-sdk, -services, -tools wheels.
.PHONY: wheels
wheels:
	$(PYTHON) -m pip wheel --no-deps -w dist packaging/sdk packaging/services packaging/tools

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The one image every manifest runs (k8s/base/kustomization.yaml `images:`, compose). Push it to
# your registry with IMAGE=... and point your overlay's `images:` at it (docs/deployment.md).
IMAGE ?= ghcr.io/timeslice/timeslice
TAG   ?= 0.1.0
.PHONY: image
image:
	docker build -t $(IMAGE):$(TAG) .
