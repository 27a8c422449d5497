"""`fleetd check` as a normal user (issue 44.1): every check that needs root says so as a
finding with its fix, never a traceback; a database the user may not read is a finding
too. Run as `nobody` with setpriv (root switching to it), HOME of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import FLEETD, REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root to switch to nobody (setpriv)")


@pytest.fixture
def home() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fleetd-nobody-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_nobody(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home)}
    env.pop("FLEETD_CACHE_DIR", None)
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                           FLEETD, "check", *args], capture_output=True, text=True,
                          timeout=300, cwd=home, env=env)


def test_check_as_nobody_reports_what_needs_root(home: Path) -> None:
    r = _as_nobody(home, "--format", "json")
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 1, r.stderr  # failed checks, not a crash
    rows = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert rows["root"]["status"] == "fail"
    for name in ("tracefs", "tracepoints"):
        assert rows[name]["status"] == "fail", rows[name]
        assert "root" in rows[name]["fix"], rows[name]
    assert rows["programs"]["status"] == "skip"


def test_a_database_the_user_cannot_read_is_a_finding(home: Path) -> None:
    private = Path(tempfile.mkdtemp(prefix="fleetd-private-", dir="/tmp"))
    try:
        db = private / "node.db"
        shutil.copy(REPO / "investigations" / "scenarios" / "quiet.db", db)
        db.chmod(0o600)
        private.chmod(0o755)
        r = _as_nobody(home, "--only", "db", "--db", str(db))
        assert "Traceback" not in r.stderr, r.stderr
        assert r.returncode == 1 and "fail" in r.stdout and "fix:" in r.stdout, r.stdout
    finally:
        shutil.rmtree(private, ignore_errors=True)
