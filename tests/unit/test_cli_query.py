"""`fleetd query` as a user types it: formats, shortcuts, and one clear line per mistake."""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import subprocess
import threading
from pathlib import Path

import pytest

from fleetd.store.writer import BatchWriter

from conftest import FLEETD, build_db, synthetic_events


def fleetd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"} | (env or {})
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout)


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("fleetd: error: ")
    for n in needles:
        assert n in proc.stderr, proc.stderr


SQL = "SELECT op, count(*) AS n FROM events GROUP BY op ORDER BY op"


def test_query_formats(small_db: Path) -> None:
    table = fleetd("query", "--db", str(small_db), SQL)
    assert table.returncode == 0, table.stderr
    assert "cudaLaunchKernel" in table.stdout and "(4 rows)" in table.stdout

    obj = json.loads(fleetd("query", "--db", str(small_db), "--format", "json", SQL).stdout)
    assert obj["columns"] == ["op", "n"]
    assert ["off_cpu", 100] in obj["rows"]
    assert obj["truncated"] is False and obj["warnings"] == [] and obj["skew"] == {}

    rows = list(csv.reader(io.StringIO(fleetd("query", "--db", str(small_db), "--format", "csv",
                                              SQL).stdout)))
    assert rows[0] == ["op", "n"] and len(rows) == 5

    lines = fleetd("query", "--db", str(small_db), "--format", "ndjson", SQL).stdout.splitlines()
    assert json.loads(lines[0]) == {"op": "cudaLaunchKernel", "n": 100}


def test_default_db_from_environment(small_db: Path) -> None:
    proc = fleetd("query", "--format", "json", "SELECT count(*) FROM events",
                  env={"FLEETD_DB": str(small_db)})
    assert json.loads(proc.stdout)["rows"] == [[400]]


def test_shortcuts_and_limit(small_db: Path) -> None:
    proc = fleetd("query", "--db", str(small_db), "--op", "cudaMemcpyAsync", "--since", "1d",
                  "--format", "json", "--limit", "10")
    obj = json.loads(proc.stdout)
    assert len(obj["rows"]) == 10 and obj["truncated"] is True
    assert {r[obj["columns"].index("op")] for r in obj["rows"]} == {"cudaMemcpyAsync"}
    # The limit was the user's: "truncated" says more rows exist, nothing warns about it.
    assert obj["warnings"] == []
    table = fleetd("query", "--db", str(small_db), "--limit", "3", SQL)
    assert table.returncode == 0 and "(3 rows)" in table.stdout and table.stderr == ""


def test_since_on_an_old_recording_explains_the_empty_answer(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with BatchWriter(path, "old") as w:
        w.add_events(synthetic_events(10, t0=1_600_000_000_000_000_000))
    proc = fleetd("query", "--db", str(path), "--since", "5m")
    assert proc.returncode == 0
    assert "newest event is from 2020-09-13" in proc.stderr


def test_params_are_bound(small_db: Path) -> None:
    proc = fleetd("query", "--db", str(small_db), "--format", "json",
                  "SELECT count(*) FROM events WHERE op = ? AND pid = ?",
                  "--param", "cudaLaunchKernel", "--param", "4242")
    assert json.loads(proc.stdout)["rows"] == [[100]]


def test_missing_database_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "nope.db"
    assert_user_error(fleetd("query", "--db", str(path), SQL), "does not exist", str(path))
    assert not path.exists()


def test_corrupt_and_foreign_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(8192))
    assert_user_error(fleetd("query", "--db", str(junk), SQL), "junk.db")
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE t(x)")
    assert_user_error(fleetd("query", "--db", str(foreign), SQL), "not a fleetd one")


def test_locked_database(tmp_path: Path) -> None:
    path = build_db(tmp_path / "locked.db")
    with sqlite3.connect(path) as c:
        # A rollback journal, where an exclusive lock blocks readers (WAL would not).
        c.execute("PRAGMA journal_mode=DELETE")
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        assert_user_error(fleetd("query", "--db", str(path), SQL), "locked")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


@pytest.mark.parametrize("since", ["5", "five minutes", "-5m", "0s", "5w"])
def test_bad_since(small_db: Path, since: str) -> None:
    assert_user_error(fleetd("query", "--db", str(small_db), f"--since={since}"),
                      f"invalid duration {since!r}", "30s, 5m, 2h, 1d")


def test_sql_syntax_error(small_db: Path) -> None:
    assert_user_error(fleetd("query", "--db", str(small_db), "SELEKT * FROM events"),
                      "syntax error")


def test_unknown_format_and_op(small_db: Path) -> None:
    assert_user_error(fleetd("query", "--db", str(small_db), "--format", "xml", SQL),
                      "unknown format 'xml'", "table, json, csv, ndjson")
    assert_user_error(fleetd("query", "--db", str(small_db), "--op", "cudaLaunchKernal"),
                      "unknown op 'cudaLaunchKernal'", "cudaLaunchKernel")


def test_write_attempt_over_the_cli_leaves_the_file_alone(small_db: Path) -> None:
    before = small_db.read_bytes()
    assert_user_error(fleetd("query", "--db", str(small_db), "DELETE FROM event_data"),
                      "refused")
    assert small_db.read_bytes() == before


def test_query_reads_while_a_writer_writes(tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    w = BatchWriter(path, "live")
    w.add_events(synthetic_events(100))
    w.flush()
    stop = threading.Event()

    def keep_writing() -> None:
        while not stop.is_set():
            w.add_events(synthetic_events(500))
            w.flush()

    t = threading.Thread(target=keep_writing)
    t.start()
    try:
        proc = fleetd("query", "--db", str(path), "--format", "json",
                      "SELECT count(*) FROM event_data")
    finally:
        stop.set()
        t.join()
        w.close()
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rows"][0][0] >= 100
