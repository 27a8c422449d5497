"""A chain's lost share is the per-thread breakdown's figure for the same reason.

Every rule that says "lost X% of its time" to a lock, to waiting for data, to the run
queue, to D state or to interrupts reads X from the breakdown's column for that reason
and thread (chains.REASON_COLUMN), the complete accounting of the thread's waits; the
records the rule reads itself (sampled calls, the waits whose waker is known) only say
who caused it. Checked on every recording in the repository, and on the shape that
broke it: an interpreter lock whose waits mostly end by their timeout, woken by
whatever task the timer interrupted.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from synth import KWORKER, MAIN, MAIN_TID, MS, US, Timeline, base, training_loop

from fleetd.analyze.causes.chains import REASON_COLUMN, severity
from fleetd.analyze.explain import explain
from fleetd.store.catalog import op_code
from fleetd.store.syscalls import NR

from conftest import REPO

# investigations/scenarios is tests/data/scenarios (a link): each file once.
RECORDINGS = sorted({p.resolve() for p in (*REPO.glob("tests/data/scenarios/*.db"),
                                            *REPO.glob("investigations/scenarios/*.db"),
                                            *REPO.glob("investigations/fleet/*.db"),
                                            *REPO.glob("investigations/gpu/*.db"))})
TOLERANCE = 0.02  # two points of wall time


def _threads(report: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(p["node"], int(t["tid"])): t for p in report["processes"] for t in p["threads"]}


def check_shares(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Assert every chain of a wait reason states its thread's breakdown column, prints
    that figure, is as severe as that share makes it, and is the only chain of its
    thread and column; returns those chains."""
    threads = _threads(report)
    seen: set[tuple[str, int, str]] = set()
    stated = []
    for c in report["chains"]:
        if c["root_cause"] not in REASON_COLUMN:
            continue
        col = c["detail"]["share_of"]
        t = threads[(c["node"], int(c["victim"]["tid"]))]
        # A lock_wait chain also states the time its thread spun for the lock (the
        # lock_spin column, from on-CPU samples): its impact is the sum of both.
        parts = [int(t[f"{k}_ns"]) / int(t["wall_ns"])
                 for k in (col, *c["detail"].get("share_also", []))]
        want = sum(parts)
        assert abs(float(c["impact"]) - want) <= TOLERANCE, (c["summary"], col, want)
        assert abs(c["detail"]["share"] + c["detail"].get("lock_spin_share", 0.0)
                   - c["impact"]) <= 1e-4
        # The figures printed are the ones the breakdown table prints for those columns.
        for part in parts:
            assert f"{part:.1%}" in c["summary"], (c["summary"], col, part)
        assert c["severity"] == severity(float(c["explained"]), float(c["impact"])), c
        key = (c["node"], int(c["victim"]["tid"]), col)
        assert key not in seen, f"two chains state the {col} time of one thread: {key}"
        seen.add(key)
        stated.append(c)
    return stated


@pytest.mark.parametrize("db", RECORDINGS,
                         ids=[str(p.relative_to(REPO.resolve())) for p in RECORDINGS])
def test_every_recording_states_the_breakdowns_share(db: Path) -> None:
    report = explain(db)
    stated = check_shares(report)
    if db.stem in ("cpu_hog", "dataloader", "block_io", "lock_wait", "gil_contention",
                   "data_starvation"):
        assert stated, [c["summary"] for c in report["chains"]]


# ---- the interpreter lock, waited for with a timeout --------------------------------

HOLDER = MAIN_TID + 1  # the busy Python thread of the same process
BYSTANDERS = (4000, 4100)  # processes the timer interrupted when a wait timed out
GIL = 0x7F00_0000_06F0
FUTEX = NR["futex"] + 1  # the syscall an off-CPU record slept in, + 1


def _gil_timeline(path: Path, released_every: int,
                  others: tuple[int, ...] = (*BYSTANDERS, 0)) -> Path:
    """The feeding thread waits 4 ms for the lock each step; one wait in
    ``released_every`` ends by the holder's release, every other by its timeout (woken
    in turn by ``others``: bystander processes, or nobody the tracer saw); 0: never by
    a release."""
    tl = Timeline()
    base(tl)
    tl.process(BYSTANDERS[0], "xz", 1)
    tl.process(BYSTANDERS[1], "kworker/1:2", 2)
    tl.task_rows.append((HOLDER, MAIN, "py-busy"))
    off, wakeup = op_code("off_cpu"), op_code("wakeup")

    def gil(tl: Timeline, step: int, t: int) -> int:
        dur = 4 * MS
        tl.events.append((t, dur, MAIN, MAIN_TID, off, FUTEX, GIL, HOLDER, 1, 0, 0))
        tl._h(t, MAIN, off, dur)
        if released_every and step % released_every == 0:
            waker = HOLDER
        else:
            waker = others[step % len(others)]
        if waker:
            tl.events.append((t + dur - 10 * US, 0, MAIN, MAIN_TID, wakeup, 0, 0, waker, 0, 0,
                              0))
        if step % 50 == 0:  # the holder runs throughout: preempted now and then
            tl.off_cpu(t + 1 * MS, 60 * US, 0, KWORKER, tid=HOLDER, pid=MAIN)
        return t + dur

    training_loop(tl, hook=gil)
    return tl.write(path)


def _lock_chain(report: dict[str, Any]) -> dict[str, Any]:
    [c] = [c for c in report["chains"] if c["root_cause"] == "lock_contention"]
    return c


@pytest.mark.parametrize("released_every", [5, 0], ids=["some-released", "none-released"])
def test_a_lock_waited_for_with_timeouts_states_all_of_its_time(
        tmp_path: Path, released_every: int) -> None:
    """Most waits end by their timeout: the chain still states the thread's whole lock
    time (the issue's case said 1.3% against the breakdown's 94.5%), is HIGH, and names
    the thread that holds the lock, never a task the timer happened to interrupt."""
    report = explain(_gil_timeline(tmp_path / "gil.db", released_every))
    c = _lock_chain(report)
    check_shares(report)
    feeder = _threads(report)[("gpu-01", MAIN_TID)]
    assert feeder["lock_ns"] / feeder["wall_ns"] > 0.3
    assert abs(c["impact"] - feeder["lock_ns"] / feeder["wall_ns"]) < 1e-6
    assert c["severity"] == "HIGH" and c["detail"]["gil"] is True
    assert c["explained"] == 1.0  # every wait sits on the one lock
    assert (c["culprit"]["pid"], c["culprit"]["tid"]) == (MAIN, HOLDER)
    assert not {p["pid"] for p in c["culprits"]} & set(BYSTANDERS)
    assert c["detail"]["holder_inferred"] is (released_every == 0)
    assert "py-busy" in c["summary"] and f"{c['impact']:.1%}" in c["summary"]
    # Evidence: waits the holder ended first; no bystander is called the waker.
    waits = [e for e in c["evidence"] if e["kind"] == "off_cpu"]
    assert waits and all((e.get("culprit") or {}).get("tid") in (None, HOLDER) for e in waits)


def test_a_lock_another_process_releases_is_not_the_interpreter_lock(tmp_path: Path) -> None:
    """Every wait ended by the same other process: a lock shared with it (a
    multiprocessing lock), which no thread of the process holds: no lock_contention
    chain, whoever else in the process was busy."""
    report = explain(_gil_timeline(tmp_path / "shared.db", 0, (BYSTANDERS[0],)))
    assert not [c for c in report["chains"] if c["root_cause"] == "lock_contention"]
    check_shares(report)


def test_a_lock_with_no_holder_of_its_own_process_makes_no_lock_chain(tmp_path: Path) -> None:
    """Futex waits no thread of the process ever ended, on a lock that is not the
    interpreter's (a process that is not Python): nobody to name, no chain."""
    path = _gil_timeline(tmp_path / "gil.db", 0)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE process_data SET comm = 'trainer' WHERE pid = ?", (MAIN,))
    report = explain(path)
    assert not [c for c in report["chains"] if c["root_cause"] == "lock_contention"]
    check_shares(report)
