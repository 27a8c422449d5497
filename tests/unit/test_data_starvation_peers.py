"""The data-starvation rule never names another rank of the victim's job as its producer
(issue 27, item 5): waiting for a peer rank is the collective's wait, which collective
arrival reports. A real producer (a DataLoader worker, any process that is not another
rank) is still named.

Built from the real recording tests/data/scenarios/data_starvation.db: python waits for
data from dl-producer (two threads); their pids are read from the recording. Each test
gives those processes the torchrun identity (or NCCL communicator) of the case it checks.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import orjson

from fleetd.analyze.facade import Analysis
from fleetd.analyze.reading.data import job_peers, nodes
from fleetd.analyze.reading.window import resolve_window
from fleetd.store.catalog import op_code
from fleetd.store.db import open_reader
from fleetd.store.merge import merge

from conftest import REPO

RECORDED = REPO / "tests" / "data" / "scenarios" / "data_starvation.db"


def _recorded_pids() -> tuple[int, int, int]:
    """(the feeding python, dl-producer, dl-producer's second thread) of the recording."""
    with sqlite3.connect(f"file:{RECORDED}?mode=ro", uri=True) as c:
        victim = c.execute("SELECT pid FROM process_data WHERE comm = 'python'").fetchone()[0]
        producer, thread = c.execute(
            "SELECT pid, max(tid) FROM task_data WHERE comm = 'dl-producer' AND tid != pid"
        ).fetchone()
    return int(victim), int(producer), int(thread)


VICTIM, PRODUCER, PRODUCER_THREAD = _recorded_pids()
PEER = PEER_TID = max(VICTIM, PRODUCER, PRODUCER_THREAD) + 500  # another rank of the job


def _copy(tmp_path: Path, name: str = "node.db") -> Path:
    db = tmp_path / name
    shutil.copy(RECORDED, db)
    return db


def _rank(db: Path, pid: int, rank: int | None, size: int | None = 2,
          comm: str = "python") -> None:
    with sqlite3.connect(db) as c:
        node = c.execute("SELECT id FROM nodes").fetchone()[0]
        if c.execute("SELECT 1 FROM process_data WHERE pid = ?", (pid,)).fetchone():
            c.execute("UPDATE process_data SET rank = ?, world_size = ? WHERE pid = ?",
                      (rank, size, pid))
        else:
            c.execute("INSERT INTO process_data(node, pid, comm, rank, world_size) "
                      "VALUES (?,?,?,?,?)", (node, pid, comm, rank, size))


def _starvation(db: Path) -> list[dict[str, Any]]:
    conn = open_reader(db)
    try:
        report = Analysis.of(conn).explain()
    finally:
        conn.close()
    return [c for c in report["chains"] if c["root_cause"] == "data_starvation"]


def _culprits(chain: dict[str, Any]) -> set[int]:
    return {int(c["pid"]) for c in chain["culprits"]}


def test_the_recording_names_its_producer() -> None:
    [chain] = _starvation(RECORDED)
    assert chain["victim"]["pid"] == VICTIM and chain["culprit"]["pid"] == PRODUCER


def test_a_peer_rank_is_never_the_producer(tmp_path: Path) -> None:
    db = _copy(tmp_path)
    _rank(db, VICTIM, 0)
    _rank(db, PRODUCER, 1)  # the "producer" is rank 1 of the same job
    assert _starvation(db) == []


def test_a_worker_with_the_victims_rank_is_a_real_producer(tmp_path: Path) -> None:
    # A DataLoader worker inherits its rank's environment (RANK=0 here): not a peer.
    db = _copy(tmp_path)
    _rank(db, VICTIM, 0)
    _rank(db, PRODUCER, 0)
    [chain] = _starvation(db)
    assert chain["culprit"]["pid"] == PRODUCER


def test_another_job_is_not_a_peer(tmp_path: Path) -> None:
    db = _copy(tmp_path)
    _rank(db, VICTIM, 0, size=2)
    _rank(db, PRODUCER, 1, size=4)  # another world size: another job
    [chain] = _starvation(db)
    assert chain["culprit"]["pid"] == PRODUCER


def test_a_rank_waiting_on_a_peer_and_a_producer_names_only_the_producer(
        tmp_path: Path) -> None:
    db = _copy(tmp_path)
    _rank(db, VICTIM, 0)
    _rank(db, PEER, 1)
    wakeup = op_code("wakeup")
    with sqlite3.connect(db) as c:
        node = c.execute("SELECT id FROM nodes").fetchone()[0]
        c.execute("INSERT INTO task_data(node, tid, pid, comm) VALUES (?,?,?,?)",
                  (node, PEER_TID, PEER, "python"))
        # Every other wakeup for data (all by the producer's second thread) now comes
        # from the peer rank.
        n = c.execute("UPDATE event_data SET peer = ? WHERE op = ? AND tid = ? AND peer = ? "
                      "AND id % 2 = 0", (PEER_TID, wakeup, VICTIM, PRODUCER_THREAD)).rowcount
    assert n > 100
    [chain] = _starvation(db)
    assert chain["culprit"]["pid"] == PRODUCER and PEER not in _culprits(chain)
    assert chain["detail"]["producers"] == 1


def test_one_nccl_communicator_makes_peers(tmp_path: Path) -> None:
    # No torchrun identity recorded, but both processes called NCCL on one communicator.
    db = _copy(tmp_path)
    ar = op_code("ncclAllReduce")
    with sqlite3.connect(db) as c:
        t0, t1 = c.execute("SELECT min(ts_ns), max(ts_ns) FROM event_data").fetchone()
        node = c.execute("SELECT id FROM nodes").fetchone()[0]
        top = c.execute("SELECT max(id) FROM event_data").fetchone()[0]
        for i, pid in enumerate((VICTIM, PRODUCER), 1):
            c.execute("INSERT INTO event_data(id, ts_ns, dur_ns, pid, tid, op, ret, bytes, "
                      "peer, a0, a1, stack) VALUES (?,?,?,?,?,?,0,4096,0,0,0,0)",
                      (top + i, (t0 + t1) // 2 + i, 1000, pid, pid, ar))
            c.execute("INSERT INTO event_args(id, args) VALUES (?, ?)",
                      (top + i, orjson.dumps({"comm_hash": "ab" * 8, "rank": i - 1,
                                              "nranks": 2, "seq": 1}).decode()))
    conn = open_reader(db)
    try:
        [n] = nodes(conn)
        assert n.key == node
        assert job_peers(conn, n, resolve_window(conn)) == {
            VICTIM: frozenset({PRODUCER}), PRODUCER: frozenset({VICTIM})}
    finally:
        conn.close()
    assert _starvation(db) == []


def test_a_peer_known_only_to_a_node_of_the_same_boot(tmp_path: Path) -> None:
    # The demo's shape: each node traces its own rank; the file merged from nodes of one
    # machine knows the producer is rank 1 of the job from the other node's process table.
    mine = _copy(tmp_path, "node-1.db")
    other = _copy(tmp_path, "node-2.db")
    _rank(mine, VICTIM, 0)
    with sqlite3.connect(other) as c:
        c.execute("UPDATE nodes SET name = 'node-2', uid = 'another-uid'")
        c.execute("DELETE FROM process_data WHERE pid != ?", (PRODUCER,))
    _rank(other, PRODUCER, 1)
    merged = tmp_path / "cluster.db"
    merge([mine, other], merged)
    chains = [c for c in _starvation(merged) if c["node"] == "rec-01"]
    assert all(c["culprit"]["pid"] != PRODUCER for c in chains), chains
    # On another boot the pids are another machine's: nothing is inferred from them.
    with sqlite3.connect(other) as c:
        c.execute("UPDATE session_data SET boot_id = 'another-boot'")
        c.execute("UPDATE nodes SET uid = 'a-third-uid', name = 'node-3'")
    apart = tmp_path / "apart.db"
    merge([mine, other], apart)
    [chain] = [c for c in _starvation(apart) if c["node"] == "rec-01"]
    assert chain["culprit"]["pid"] == PRODUCER


def _with_job(db: Path) -> None:
    """The recording predates the job column; a file written now has it."""
    with sqlite3.connect(db) as c:
        if "job" not in {r[1] for r in c.execute("PRAGMA table_info(process_data)")}:
            c.execute("ALTER TABLE process_data ADD COLUMN job TEXT")


def _job_only(db: Path, pid: int, ppid: int, size: int = 2, job: str = "j1") -> None:
    """The row the tracer writes for a process it saw only as a waker: its job and world
    size, its parent, no rank (that process is another node's rank, or a worker)."""
    _with_job(db)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE process_data SET rank = NULL, world_size = ?, job = ?, ppid = ? "
                  "WHERE pid = ?", (size, job, ppid, pid))


def test_a_rank_seen_here_only_as_a_waker_is_a_peer(tmp_path: Path) -> None:
    """The demo's node-1: rank 0 is traced here, rank 2 only wakes it (node-3 traces it)."""
    db = _copy(tmp_path)
    _with_job(db)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE process_data SET rank = 0, world_size = 2, job = 'j1' WHERE pid = ?",
                  (VICTIM,))
    _job_only(db, PRODUCER, ppid=1)
    assert _starvation(db) == []


def test_a_worker_of_the_victim_seen_only_as_a_waker_is_still_named(tmp_path: Path) -> None:
    db = _copy(tmp_path)
    _with_job(db)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE process_data SET rank = 0, world_size = 2, job = 'j1' WHERE pid = ?",
                  (VICTIM,))
    _job_only(db, PRODUCER, ppid=VICTIM)  # inherits the rank's environment: its worker
    [chain] = _starvation(db)
    assert chain["culprit"]["pid"] == PRODUCER
