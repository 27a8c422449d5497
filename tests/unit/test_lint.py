"""The code base stays ruff-clean and mypy-strict-clean (the package ships py.typed)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_clean() -> None:
    proc = _run(sys.executable, "-m", "ruff", "check", "fleetd", "tests", "bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_clean() -> None:
    proc = _run(sys.executable, "-m", "mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_test_files_have_unique_names() -> None:
    """pytest imports test modules by their base name (rootdir-relative "prepend" mode):
    tests/unit/test_x.py and tests/integration/test_x.py cannot both be collected, and
    the whole run stops at collection. One run of the suite found such a pair."""
    from collections import Counter

    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert [n for n, k in names.items() if k > 1] == []
