# The two commands of the README: `make example` and `make test`. Both set up .venv first.
# torch is pinned here to the CPU wheel this kind of machine has on disk; the package itself
# accepts a range (pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup example test bench sweep

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)" -e ".[test,julia]"
	touch $@

example: setup
	$(PY) examples/particles_hvp.py

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

# the OpInfo sweep's counts table ("N of M ops exact"); --report FILE for every op not exact
sweep: setup
	$(PY) tests/opinfo_sweep.py

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,julia,bench]"
	touch $@

# every benchmark; tables and plots land in benchmarks/results/
bench: $(VENV)/.bench-installed
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done
