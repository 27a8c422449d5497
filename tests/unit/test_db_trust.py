"""Databases fleetd writes into (issue 40 point 5, point 8's corrupt files, issue 45 point 5):
a target's own schema never runs, every connection has trusted_schema off, a write has a
deadline, created files are 0600 and never written through a symlink, and a damaged file
is one line naming it, in every reader and in ``fleetd check --only db``.

Real files made by fleetd's own writer, real commands (in a subprocess where the exit code
and stderr are the point), real damage (garbage over a page, a file cut mid-page)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

import hostile_files as H
import pytest

from fleetd.store.db import (
    WriteTimeout,
    check_own_schema,
    connect,
    connect_foreign,
    find_damage,
    normalise_sql,
    open_reader,
    open_writer,
)
from fleetd.store.schema import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[2]
KINETO = REPO / "tests" / "data" / "gpu" / "sampled_rank-0.json.gz"
# Each a schema object fleetd never makes, as a copy from elsewhere may hold one: an
# expression index costs its SQL on every inserted row, a trigger runs on every insert,
# a view is a query anyone reading the file runs.
PLANTED = {
    "index": ("CREATE INDEX slow ON gpu_data(length(replace(hex(zeroblob(1000)), '0', 'ab'))"
              " + ts_ns)", "index 'slow' on 'gpu_data'"),
    "trigger": ("CREATE TRIGGER grow AFTER INSERT ON gpu_data BEGIN INSERT INTO meta(key, "
                "value) VALUES (hex(randomblob(8)), ''); END", "'grow' on 'gpu_data'"),
    "view": ("CREATE VIEW extra AS SELECT * FROM event_data", "view 'extra'"),
    "table": ("CREATE TABLE stash (x)", "table 'stash'"),
}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fleetd_db(path: Path, n: int = 200, node: str = "gpu-01") -> Path:
    """A node database as fleetd's writer makes it, its WAL folded in."""
    H.node_db(path, node, n=n)
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


def planted(path: Path, kind: str) -> Path:
    fleetd_db(path)
    with sqlite3.connect(path) as c:
        c.execute(PLANTED[kind][0])
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


def one_line(r: dict[str, Any], *says: str, rc: int = 2) -> str:
    err = r["stderr"].strip()
    lines = err.splitlines()
    assert r["rc"] == rc, err
    assert "Traceback" not in err, err
    assert lines and lines[0].startswith("fleetd: error: "), err
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("  hint: ")), err
    for s in says:
        assert s in lines[0], (s, lines[0])
    return err


# ---- a target's schema -------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_an_import_target_with_foreign_schema_is_refused_naming_it(tmp_path: Path,
                                                                  kind: str) -> None:
    target = planted(tmp_path / "target.db", kind)
    before = sha(target)
    r = H.measure(["import", str(KINETO), "--db", str(target), "--node", "b"])
    err = one_line(r, str(target), "schema fleetd did not create", PLANTED[kind][1])
    assert "write to a new file" in err
    assert sha(target) == before
    assert r["seconds"] < 30


@pytest.mark.parametrize("kind", ["index", "trigger", "view"])
def test_a_merge_output_with_foreign_schema_is_refused_blaming_the_output(
        tmp_path: Path, kind: str) -> None:
    out = planted(tmp_path / "out.db", kind)
    src = fleetd_db(tmp_path / "in.db", node="gpu-02")
    before = sha(out)
    r = H.measure(["merge", str(src), "-o", str(out)])
    err = one_line(r, str(out), PLANTED[kind][1])
    assert str(src) not in err.splitlines()[0]  # the innocent input is not blamed
    assert sha(out) == before


def test_fleetd_made_targets_are_accepted(tmp_path: Path) -> None:
    target = fleetd_db(tmp_path / "target.db", node="gpu-t")
    r = H.measure(["import", str(KINETO), "--db", str(target), "--node", "b"])
    assert r["rc"] == 0, r["stderr"]
    out = fleetd_db(tmp_path / "out.db", node="gpu-o")
    src = fleetd_db(tmp_path / "in.db", node="gpu-02")
    r = H.measure(["merge", str(src), str(target), "-o", str(out)])
    assert r["rc"] == 0, r["stderr"]
    with sqlite3.connect(out) as c:
        names = {n for (n,) in c.execute("SELECT name FROM nodes")}
    assert names == {"gpu-o", "gpu-02", "gpu-t", "b"}


def test_own_schema_is_told_by_name_and_sql(tmp_path: Path) -> None:
    db = fleetd_db(tmp_path / "a.db")
    conn = sqlite3.connect(db)
    check_own_schema(conn, db, SCHEMA_VERSION)  # the writer's own file
    # The name of one of fleetd's indexes over other SQL is not fleetd's index.
    conn.execute("DROP INDEX event_ts")
    conn.execute("CREATE INDEX event_ts ON event_data(ts_ns * 2)")
    with pytest.raises(Exception, match="index 'event_ts' on 'event_data'"):
        check_own_schema(conn, db, SCHEMA_VERSION)
    conn.close()


def test_sql_is_compared_without_comments_or_spacing() -> None:
    a = "CREATE TABLE t (\n  a TEXT, -- a comment\n  b INTEGER /* x */ NOT NULL\n)"
    assert normalise_sql(a) == normalise_sql("CREATE TABLE t ( a TEXT, b INTEGER NOT NULL )")
    # Inside quotes nothing changes: a default of '--  x' is not a comment.
    assert normalise_sql("CREATE TABLE t (a DEFAULT '--  x')") != normalise_sql(
        "CREATE TABLE t (a DEFAULT '-- x')")
    assert normalise_sql("CREATE TABLE t (a DEFAULT 'it''s')").endswith("'it''s')")


# ---- every connection, and the deadline -----------------------------------------------------


def test_trusted_schema_is_off_on_every_connection(tmp_path: Path) -> None:
    db = fleetd_db(tmp_path / "a.db")
    for conn in (open_writer(db), open_reader(db), connect(":memory:"),
                 connect_foreign(db, immutable=True)):
        try:
            assert conn.execute("PRAGMA trusted_schema").fetchone() == (0,)
        finally:
            conn.close()


def test_fleetd_opens_sqlite_in_one_place() -> None:
    """The factory (fleetd.store.db.connect) is the only caller of sqlite3.connect."""
    callers = [str(p.relative_to(REPO)) for p in (REPO / "fleetd").rglob("*.py")
               if re.search(r"sqlite3\.connect\(", p.read_text())]
    assert callers == ["fleetd/store/db.py"]


def test_a_slow_write_stops_at_its_deadline(tmp_path: Path) -> None:
    """An expression index added after the writer checked the file (another process
    edits it): each insert costs milliseconds of SQL; the write ends at its deadline."""
    db = tmp_path / "a.db"
    conn = open_writer(db, deadline_s=0.5)
    with sqlite3.connect(db) as other:
        other.execute("CREATE INDEX slow ON meta(length(replace(hex(zeroblob(4000000)), "
                      "'0', 'ab')) + length(key))")
    started = time.monotonic()
    with pytest.raises(WriteTimeout, match=re.escape(f"{db} ran past its 0.5 s limit")):
        conn.executemany("INSERT INTO meta(key, value) VALUES (?, '')",
                         [(str(i),) for i in range(2000)])
    assert time.monotonic() - started < 5  # 2,000 rows take over 40 s without it
    conn.execute("DROP INDEX slow")
    conn.execute("INSERT INTO meta(key, value) VALUES ('after', '')")  # a new deadline
    conn.close()


# ---- files fleetd creates ----------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_created_files_are_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        db = fleetd_db(tmp_path / "a.db")
        imported = tmp_path / "imported.db"
        assert H.measure(["import", str(KINETO), "--db", str(imported)])["rc"] == 0
        merged = tmp_path / "merged.db"
        assert H.measure(["merge", str(db), "-o", str(merged)])["rc"] == 0
        conn = open_writer(tmp_path / "live.db")
        conn.execute("INSERT INTO meta(key, value) VALUES ('x', '')")
        sidecars = [Path(f"{tmp_path / 'live.db'}{s}") for s in ("-wal", "-shm")]
        assert all(p.exists() for p in sidecars)
        for p in (db, imported, merged, tmp_path / "live.db", *sidecars):
            assert _mode(p) == 0o600, (p, oct(_mode(p)))
        conn.close()
    finally:
        os.umask(old)


@pytest.mark.parametrize("command", ["import", "merge", "writer"])
def test_a_symlink_at_an_output_path_is_refused_and_its_target_untouched(
        tmp_path: Path, command: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "out.db"
    link.symlink_to(victim)
    if command == "writer":
        with pytest.raises(Exception, match="is a symbolic link"):
            open_writer(link)
    else:
        argv = (["import", str(KINETO), "--db", str(link)] if command == "import" else
                ["merge", str(fleetd_db(tmp_path / "in.db")), "-o", str(link)])
        one_line(H.measure(argv), str(link), "is a symbolic link")
    assert victim.read_text() == "precious\n"
    assert link.is_symlink()


def test_a_symlink_at_a_side_file_is_refused(tmp_path: Path) -> None:
    db = fleetd_db(tmp_path / "a.db")
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    Path(f"{db}-wal").unlink(missing_ok=True)  # the writer closed: nothing in it
    Path(f"{db}-wal").symlink_to(victim)
    with pytest.raises(Exception, match="-wal' is a symbolic link"):
        open_writer(db)
    assert victim.read_bytes() == b"x"


# ---- damaged files -----------------------------------------------------------------------


def torn(path: Path) -> Path:
    """Garbage over the middle one of the events table's pages in a real database (a
    page of an index could be one that a query of the table alone never reads)."""
    page = 4096
    with sqlite3.connect(path) as c:
        leaves = [int(n) for (n,) in c.execute(
            "SELECT pageno FROM dbstat WHERE name = 'event_data' AND pagetype = 'leaf' "
            "ORDER BY pageno")]
    with path.open("r+b") as f:
        f.seek((leaves[len(leaves) // 2] - 1) * page)
        f.write(os.urandom(page))
    return path


def cut(path: Path) -> Path:
    """The file cut short in the middle of a page."""
    size = os.path.getsize(path)
    os.truncate(path, size // 2 + 1000)
    return path


READERS = [["explain"], ["ops"], ["overview"], ["stacks"], ["query", "SELECT count(*), "
           "sum(dur_ns) FROM events"], ["export", "--format", "perfetto", "-o", "{out}"]]


@pytest.mark.parametrize("damage", [torn, cut])
def test_a_damaged_database_is_one_line_in_every_reader(tmp_path: Path, damage: Any) -> None:
    db = damage(fleetd_db(tmp_path / "a.db", n=20_000))
    for argv in READERS:
        args = [a.replace("{out}", str(tmp_path / "x.json")) for a in argv]
        one_line(H.measure([*args, "--db", str(db)]), str(db))


@pytest.mark.parametrize("damage", [torn, cut])
def test_check_says_what_is_wrong_and_what_to_do(tmp_path: Path, damage: Any) -> None:
    good = fleetd_db(tmp_path / "good.db", n=20_000)
    r = H.measure(["check", "--only", "db", "--db", str(good), "--format", "json"])
    assert r["rc"] == 0, r["stdout"] + r["stderr"]
    assert "no damaged page" in r["stdout"]
    bad = damage(fleetd_db(tmp_path / "bad.db", n=20_000))
    assert find_damage(bad)[0]
    r = H.measure(["check", "--only", "db", "--db", str(bad), "--format", "json"])
    assert r["rc"] == 1, r["stdout"] + r["stderr"]
    (found,) = json.loads(r["stdout"])["checks"]
    assert found["status"] == "fail" and "malformed" in found["detail"], found
    assert "on_damaged_db: move-aside" in found["fix"] and f"mv {bad}" in found["fix"]
