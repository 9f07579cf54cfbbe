# The commands of the README: `make example`, `make test` (the fast tier: every spec not marked
# slow, with mypy and ruff; minutes) and `make test-all` (every spec: what CI runs). All set up
# .venv first. Which spec is in which tier: docs/guide/layout.md.
# torch is pinned here to the CPU wheel this kind of machine has on disk; the package itself
# accepts a range (pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# pytest runs on 2 workers (pytest-xdist; the specs of one xdist_group share a worker): on a
# quiet 2-core machine the fast tier took 414 s against 749 s in one process, from a fresh clone
# (2026-12-03; on a machine busy with other jobs it was slower, 1,660 s against 1,130 s).
# XDIST= runs one process.
XDIST ?= -n 2 --dist loadgroup

.PHONY: setup example test test-all lint test-torch-range typecheck docs bench sweep
.PRECIOUS: .venv-torch-%/.installed

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)" -e ".[test,julia]"
	touch $@

example: setup
	$(PY) examples/particles_hvp.py

test: setup typecheck lint
	$(PY) -m pytest -m "not slow" $(XDIST)

test-all: setup typecheck lint
	$(PY) -m pytest $(XDIST)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# mypy --strict on pyhvp/ (configured in pyproject.toml)
typecheck: setup
	$(PY) -m mypy

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,julia,docs]"
	touch $@

# the site into docs/_build/html (git-ignored), running every example; any warning fails it
docs: $(VENV)/.docs-installed
	$(PY) -m sphinx -W --keep-going -n -b html docs docs/_build/html


# The fast tier and the whole OpInfo sweep (pytest only; the slow tier's other specs -- compiles
# at length, sixth-order fallbacks, wheels -- run on the pin only, to keep CI within 40 minutes)
# on the ends of the torch range pyproject.toml declares besides the pin: its floor and the newest
# release pip installs here, each in a venv of its own
# (.venv-torch-<version>, git-ignored); the pinned .venv is not touched. These are PyPI's CUDA
# builds, which run on the CPU, about 5.5 GB each: pip keeps no cache of them, and with PRUNE=1
# (CI) each venv is removed once its suite has passed, so the disk never holds two. The OpInfo
# sweep runs against each release's own op database where tests/opinfo_sweep.py has a table of
# refusals for it (REFUSALS: the pin and 2.14) and is skipped elsewhere (2.5.1).
TORCH_RANGE ?= 2.5.1 2.14.1
PRUNE ?=

test-torch-range:
	for v in $(TORCH_RANGE); do $(MAKE) --no-print-directory test-torch-$$v || exit 1; done

test-torch-%: .venv-torch-%/.installed
	@echo "== torch $*"
	.venv-torch-$*/bin/python -m pytest -p no:cacheprovider -m "not slow or opinfo" $(XDIST)
	$(if $(PRUNE),rm -rf .venv-torch-$*)

.venv-torch-%/.installed: pyproject.toml
	@df -h . | tail -1 | awk '{print "== disk before torch $*: " $$4 " free"}'
	rm -rf .venv-torch-$*
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet --no-cache-dir "torch==$*" -e ".[test,julia]"
	touch $@

# the OpInfo sweep's counts table ("N of M ops exact"); --report FILE for every op not exact
sweep: setup
	$(PY) tests/opinfo_sweep.py

# torch-jet (bench_torch_jet's comparison) declares Python >= 3.12: the workplace's
# install-torch-jet installs it on 3.10/3.11 where that script exists; elsewhere its rows skip
INSTALL_TORCH_JET ?= ../shared/tools/install-torch-jet
$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,julia,bench]"
	if [ -x "$(INSTALL_TORCH_JET)" ]; then "$(INSTALL_TORCH_JET)" $(VENV); fi
	touch $@

# every benchmark; tables and plots land in benchmarks/results/
bench: $(VENV)/.bench-installed
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done
