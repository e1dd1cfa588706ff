# Sandpiper: the two commands a new user needs are `make demo` and `make test`.
# Both run `setup` first, which is idempotent (see scripts/setup.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast test-long test-unit lint bench clean help

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

setup:  ## install system packages (as root), the venv, the sandbox image and the tiny model
	bash scripts/setup.sh

demo: setup  ## run the whole pipeline on configs/demo.toml (the tiny model)
	$(VENV)/bin/sandpiper demo

# Tiers (docs/testing.md): the test's folder and fixtures mark it (tests/conftest.py). Both
# targets run in TEST_WORKERS pytest-xdist processes; each runs a test module's tests in
# order, and one of them runs every test of the shared vLLM server (one server, not one each).
# Groups start in collection order (e2e, integration, unit), so the longest start first.
# Three on the 2-core machine: the third fills the time the others wait on a timeout, a kill
# or a container (docs/testing.md, "Where the time goes"); set it to your cores + 1.
TEST_WORKERS ?= 3
XDIST = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: setup  ## every tier (unit, integration, e2e) but the `long` tests, in parallel (goal: <= 10 min)
	$(PY) -m pytest tests -m "not long" $(XDIST) $(PYTEST_ARGS)

test-fast: setup  ## before each commit: unit tests + one real episode (podman, DuckDB, vLLM)
	$(PY) -m pytest tests -m "(unit and not slow) or smoke" $(XDIST) -q $(PYTEST_ARGS)

test-long: setup  ## the `long` tests (the demo's learning run, SmolLM2, ...) and the `volume` ones at CI's size
	SANDPIPER_TEST_LONG=1 $(PY) -m pytest tests -m "long or volume" $(XDIST) $(PYTEST_ARGS)

test-unit:  ## unit tests only (no services)
	bash scripts/setup.sh venv
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

lint:  ## ruff check, ruff format --check, mypy, import contracts (.importlinter: layers, no cycles)
	bash scripts/setup.sh venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: setup  ## run every benchmark, append its figures to bench/results/, refresh the README table
	@mkdir -p runs/bench
	@for b in bench/*_bench.py; do echo "== $$b"; log=runs/bench/$$(basename $$b .py).log; \
		load=$$(cut -d' ' -f1 /proc/loadavg); $(PY) $$b --json | tee $$log | tail -n 1; \
		$(PY) bench/report.py --append $$b $$log --load-start $$load; done
	$(PY) bench/report.py --write-readme README.md

clean:  ## remove run outputs (keeps the venv and the image)
	rm -rf runs/*/ .pytest_cache
