# The two commands of the README: `make example` and `make test` (which type-checks too). Both set
# up .venv first.
# torch is pinned here to the CPU wheel this kind of machine has on disk; the package itself
# accepts a range (pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup example test test-torch-range typecheck docs bench sweep

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)" -e ".[test,julia]"
	touch $@

example: setup
	$(PY) examples/particles_hvp.py

test: setup typecheck
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

# mypy --strict on pyhvp/ (configured in pyproject.toml)
typecheck: setup
	$(PY) -m mypy

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,julia,docs]"
	touch $@

# the site into docs/_build/html (git-ignored), running every example; any warning fails it
docs: $(VENV)/.docs-installed
	$(PY) -m sphinx -W --keep-going -n -b html docs docs/_build/html


# The suite (pytest only) on the ends of the torch range pyproject.toml declares besides the pin:
# its floor and the newest release pip installs here, each in a venv of its own
# (.venv-torch-<version>, git-ignored); the pinned .venv is not touched. These are PyPI's CUDA
# builds, which run on the CPU. The OpInfo sweep runs with the pin only: each release has its own
# op database, and the sweep's table of refusals names the pinned one's ops.
TORCH_RANGE ?= 2.5.1 2.14.1

test-torch-range: $(foreach v,$(TORCH_RANGE),.venv-torch-$(v)/.installed)
	for v in $(TORCH_RANGE); do \
		echo "== torch $$v"; \
		.venv-torch-$$v/bin/python -m pytest -p no:cacheprovider -m "not opinfo" || exit 1; \
	done

.venv-torch-%/.installed: pyproject.toml
	rm -rf .venv-torch-$*
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet "torch==$*" -e ".[test,julia]"
	touch $@

# the OpInfo sweep's counts table ("N of M ops exact"); --report FILE for every op not exact
sweep: setup
	$(PY) tests/opinfo_sweep.py

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,julia,bench]"
	touch $@

# every benchmark; tables and plots land in benchmarks/results/
bench: $(VENV)/.bench-installed
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done
