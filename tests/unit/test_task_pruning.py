"""Thread and process rows pruned once nothing kept names them (#45): real SQLite files
written by the real batch writer under a size cap, its own pruning doing the work.

Task ids here are above the largest pid_max Linux allows (2**22), so no test id is
ever a live task: liveness keeps only the real processes a test names on purpose.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from fleetd.node.api import NodeState
from fleetd.node.metrics import Sources, render
from fleetd.store import schema
from fleetd.store.db import open_writer
from fleetd.store.schema import EventRow
from fleetd.store.writer import BatchWriter

from conftest import old_schema_file

CAP = 4 * 2**20
FAKE = 5_000_000  # above any pid_max: never a live task
OP = 100


def _events(n: int, tid: int, *, pid: int | None = None, peer: int = 0, t0: int = 0
            ) -> list[EventRow]:
    base = t0 or time.time_ns()
    return [(base + i, 1000, pid or tid, tid, OP, 0, 0, peer, i, 0, 0) for i in range(n)]


def _fill(w: BatchWriter, n: int, tid: int = FAKE + 999_999, step: int = 5_000) -> None:
    """``n`` events of one filler thread, committed in steps: the cap prunes the oldest."""
    for _ in range(n // step):
        w.add_events(_events(step, tid))
        w.flush()


def _tids(path: Path) -> set[int]:
    with sqlite3.connect(path) as c:
        return {int(t) for (t,) in c.execute("SELECT tid FROM task_data")}


def _pids(path: Path) -> set[int]:
    with sqlite3.connect(path) as c:
        return {int(p) for (p,) in c.execute("SELECT pid FROM process_data")}


def _oldest_seq(path: Path) -> int:
    with sqlite3.connect(path) as c:
        return int(c.execute("SELECT min(id & 1099511627775) FROM event_data").fetchone()[0])


def _chain(victim: int, culprit: int, evidence_pid: int) -> dict[str, object]:
    return {"key": f"cpu_contention:{victim}", "ts_ns": 1, "dur_ns": 2, "severity": "LOW",
            "root_cause": "cpu_contention", "summary": "s", "op": None,
            "victim_pid": victim, "victim_tid": victim, "victim_comm": "v",
            "culprit_pid": culprit, "culprit_comm": "c", "explained": 0.5, "impact": 0.1,
            "evidence": [{"kind": "off_cpu", "culprit": {"pid": evidence_pid, "comm": "e"}}],
            "fixes": ["f"]}


def test_rows_of_tasks_whose_events_were_pruned_go_and_named_ones_stay(tmp_path: Path
                                                                       ) -> None:
    path = tmp_path / "n.db"
    gone, peer, victim, culprit, witness = (FAKE + k for k in (1, 2, 3, 4, 5))
    rank, parent, worker, holder, live = FAKE + 6, FAKE + 7, FAKE + 8, FAKE + 9, os.getpid()
    member = FAKE + 10
    w = BatchWriter(path, "n1", max_bytes=CAP)
    everyone = (gone, peer, victim, culprit, witness, rank, parent, worker, holder, live,
                member)
    w.add_processes([{"pid": p, "comm": f"p{p}"} for p in everyone if p != rank])
    # The traced job's rank: never pruned, though its events are and it is not alive here.
    w.add_processes([{"pid": rank, "comm": "train", "rank": 0, "world_size": 1}])
    w.add_processes([{"pid": worker, "ppid": parent}])  # a kept child keeps its parent
    w.add_tasks([(p, p, f"t{p}") for p in everyone])
    for p in everyone:
        w.add_events(_events(10, p))
    w.add_chains([_chain(victim, culprit, witness)])  # type: ignore[list-item]
    w.flush()
    first_last = w.next_seq - 1
    _fill(w, 25_000)
    # Named by later events only: the peer of a switch, a worker that runs on, the
    # other end of a pipe an off-CPU record slept on, a member of a sampled cgroup.
    late = w.next_seq
    w.add_events(_events(1, FAKE + 999_999, peer=peer) + _events(5, worker),
                 args=[(0, {"fd": {"path": "pipe:[7]", "kind": "pipe",
                                   "peers": [{"pid": holder, "comm": "h", "mode": "w"}]}}),
                       (1, {"cgroup": "/job", "pids": [worker, member]})])
    while _oldest_seq(path) <= first_last:  # until every event above is pruned
        _fill(w, 1_000, step=1_000)
    assert _oldest_seq(path) <= late  # and the later ones are kept
    stats = w.close()

    tids, pids = _tids(path), _pids(path)
    assert gone not in tids and gone not in pids  # its events all pruned, nothing names it
    assert peer in tids and worker in tids and worker in pids and holder in pids
    assert member in pids
    assert parent in pids and parent not in tids  # the kept worker's parent process stays
    assert {victim, culprit, witness} <= pids and victim in tids  # the chain names them
    assert rank in pids and rank in tids  # the traced job's process, and its thread
    assert live in pids and live in tids  # alive: the tracer would not write it again
    assert (stats.pruned_threads, stats.pruned_processes) == (2, 1)
    assert tids == set(everyone) - {gone, parent} and pids == set(everyone) - {gone}
    # /metrics reports the writer's counts.
    text = render(NodeState(node="n1", tracing=True), Sources(writer=lambda: stats))
    fams = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
            if f.samples}
    assert (fams["fleetd_threads_pruned"], fams["fleetd_processes_pruned"]) == (2, 1)


def test_many_short_lived_tasks_keep_the_rows_bounded(tmp_path: Path) -> None:
    """The soak's shape in small: a busy node starts tasks all the time, each traced
    for a while and then gone; under a cap the thread and process rows stay bounded
    instead of growing by one per task ever met."""
    path = tmp_path / "soak.db"
    w = BatchWriter(path, "n1", max_bytes=CAP)
    counts: list[tuple[int, int]] = []
    made = 0
    for round_ in range(120):
        new = [FAKE + 1_000 + round_ * 50 + k for k in range(50)]
        made += len(new)
        w.add_processes([{"pid": t, "comm": f"sh{t}", "ppid": 1} for t in new])
        w.add_tasks([(t, t, f"sh{t}") for t in new])
        rows: list[EventRow] = []
        for t in new:
            rows += _events(100, t, peer=new[0])
        w.add_events(rows)
        w.flush()
        with sqlite3.connect(path) as c:
            counts.append((c.execute("SELECT count(*) FROM task_data").fetchone()[0],
                           c.execute("SELECT count(*) FROM process_data").fetchone()[0]))
    stats = w.close()
    assert made == 6_000 and stats.pruned_events > 400_000
    late = counts[60:]
    # Bounded: about the kept events' worth of tasks (a cap holds ~40 rounds here),
    # not one row per task met, and no higher at the end than in the middle.
    assert max(t for t, _ in late) < made / 3 and max(p for _, p in late) < made / 3
    assert counts[-1][0] <= max(t for t, _ in counts[40:60]) * 1.2
    assert stats.pruned_threads > made / 2 and stats.pruned_processes > made / 2
    with sqlite3.connect(path) as c:
        # What is left is what the kept events name, give or take one add_events
        # call's tasks (the writer notes the newest id of each call, not of each row).
        oldest = c.execute("SELECT min(id) FROM event_data").fetchone()[0]
        named = {t for (t,) in c.execute("SELECT DISTINCT tid FROM event_data")}
        assert len(_tids(path) - named) <= 50
        # The bookkeeping is bounded too: about one row per named task.
        seen = c.execute("SELECT count(*) FROM task_seen").fetchone()[0]
        assert seen <= len(named) + 100, (seen, len(named))
        assert c.execute("SELECT count(*) FROM task_seen WHERE last_id < ?",
                         (oldest,)).fetchone()[0] == 0


def _version_6_file(path: Path, tasks: list[int]) -> int:
    """A file as fleetd wrote it before schema 7 (no task_seen): a node, its thread and
    process rows and their events. Returns the newest event id."""
    conn = old_schema_file(path, 6)
    base = 1 << schema.SEQ_BITS
    with conn:
        for k, t in enumerate(tasks):
            conn.execute("INSERT INTO task_data(node, tid, pid, comm) VALUES (1, ?, ?, 't')",
                         (t, t))
            conn.execute("INSERT INTO process_data(node, pid, comm) VALUES (1, ?, 'p')", (t,))
            conn.executemany(f"INSERT INTO event_data VALUES ({', '.join('?' * 12)})",
                             [(base + k * 10 + i + 1, *e)
                              for i, e in enumerate(_events(10, t))])
    conn.close()
    return base + len(tasks) * 10


def test_an_old_database_migrates_and_its_rows_are_pruned_later(tmp_path: Path) -> None:
    path = tmp_path / "v6.db"
    old = [FAKE + 1, FAKE + 2, FAKE + 3]
    newest = _version_6_file(path, old)
    conn = open_writer(path)  # migrates: every stored id named as of the newest event
    assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION >= 7
    assert conn.execute("SELECT id, last_id FROM task_seen ORDER BY id").fetchall() == [
        (t, newest) for t in old]
    conn.close()
    w = BatchWriter(path, "old", max_bytes=CAP)
    assert w.next_seq == len(old) * 10 + 1  # the old events are the node's
    _fill(w, 20_000)
    late = w.next_seq
    w.add_events(_events(5, old[0]))  # still traced after the upgrade
    while _oldest_seq(path) <= len(old) * 10:  # until the old file's events are pruned
        _fill(w, 1_000, step=1_000)
    assert _oldest_seq(path) <= late
    stats = w.close()
    assert _tids(path) & set(old) == {old[0]} and _pids(path) & set(old) == {old[0]}
    assert (stats.pruned_threads, stats.pruned_processes) == (2, 2)


def test_a_writer_without_a_cap_notes_nothing_and_one_with_a_cap_catches_up(
        tmp_path: Path) -> None:
    """Noting costs the writer CPU per row, so only a capped writer notes; rows written
    meanwhile are named as of the newest event when a capped writer opens the file."""
    path = tmp_path / "n.db"
    t = FAKE + 1
    with BatchWriter(path, "n1") as w:
        w.add_tasks([(t, t, "x")])
        w.add_events(_events(10, FAKE + 2, peer=t))
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT count(*) FROM task_seen").fetchone()[0] == 0
    with BatchWriter(path, "n1", max_bytes=CAP):
        pass
    with sqlite3.connect(path) as c:
        newest = c.execute("SELECT max(id) FROM event_data").fetchone()[0]
        assert c.execute("SELECT id, last_id FROM task_seen").fetchall() == [(t, newest)]
