"""fleetd merge: what is carried, identity rules, idempotence, versions, bad inputs."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from fleetd.errors import StoreError, UsageError
from fleetd.store import db as store_db
from fleetd.store import merge as merge_mod
from fleetd.store import schema
from fleetd.store.catalog import op_code
from fleetd.store.clockinfo import NodeClock, SessionClock, clock_warnings
from fleetd.store.db import open_reader, open_writer
from fleetd.store.merge import merge
from fleetd.store.schema import SEQ_BITS
from fleetd.store.writer import BatchWriter

from conftest import synthetic_events

T0 = 1_750_000_000 * 10**9
MS = 1_000_000
# Every data table, read through the views (node names, not keys) so files compare.
VIEWS = {
    "events": "SELECT id, node, ts_ns, dur_ns, pid, tid, comm, thread, op, ret, bytes, peer, "
              "a0, a1, stack, args, rank FROM events",
    "sessions": "SELECT id, node, seq, host, kernel, boot_id, started_ns, ended_ns, "
                "mono_offset_ns, clock_error_ns, clock_samples, rank, local_rank, world_size, "
                "tool_version, schema_version, lost_events, dropped_stacks, sampled_out, drops, "
                "targets, headers_route, command FROM sessions",
    "processes": "SELECT * FROM processes",
    "threads": "SELECT * FROM threads",
    "aggregates": "SELECT * FROM aggregates",
    "chain_history": "SELECT id, node, key, version, created_ns, ts_ns, dur_ns, severity, "
                     "root_cause, summary, evidence, fixes FROM chain_history",
}


def node_db(path: Path, node: str, n: int = 200, *, t0: int = T0, error_ns: int = 100_000,
            stack_salt: int = 0, samples: list[list[int]] | None = None) -> Path:
    """A node file with a bit of everything merge must carry."""
    with BatchWriter(path, node, host=f"host-{node}") as w:
        seq = w.begin_session({
            "started_ns": t0, "mono_offset_ns": t0 - 10**12, "clock_error_ns": error_ns,
            "clock_samples": samples or [[10**12, t0 - 10**12, error_ns]],
            "tool_version": "test", "schema_version": 1, "boot_id": f"boot-{node}",
            "rank": 0, "drops": {"cuda": 2}, "lost_events": 2})
        w.update_session(seq, {"ended_ns": t0 + n * MS, "dropped_stacks": 1, "sampled_out": 9})
        w.add_processes([{"pid": 4242, "comm": "train", "rank": 0, "world_size": 2}])
        w.add_tasks([(4242, 4242, "train"), (4243, 4242, "loader")])
        # One stack every node shares (same content hash), one of its own.
        w.add_stacks([(77, ["a", "shared"]), (1000 + stack_salt, ["b", node])])
        rows = [(*r[:10], 77 if i % 10 == 0 else 0)
                for i, r in enumerate(synthetic_events(n, t0=t0))]
        w.add_events(rows, [(3, {"grid": [8, 1, 1], "block": [128, 1, 1]})])
        code = op_code("cudaLaunchKernel")
        w.add_aggregates([(seq, t0, 10**9, 4242, code, -1, 50, 500_000),
                          (seq, t0, 10**9, 4242, code, 12, 50, 500_000),
                          (None, t0, 10**9, None, op_code("page_alloc"), 0, 7, 7)])
        chain = {"key": "k1", "ts_ns": t0, "dur_ns": MS, "severity": "LOW",
                 "root_cause": "cpu_contention", "summary": "first", "evidence": [],
                 "fixes": ["f"]}
        w.add_chains([chain, {**chain, "severity": "HIGH", "summary": "second"}])
    return path


def dump(path: Path, node: str | None = None) -> dict[str, list[tuple[Any, ...]]]:
    conn = open_reader(path)
    try:
        out = {}
        for name, sql in VIEWS.items():
            where = " WHERE node = ?" if node else ""
            rows = conn.execute(sql + where, (node,) if node else ()).fetchall()
            out[name] = sorted(rows, key=repr)
        out["stacks"] = sorted(conn.execute("SELECT hash, frames FROM stacks").fetchall())
        return out
    finally:
        conn.close()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def three(tmp_path: Path) -> list[Path]:
    return [node_db(tmp_path / f"n{i}.db", f"gpu-0{i}", 200 + 50 * i, stack_salt=i)
            for i in range(3)]


def test_merge_carries_every_table_node_by_node(tmp_path: Path, three: list[Path]) -> None:
    out = tmp_path / "cluster.db"
    report = merge(three, out)
    assert [r.nodes for r in report.inputs] == [["gpu-00"], ["gpu-01"], ["gpu-02"]]
    for i, src in enumerate(three):
        mine, merged = dump(src), dump(out, f"gpu-0{i}")
        for view in VIEWS:
            assert merged[view] == mine[view], view
    merged = dump(out)
    # Stacks once per hash: the shared one once, plus one per node.
    assert [h for h, _ in merged["stacks"]] == [77, 1000, 1001, 1002]
    assert sum(r.added["stacks"] for r in report.inputs) == 4
    # Node-namespaced ids survive: node:seq, seq as in the node's own file.
    with sqlite3.connect(out) as c:
        assert c.execute("SELECT min(id), max(id) FROM events WHERE node='gpu-02'").fetchone() \
            == ("gpu-02:1", "gpu-02:99")
        keys = c.execute("SELECT DISTINCT rowkey >> 40 FROM events ORDER BY 1").fetchall()
        assert keys == [(1,), (2,), (3,)]
        # History and drop counters came along.
        assert c.execute("SELECT count(*) FROM chain_history").fetchone() == (6,)
        assert c.execute("SELECT count(*) FROM chains").fetchone() == (3,)
        assert c.execute("SELECT DISTINCT lost_events, dropped_stacks, sampled_out, drops "
                         "FROM sessions").fetchall() == [(2, 1, 9, '{"cuda":2}')]
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert c.execute("PRAGMA user_version").fetchone() == (schema.SCHEMA_VERSION,)
        log = c.execute("SELECT value FROM meta WHERE key = 'merge_log'").fetchone()[0]
    assert log.count('"input"') == 3


def test_inputs_are_never_changed(tmp_path: Path, three: list[Path]) -> None:
    before = {p: sha(p) for p in three}
    stat = {p: p.stat().st_mtime_ns for p in three}
    merge(three, tmp_path / "cluster.db")
    merge(three, tmp_path / "cluster.db")
    assert {p: sha(p) for p in three} == before
    assert {p: p.stat().st_mtime_ns for p in three} == stat
    for p in three:  # a reader may leave SQLite's empty sidecars, never content
        wal = Path(f"{p}-wal")
        assert not wal.exists() or wal.stat().st_size == 0


def test_merging_again_adds_nothing(tmp_path: Path, three: list[Path]) -> None:
    out = tmp_path / "cluster.db"
    merge(three[:2], out)
    first = dump(out)
    again = merge(three[:2], out)
    assert dump(out) == first
    assert all(n == 0 for r in again.inputs for n in r.added.values()), again.inputs
    merge(three, out)  # extending with a new node keeps the old ones as they were
    grown = dump(out)
    for view in VIEWS:
        assert [r for r in grown[view] if "gpu-02" not in repr(r)] == first[view]
    merge([three[2]], out)
    assert dump(out) == grown


def test_a_merged_file_merges_like_its_nodes(tmp_path: Path, three: list[Path]) -> None:
    part = tmp_path / "part.db"
    merge(three[:2], part)
    whole = tmp_path / "whole.db"
    merge([part, three[2]], whole)
    direct = tmp_path / "direct.db"
    merge(three, direct)
    assert dump(whole) == dump(direct)


def test_a_later_copy_of_a_node_adds_only_what_is_new(tmp_path: Path) -> None:
    path = node_db(tmp_path / "live.db", "gpu-00", 100)
    snap = tmp_path / "snap.db"
    snap.write_bytes(path.read_bytes())
    with BatchWriter(path, "gpu-00") as w:  # the node kept tracing after the copy
        w.add_events(synthetic_events(30, t0=T0 + 10**9))
    out = tmp_path / "cluster.db"
    merge([snap], out)
    report = merge([path], out)
    assert report.inputs[0].added["events"] == 30
    assert dump(out) == dump(path)


def test_two_nodes_with_one_name_are_refused(tmp_path: Path) -> None:
    a = node_db(tmp_path / "a.db", "gpu-01")
    b = node_db(tmp_path / "b.db", "gpu-01")
    out = tmp_path / "cluster.db"
    with pytest.raises(StoreError) as exc:
        merge([a, b], out)
    assert "two different nodes are named 'gpu-01'" in exc.value.message
    assert exc.value.hint and f"--force-node {b}=gpu-01-2" in exc.value.hint
    assert not out.exists()
    report = merge([a, b], out, [f"{b}=gpu-01b"])
    assert [r.nodes for r in report.inputs] == [["gpu-01"], ["gpu-01b"]]
    again = merge([a, b], out, [f"{b}=gpu-01b"])  # the rename is remembered by uid
    assert sum(r.added["events"] for r in again.inputs) == 0
    with pytest.raises(StoreError, match="two different nodes"):
        merge([b], out)  # without the rename, b clashes with the gpu-01 already merged


def test_one_node_under_two_names_is_refused(tmp_path: Path) -> None:
    a = node_db(tmp_path / "a.db", "gpu-01")
    out = tmp_path / "cluster.db"
    merge([a], out)
    with pytest.raises(StoreError, match="already merged as 'gpu-01'") as exc:
        merge([a], out, [f"{a}=other"])
    assert exc.value.hint == f"keep one name: --force-node {a}=gpu-01"


def _anonymous(path: Path, n: int = 50, t0: int = T0) -> Path:
    """A fleetd file whose events have no nodes row (written by hand, or by old tools)."""
    conn = open_writer(path)
    rows = [((1 << SEQ_BITS) + i + 1, *r) for i, r in enumerate(synthetic_events(n, t0=t0))]
    conn.executemany("INSERT INTO event_data VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    conn.close()
    return path


def test_inputs_without_identity_need_force_node(tmp_path: Path) -> None:
    anon = _anonymous(tmp_path / "old.db")
    named = node_db(tmp_path / "a.db", "gpu-01")
    out = tmp_path / "cluster.db"
    with pytest.raises(UsageError, match="has no node identity") as exc:
        merge([named, anon], out)
    assert exc.value.hint and "--force-node NAME" in exc.value.hint
    merge([named, anon], out, ["gpu-old"])
    with sqlite3.connect(out) as c:
        assert c.execute("SELECT node, count(*) FROM events GROUP BY node").fetchall() == [
            ("gpu-01", 200), ("gpu-old", 50)]
    again = merge([anon], out, ["gpu-old"])  # same content, same name: the same node
    assert again.inputs[0].added["events"] == 0
    other = _anonymous(tmp_path / "other.db", 60, T0 + 7)  # another machine's recording
    with pytest.raises(StoreError, match="two different nodes are named 'gpu-old'"):
        merge([other], out, ["gpu-old"])
    with pytest.raises(UsageError, match="has no input to name"):
        merge([named], tmp_path / "x.db", ["spare"])


def test_bad_force_node_names_are_refused(tmp_path: Path) -> None:
    anon = _anonymous(tmp_path / "old.db")
    with pytest.raises(StoreError, match="invalid node name 'a:b'"):
        merge([anon], tmp_path / "out.db", ["a:b"])


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = node_db(tmp_path / "future.db", "gpu-01")
    with sqlite3.connect(path) as c:
        c.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer than this fleetd understands"):
        merge([path], tmp_path / "out.db")
    assert not (tmp_path / "out.db").exists()


_NOW = schema.SCHEMA_VERSION  # the real current version, before a test pretends another


def _v2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the schema has one more version: event_data gained a column."""
    v2 = "ALTER TABLE event_data ADD COLUMN cpu INTEGER NOT NULL DEFAULT 0;"
    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS, v2))
    monkeypatch.setattr(schema, "SCHEMA_VERSION", _NOW + 1)
    monkeypatch.setattr(store_db, "SCHEMA_VERSION", _NOW + 1)


def test_older_inputs_go_through_the_upgrade_step(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    old = node_db(tmp_path / "v1.db", "gpu-01")
    before = sha(old)
    _v2(monkeypatch)
    calls: list[str] = []

    def v1_to_v2(conn: sqlite3.Connection, schema_name: str,
                 layout: dict[str, str]) -> dict[str, str]:
        calls.append(schema_name)
        conn.execute(f"CREATE TEMP VIEW {schema_name}_v2_event_data AS "
                     f"SELECT *, -1 AS cpu FROM {layout['event_data']}")
        return {**layout, "event_data": f"temp.{schema_name}_v2_event_data"}

    with pytest.raises(StoreError,
                       match=f"cannot be converted: no upgrade from version {_NOW}"):
        merge([old], tmp_path / "none.db")
    monkeypatch.setattr(merge_mod, "UPGRADES", {**merge_mod.UPGRADES, _NOW: v1_to_v2})
    out = tmp_path / "v2.db"
    merge([old], out)
    assert calls == ["main", "src"]  # identity read, then the copy, both converted
    with sqlite3.connect(out) as c:
        assert c.execute("PRAGMA user_version").fetchone() == (_NOW + 1,)
        assert c.execute("SELECT DISTINCT cpu FROM event_data").fetchall() == [(-1,)]
        assert c.execute("SELECT count(*) FROM event_data").fetchone() == (200,)
    assert sha(old) == before


@pytest.mark.parametrize("content", [b"not a database at all, just text" * 100, b""])
def test_unreadable_inputs_are_refused(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(content)
    with pytest.raises(StoreError):
        merge([bad], tmp_path / "out.db")
    assert not (tmp_path / "out.db").exists()


def test_a_truncated_input_fails_cleanly(tmp_path: Path) -> None:
    good = node_db(tmp_path / "a.db", "gpu-01", 3000)
    cut = tmp_path / "cut.db"
    data = good.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    out = tmp_path / "cluster.db"
    merge([good], out)
    before = sha(out)
    with pytest.raises(StoreError) as exc:
        merge([cut], out, [f"{cut}=gpu-02"])
    assert "cut.db" in exc.value.message
    assert sha(out) == before  # the old output is untouched
    assert sorted(p.name for p in tmp_path.iterdir() if ".merging" in p.name) == []


def test_foreign_and_missing_inputs(tmp_path: Path) -> None:
    foreign = tmp_path / "other.db"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE t (x)")
    with pytest.raises(StoreError, match="not a fleetd one"):
        merge([foreign], tmp_path / "out.db")
    with pytest.raises(StoreError, match="does not exist"):
        merge([tmp_path / "missing.db"], tmp_path / "out.db")
    a = node_db(tmp_path / "a.db", "gpu-01")
    with pytest.raises(UsageError, match="is also the output"):
        merge([a], a)


def test_output_over_a_wal_file_replaces_it_cleanly(tmp_path: Path, three: list[Path]) -> None:
    out = tmp_path / "cluster.db"
    merge(three[:1], out)
    conn = open_writer(out)  # leaves the output in WAL mode with sidecars
    conn.execute("INSERT INTO meta(key, value) VALUES ('note', 'kept')")
    merge(three[1:], out)
    conn.close()
    with sqlite3.connect(out) as c:
        assert c.execute("SELECT value FROM meta WHERE key='note'").fetchone() == ("kept",)
        assert c.execute("SELECT count(DISTINCT node) FROM events").fetchone() == (3,)
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_progress_is_reported(tmp_path: Path, three: list[Path]) -> None:
    seen: list[merge_mod.Progress] = []
    merge(three, tmp_path / "cluster.db", progress=seen.append)
    assert {p.index for p in seen} == {1, 2, 3}
    last = [p for p in seen if p.index == 3][-1]
    assert last.done == last.total == 300


# ---- clock comparison ---------------------------------------------------------------


def _clock(name: str, error: int | None, first: int, last: int,
           samples: list[tuple[int, int, int]] | None = None) -> NodeClock:
    # One boot per node: nodes of one boot share a clock (tests/unit/test_clock_alignment.py).
    sessions = [SessionClock(1, f"boot-{name}", first, last, 0, error, samples or [])]
    return NodeClock(name, f"{name}.db", sessions if error is not None else [], first, last)


def test_clock_warnings() -> None:
    ok = [_clock("a", 1 * MS, T0, T0 + 10**9), _clock("b", 2 * MS, T0 + 5, T0 + 10**9)]
    assert clock_warnings(ok, 10 * MS) == []
    loose = [_clock("a", 8 * MS, T0, T0 + 10**9), _clock("b", 6 * MS, T0, T0 + 10**9),
             _clock("c", 1 * MS, T0, T0 + 10**9)]
    [w] = clock_warnings(loose, 10 * MS)
    assert "'a' (clock error ±8.0 ms) and 'b' (±6.0 ms)" in w and "±14.0 ms" in w
    apart = [_clock("a", 1 * MS, T0, T0 + 10**9), _clock("b", 1 * MS, T0 + 7200 * 10**9,
                                                         T0 + 7201 * 10**9)]
    [w] = clock_warnings(apart, 10 * MS)
    assert "do not overlap" in w and "2.0 h later" in w
    stepped = _clock("a", 1 * MS, T0, T0 + 10**9,
                     [(10**12, 5, 100), (10**12 + 10**9, 5 + 30 * MS, 100)])
    [w] = clock_warnings([stepped], 10 * MS)
    assert "moved 30.0 ms" in w and "NTP step" in w
    unknown = [_clock("a", None, T0, T0 + 1), _clock("b", 1 * MS, T0, T0 + 1)]
    [w] = clock_warnings(unknown, 10 * MS)
    assert "'a'" in w and "no clock information" in w


def test_merge_warns_about_clocks(tmp_path: Path) -> None:
    a = node_db(tmp_path / "a.db", "gpu-01", error_ns=9 * MS)
    b = node_db(tmp_path / "b.db", "gpu-02", error_ns=4 * MS)
    report = merge([a, b], tmp_path / "out.db", clock_threshold_ns=10 * MS)
    assert len(report.warnings) == 1 and "±13.0 ms" in report.warnings[0]
    assert merge([a, b], tmp_path / "out2.db", clock_threshold_ns=20 * MS).warnings == []


def test_temp_file_is_beside_the_output(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "cluster.db"
    assert merge_mod._temp_path(out).parent == out.parent
    assert merge_mod._temp_path(out).name == f".cluster.db.{os.getpid()}.merging"


def test_a_database_still_being_written_is_read_with_its_wal(tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    w = BatchWriter(path, "gpu-live")
    try:
        w.add_events(synthetic_events(120, t0=T0))
        assert w.flush()
        assert Path(f"{path}-wal").stat().st_size > 0  # the rows are only in the WAL yet
        report = merge([path], tmp_path / "cluster.db")
        assert report.inputs[0].added["events"] == 120
    finally:
        w.close()
