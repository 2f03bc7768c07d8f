# timeslice: co-operative accelerator time-slicing for RL jobs.
# `make test` and `make demo` work on a fresh machine: they create .venv and install everything.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed
PKGS   := -p timeslice -p timeslice_tools -p timeslice_orchestrator -p timeslice_agent

.PHONY: venv test test-fast fuzz lint typecheck protos demo demo-rl cluster bench bench-quick soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP) lint
	$(BIN)/pytest -n auto -q

test-fast: $(STAMP)
	$(BIN)/pytest -n auto -q -m "not slow"

# Property-based fuzzing of every RPC of both services with many random cases (make test runs
# a small derandomized corpus of the same tests).
fuzz: $(STAMP)
	TIMESLICE_FUZZ_PROFILE=fuzz TIMESLICE_FUZZ_EXAMPLES=$${TIMESLICE_FUZZ_EXAMPLES:-5000} \
		$(BIN)/pytest -q -s -p no:cacheprovider --timeout 3600 tests/fuzz

lint: $(STAMP)
	$(BIN)/ruff check libs/timeslice libs/timeslice_tools services tests scripts bench
	$(BIN)/ruff format --check libs/timeslice libs/timeslice_tools services tests scripts bench
	PATH=$(abspath $(BIN)):$$PATH MYPYPATH=libs:services $(BIN)/mypy --strict $(PKGS)
	PATH=$(abspath $(BIN)):$$PATH MYPYPATH=libs:services $(BIN)/mypy --strict bench tests

typecheck: lint

# Regenerates the betterproto2 code under libs/timeslice_proto (never edit it by hand).
protos: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(PY) scripts/protogen.py libs/timeslice_proto

demo: $(STAMP)
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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
