"""`fleetd merge` as a user runs it: summary, progress, mistakes, and Ctrl-C."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FLEETD, REPO, assert_one_line_error

sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "unit"))

from _gendb import make_node_db  # noqa: E402
from test_merge import node_db  # noqa: E402


def fleetd(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)


def test_merge_prints_a_summary_and_progress(tmp_path: Path) -> None:
    a = node_db(tmp_path / "a.db", "gpu-01", 300)
    b = node_db(tmp_path / "b.db", "gpu-02", 100, error_ns=20_000_000)
    proc = fleetd("merge", str(a), str(b), "-o", str(tmp_path / "c.db"), "--progress")
    assert proc.returncode == 0, proc.stderr
    assert "merged 2 input(s)" in proc.stdout and "gpu-01" in proc.stdout
    # The clock table's columns say what they hold: UTC times, not ns (#44.8).
    header = next(x for x in proc.stdout.splitlines() if x.startswith("node "))
    assert "first (UTC)" in header and "last (UTC)" in header and "_ns" not in header
    row = next(x for x in proc.stdout.splitlines() if x.startswith("gpu-01 "))
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", row), row
    assert "merge [1/2] a.db: events 100% (300/300)" in proc.stderr
    assert "merge [1/2] a.db: done 100% (300/300)" in proc.stderr
    assert "merge [2/2] b.db" in proc.stderr
    assert "fleetd: warning: nodes 'gpu-02' (clock error ±20.0 ms)" in proc.stderr
    again = fleetd("merge", str(a), "-o", str(tmp_path / "c.db"))
    assert again.returncode == 0 and "Traceback" not in again.stderr


def test_merge_mistakes_are_one_line(tmp_path: Path) -> None:
    out = str(tmp_path / "out.db")
    assert_one_line_error(fleetd("merge", str(tmp_path / "nope.db"), "-o", out), "does not exist")
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"garbage" * 1000)
    assert_one_line_error(fleetd("merge", str(bad), "-o", out), "not a readable SQLite database")
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE t (x)")
    assert_one_line_error(fleetd("merge", str(foreign), "-o", out), "not a fleetd one")
    newer = node_db(tmp_path / "new.db", "gpu-01")
    with sqlite3.connect(newer) as c:
        c.execute("PRAGMA user_version = 99")
    assert_one_line_error(fleetd("merge", str(newer), "-o", out), "schema version 99")
    a = node_db(tmp_path / "a.db", "gpu-01")
    b = node_db(tmp_path / "b.db", "gpu-01")
    proc = fleetd("merge", str(a), str(b), "-o", out)
    assert_one_line_error(proc, "two different nodes are named 'gpu-01'")
    assert f"hint: give one another name: --force-node {b}=gpu-01-2" in proc.stderr
    assert_one_line_error(fleetd("merge", str(a), "-o", str(a)), "is also the output")
    assert_one_line_error(fleetd("merge", str(a), "-o", out, "--clock-threshold", "soon"),
                   "invalid duration 'soon'")
    assert not Path(out).exists()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def big_inputs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("big")
    return [make_node_db(d / f"n{i}.db", f"gpu-{i}", 400_000, rank=i) for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("existing", [False, True])
def test_interrupt_leaves_no_half_written_output(tmp_path: Path, big_inputs: list[Path],
                                                 sig: signal.Signals, existing: bool) -> None:
    out = tmp_path / "cluster.db"
    if existing:
        small = node_db(tmp_path / "small.db", "gpu-x")
        assert fleetd("merge", str(small), "-o", str(out)).returncode == 0
    before = _sha(out) if existing else None
    inputs = {p: _sha(p) for p in big_inputs}
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    proc = subprocess.Popen([FLEETD, "merge", *map(str, big_inputs), "-o", str(out),
                             "--progress"], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the first batch is being copied now
    assert first.startswith("merge [1/2]"), first
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (first, err)
    assert "fleetd: interrupted" in err and "Traceback" not in err
    if existing:
        assert _sha(out) == before
    else:
        assert not out.exists()
    leftovers = [p.name for p in tmp_path.iterdir() if "merging" in p.name]
    assert leftovers == []
    assert {p: _sha(p) for p in big_inputs} == inputs
