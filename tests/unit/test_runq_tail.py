"""Who held the CPU while a woken thread waited for it: not only the task that handed it
back. A kernel thread (rcu_preempt, a kworker) preempts a busy loop for microseconds and
the scheduler then picks the woken thread, so the loop that held the CPU for the whole
wait is never the switch's prev. The demo's node-3 (its rank and a hog in one CPU share)
named rcu_preempt, then another process of the machine, never the hog.

Built from the real recording tests/data/scenarios/cpu_hog.db (a workload and cpu-hog on
one CPU): every run-queue tail there was ended by the hog; rewritten so that a bystander
ends each one, the hog must stay the culprit.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

from fleetd.analyze.facade import Analysis
from fleetd.analyze.reading.nodeview import MAX_SLEEP_BEFORE_TAIL_NS, tail_takers
from fleetd.store.catalog import op_code
from fleetd.store.db import open_reader

from conftest import REPO

RECORDED = REPO / "tests" / "data" / "scenarios" / "cpu_hog.db"
HOG, BYSTANDER = 28904, 15


def test_a_short_sleeps_tail_is_shared_with_who_took_the_cpu() -> None:
    assert tail_takers(10, 21, 8_000_000, 15, 1_000_001) == [(21, 500_001), (15, 500_000)]
    assert tail_takers(10, 21, 8_000_000, 21, 1_000_000) == [(21, 1_000_000)]
    # Idle when it slept (no task took the CPU), or a long sleep: the prev alone.
    assert tail_takers(10, 0, 8_000_000, 15, 1_000_000) == [(15, 1_000_000)]
    assert tail_takers(10, 21, MAX_SLEEP_BEFORE_TAIL_NS + 1, 15, 1_000_000) == \
        [(15, 1_000_000)]


def _culprits(db: Path) -> list[dict[str, Any]]:
    conn = open_reader(db)
    try:
        report = Analysis.of(conn).explain()
    finally:
        conn.close()
    chains = [c for c in report["chains"] if c["root_cause"] == "cpu_contention"]
    assert len(chains) == 1, [c["summary"] for c in report["chains"]]
    return list(chains[0]["culprits"])


def test_the_hog_stays_the_culprit_when_bystanders_end_the_waits(tmp_path: Path) -> None:
    db = tmp_path / "bystander.db"
    shutil.copy(RECORDED, db)
    with sqlite3.connect(db) as c:
        tails = c.execute("UPDATE event_data SET a1 = ? WHERE op = ? AND a1 = ?",
                          (BYSTANDER, op_code("runq_wait"), HOG)).rowcount
        c.execute("INSERT INTO task_data (node, tid, pid, comm) VALUES (1, ?, NULL, "
                  "'rcu_preempt')", (BYSTANDER,))
    assert tails > 100
    culprits = _culprits(db)
    assert culprits[0]["pid"] == HOG and culprits[0]["comm"] == "cpu-hog", culprits[:3]
    # Each wait is shared by its two ends, the hog's at least as much as the bystander.
    bystander = next(c for c in culprits if c["pid"] == BYSTANDER)
    assert culprits[0]["share"] >= bystander["share"] > 0.3, culprits[:3]


def test_a_task_that_took_the_cpu_once_is_not_credited(tmp_path: Path) -> None:
    # The same recording with the off-CPU waits handed to three tasks in turn: none of
    # them takes over at most switches, so none was on the CPU all along; the tails go
    # to the task that ran last (the bystander here) as before.
    db = tmp_path / "rotating.db"
    shutil.copy(RECORDED, db)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE event_data SET a1 = ? WHERE op = ? AND a1 = ?",
                  (BYSTANDER, op_code("runq_wait"), HOG))
        c.execute("UPDATE event_data SET peer = 100 + id % 3 WHERE op = ? AND peer = ?",
                  (op_code("off_cpu"), HOG))
        c.execute("INSERT INTO task_data (node, tid, pid, comm) VALUES (1, ?, NULL, "
                  "'rcu_preempt')", (BYSTANDER,))
    culprits = _culprits(db)
    assert culprits[0]["pid"] == BYSTANDER, culprits[:3]
    assert not any(c["pid"] in (100, 101, 102) and c["share"] > 0.05 for c in culprits)


def test_a_prev_that_woke_the_thread_held_the_cpu_all_along() -> None:
    assert tail_takers(10, 21, 8_000_000, 15, 1_000_000, waker=15) == [(15, 1_000_000)]
    assert tail_takers(10, 21, 8_000_000, 15, 1_000_001, waker=33) == \
        [(21, 500_001), (15, 500_000)]


def test_the_waker_that_handed_the_cpu_over_is_the_culprit_not_who_took_it_at_the_sleep(
        tmp_path: Path) -> None:
    # gil_light under busy-node.sh: an idle-priority loop takes the CPU whenever the
    # feeding thread sleeps for the interpreter lock, and is preempted at once when the
    # lock holder (a thread of the same process, on the same CPU) wakes to release it;
    # the holder wakes the feeder and runs until it hands the CPU over. Half of each
    # tail went to the loop, which had not run since. Here the recorded tails are
    # rewritten so that one task both woke the thread and ran until it got the CPU.
    holder = 777
    db = tmp_path / "holder.db"
    shutil.copy(RECORDED, db)
    with sqlite3.connect(db) as c:
        tails = c.execute("UPDATE event_data SET a1 = ?, peer = ? WHERE op = ? AND a1 = ?",
                          (holder, holder, op_code("runq_wait"), HOG)).rowcount
        c.execute("INSERT INTO task_data (node, tid, pid, comm) VALUES (1, ?, NULL, "
                  "'py-busy')", (holder,))
    assert tails > 100
    # The holder gets the tails' time; the hog keeps only the preemptions it made itself
    # (1%), not half of every tail (it still took over at the switches: its presence).
    share = {c["pid"]: c["share"] for c in _culprits(db)}
    assert share[holder] > 0.9 and share[HOG] < 0.05, share
