"""kill -9 of a real `fleetd agent` while it writes, 20 times in a row (issue 45 point 2):
every next start opens the database as it is (no damage found, nothing moved aside),
the events a workload made up to a second before each kill are stored, and what each
killed session lost (its last commit, the events after it, the untraced gap) is reported
by the next start (its log, GET /api/v1/health) and by `fleetd check --only db`."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import stamped
from agents import agent, request

from conftest import FLEETD

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent traces: needs root")

KILLS = 20
RATE = 400  # workload calls per second
GRACE_NS = 10**9  # the events of the last second before a kill may be lost


def agent_args(pid: int) -> list[str]:
    return ["--plain-http", "--pid", str(pid), "--sample", "1", "--no-host",
            "--cpu-sample-hz", "0"]


def test_twenty_kills_lose_at_most_the_last_second_and_say_so(tmp_path: Path) -> None:
    rng = random.Random(45)
    db = tmp_path / "node.db"
    stamps = tmp_path / "stamps.bin"
    runs: list[tuple[int, int]] = []  # (listening, killed) per start, wall ns
    with stamped.running(stamps, RATE) as wl:
        for _ in range(KILLS):
            with agent(db, "gpu-01", None, *agent_args(wl.pid)) as a:
                up = time.time_ns()
                # A moment spread over a second: the tracer polls and commits every
                # 0.1 s and does its upkeep every 1 s, so kills land at every phase of
                # both; at least 0.2 s of each run (80 calls) is checked for losses.
                time.sleep(rng.uniform(1.3, 2.3))
                killed = time.time_ns()
                a.proc.send_signal(signal.SIGKILL)
                a.proc.wait(10)
                text = a.log.read_text()
            assert "damaged" not in text and "Traceback" not in text, text
            runs.append((up, killed))
        check = subprocess.run([FLEETD, "check", "--only", "db", "--db", str(db),
                                "--format", "json"], capture_output=True, text=True,
                               timeout=120)
        with agent(db, "gpu-01", None, *agent_args(wl.pid)) as a:
            health = request(a.url, None)[1]
            assert a.stop() == 0
            final_log = a.log.read_text()
    made = stamped.calls(stamps)
    kept = stamped.stored(db, wl.pid)

    # No opening found damage (each start ran the damage check and went on) and SQLite
    # itself finds none.
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA quick_check").fetchone() == ("ok",)
        sessions = c.execute("SELECT seq, end_reason, ended_ns, lost_events FROM "
                             "session_data ORDER BY seq").fetchall()
    assert [s[1] for s in sessions] == ["crashed"] * KILLS + ["stopped"]

    # Loss: calls made from each start until a second before its kill, never stored.
    windows = [stamped.made_in(made, up + 100_000_000, killed - GRACE_NS)
               for up, killed in runs]
    losses = [len(stamped.unmatched(w, kept)) for w in windows]
    covered = [len(w) for w in windows]
    print(f"\n{KILLS} kills: calls lost before the last second {losses} of {covered}; "
          f"last commit before the kill (ms) "
          f"{[(k - s[2]) // 10**6 for (_, k), s in zip(runs, sessions, strict=False)]}")
    assert all(covered) and sum(losses) == 0, (losses, covered)
    for (_, killed), (_seq, _, last_commit, _lost) in zip(runs, sessions, strict=False):
        assert killed - GRACE_NS <= last_commit <= killed, (killed, last_commit)

    # fleetd check names the newest killed session, its last commit and the gap.
    report = json.loads(check.stdout)
    (db_check,) = report["checks"]
    assert db_check["status"] == "warn", db_check
    sessions_data = db_check["data"]["sessions"]
    assert sessions_data["crashed"] == KILLS and sessions_data["newest_crashed"]
    newest = sessions_data["crashes"][-1]
    assert newest["session"] == KILLS and newest["last_commit_ns"] == sessions[KILLS - 1][2]
    assert f"session {KILLS} of gpu-01 was killed" in db_check["detail"]
    # The next start says it too: its log and its health answer.
    (crash,) = health["store"]["crashed_sessions"]
    assert crash["session"] == KILLS and crash["gap_s"] > 0
    assert f"session {KILLS} of gpu-01 was killed: its last commit was at" in final_log
