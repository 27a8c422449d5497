"""A damaged database and a real `fleetd agent` (issue 45 point 5): refused at start in one
line naming the file, or moved aside for a new one (``store.on_damaged_db: move-aside``);
a page damaged while the agent runs makes a query answer an error, never a crash."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hostile_files as H
import pytest
from agents import agent, request

from conftest import FLEETD

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent traces: needs root")


def fleetd_db(path: Path, n: int = 20_000) -> Path:
    H.node_db(path, "gpu-01", n=n)
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


def torn(path: Path) -> Path:
    """Garbage over a page in the middle of the file, as a bad sector leaves it."""
    page = 4096
    with path.open("r+b") as f:
        f.seek((path.stat().st_size // page // 2) * page)
        f.write(os.urandom(page))
    return path


@contextmanager
def sleeper() -> Iterator[int]:
    """A process for the agent to trace: the damage check comes before any tracing."""
    p = subprocess.Popen(["sleep", "600"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def agent_argv(db: Path, pid: int, *extra: str) -> list[str]:
    return [FLEETD, "agent", "--db", str(db), "--node", "gpu-01", "--listen", "127.0.0.1:0",
            "--plain-http", "--pid", str(pid), *extra]


def test_the_agent_refuses_a_damaged_database_in_one_line(tmp_path: Path) -> None:
    db = torn(fleetd_db(tmp_path / "node.db"))
    before = db.read_bytes()
    with sleeper() as pid:
        r = subprocess.run(agent_argv(db, pid), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("fleetd: error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"database {db} is damaged" in errors[0]
    assert "on_damaged_db: move-aside" in r.stderr and f"mv {db}" in r.stderr
    assert db.read_bytes() == before  # nothing written into it


def test_move_aside_keeps_the_damaged_file_and_starts_a_new_one(tmp_path: Path) -> None:
    db = torn(fleetd_db(tmp_path / "node.db"))
    before = db.read_bytes()
    config = tmp_path / "fleetd.yaml"
    config.write_text("store:\n  on_damaged_db: move-aside\n")
    log = tmp_path / "agent.log"
    with sleeper() as pid, log.open("w") as fh:
        proc = subprocess.Popen(agent_argv(db, pid, "--config", str(config)), stdout=fh,
                                stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while "listening on" not in log.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.1)
            text = log.read_text()
            assert "moved aside to" in text, text
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    (aside,) = tmp_path.glob("node.db.damaged-*[0-9]Z")
    assert aside.read_bytes() == before  # kept, for whoever wants to recover it
    assert f"database {db} is damaged" in text and str(aside) in text
    with sqlite3.connect(db) as c:  # the new one is a fleetd database of its own
        assert c.execute("PRAGMA application_id").fetchone()[0] == 0x666C7464
        assert c.execute("PRAGMA quick_check").fetchone() == ("ok",)
    assert (db.stat().st_mode & 0o777) == 0o600


def test_a_page_damaged_while_serving_answers_an_error(tmp_path: Path) -> None:
    db = fleetd_db(tmp_path / "node.db")
    with agent(db, "gpu-01", None, "--no-trace", "--plain-http") as a:
        assert request(a.url, None)[0] == 200
        torn(db)
        sql = {"sql": "SELECT count(*), sum(dur_ns), max(ts_ns) FROM events"}
        status, body, raw = request(a.url, None, "POST", "/api/v1/query", json=sql)
        assert status == 503, raw
        assert "is damaged" in body["error"]["message"], body
        status, body, raw = request(a.url, None, "GET", "/api/v1/ops")
        assert status in (503, 200), raw  # an analysis may not read the torn page
        if status == 503:
            assert "is damaged" in body["error"]["message"], body
        assert request(a.url, None)[0] == 200  # still serving
        assert a.proc.poll() is None
        assert "Traceback" not in a.log.read_text()
