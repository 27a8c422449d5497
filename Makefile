# The two commands a fresh machine needs (see README):
#   make demo   installs everything and runs the local fleet demo
#   make test   installs everything and runs the test suite
.PHONY: setup demo test lint bench bundle
PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/fleetd demo

test: setup
	@$(PY) -m pytest -q -ra --durations=40 tests

lint: setup
	@.venv/bin/ruff check fleetd tests bench
	@.venv/bin/mypy

bench: setup
	@for b in bench/[!_]*.py; do $(PY) $$b || exit 1; done

# make bundle [PYTHON=3.12] [WITHOUT="pkg ..."]: the offline node side for air-gapped x86_64
# GPU nodes, for that CPython version (docs/deploy.md, "Air-gapped nodes"): writes
# dist/fleetd-bundle-py$(PYTHON)-x86_64.tar.xz. Needs no venv (no setup: PYTHON here is a
# version, not an interpreter).
bundle:
	@bash scripts/bundle.sh $(or $(PYTHON),3.12)
