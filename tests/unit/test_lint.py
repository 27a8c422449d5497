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
