# The two commands a fresh machine needs (see README):
#   make demo   installs everything and runs the local fleet demo
#   make test   installs everything and runs the test suite
.PHONY: setup demo test lint bench
PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/fleetd demo

test: setup
	@$(PY) -m pytest -q -ra tests

lint: setup
	@.venv/bin/ruff check fleetd tests bench
	@.venv/bin/mypy

bench: setup
	@for b in bench/[!_]*.py; do $(PY) $$b || exit 1; done
