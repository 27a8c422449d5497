"""The benchmarks run only in CI after the tests: a name they import from fleetd that
moved away must fail here, in the test run, not after it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from conftest import REPO

BENCHES = sorted((REPO / "bench").glob("*.py"))


@pytest.mark.parametrize("path", BENCHES, ids=[p.name for p in BENCHES])
def test_every_fleetd_name_a_benchmark_imports_exists(path: Path) -> None:
    tree = ast.parse(path.read_text())
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fleetd"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:  # a submodule, as in `from fleetd.security import tls`
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{node.module}.{alias.name} (line {node.lineno})")
    assert BENCHES and not missing, missing
