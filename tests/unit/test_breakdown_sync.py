"""The breakdown's sleeps inside CUDA sync calls and its D-state wait channels, on
recordings written through the store's writer.

A sleep's overlap with its thread's sync calls moves from the sleep's reason to
``gpu_sync``, summed from the last call that began at or before the sleep on, and never
more than the reason holds. The move is made once per reason (the sum of its sleeps'
overlaps, clamped once), which must equal the clamp applied sleep by sleep in time
order: checked against a brute-force model of that on random calls and sleeps (nested
calls, equal starts, empty calls, sleeps that overlap each other, reasons at or below
zero).
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

from synth import MAIN, MAIN_TID, MS, T0, US

from fleetd.analyze.pernode.breakdown import _move_to_sync, _wait_channels
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.data import nodes
from fleetd.analyze.reading.waits import REASONS, reason
from fleetd.analyze.reading.window import resolve_window
from fleetd.store.catalog import op_code
from fleetd.store.db import open_reader
from fleetd.store.syscalls import NR
from fleetd.store.writer import BatchWriter

SLEEP_S = 1  # scheduler state of an interruptible sleep (a0 & 255)
SLEEP_D = 2  # uninterruptible (D state)
FUTEX, NANOSLEEP = NR["futex"] + 1, NR["clock_nanosleep"] + 1  # ret: syscall + 1
WORKER = MAIN_TID + 1


def _event(ts: int, dur: int, op: str, tid: int = MAIN_TID, ret: int = 0,
           a0: int = 0) -> tuple[int, ...]:
    return (ts, dur, MAIN, tid, op_code(op), ret, 0, 0, a0, 0, 0)


def _write(path: Path, events: list[tuple[int, ...]],
           args: list[tuple[int, dict[str, object]]] | None = None) -> Path:
    with BatchWriter(path, "gpu-01") as w:
        w.add_processes([{"pid": MAIN, "comm": "python3", "ppid": 1}])
        w.add_tasks([(MAIN_TID, MAIN, "python3"), (WORKER, MAIN, "loader")])
        w.add_events(events, args or [])  # type: ignore[arg-type]
    return path


def _threads(path: Path) -> dict[int, dict[str, object]]:
    conn = open_reader(path)
    try:
        win = resolve_window(conn)
        sl = NodeSlice(conn, nodes(conn)[0], win)
        return {int(t["tid"]): dict(t) for t in sl.threads}
    finally:
        conn.close()


def test_sleeps_inside_sync_calls_are_gpu_sync(tmp_path: Path) -> None:
    events = [
        # A 5 ms sync with a 3 ms futex sleep inside it: all 3 ms are the device's.
        _event(T0 + 10 * MS, 5 * MS, "cudaStreamSynchronize"),
        _event(T0 + 11 * MS, 3 * MS, "off_cpu", ret=FUTEX, a0=SLEEP_S),
        # A sync that ends 1 ms into a 4 ms timer sleep: 1 ms moves, 3 ms stay timer.
        _event(T0 + 20 * MS, 2 * MS, "cudaDeviceSynchronize"),
        _event(T0 + 21 * MS, 4 * MS, "off_cpu", ret=NANOSLEEP, a0=SLEEP_S),
        # A sleep between calls, and a launch (not a sync) around a sleep: both stay.
        _event(T0 + 30 * MS, 2 * MS, "off_cpu", ret=FUTEX, a0=SLEEP_S),
        _event(T0 + 40 * MS, 3 * MS, "cudaLaunchKernel"),
        _event(T0 + 40 * MS + 100 * US, 2 * MS, "off_cpu", ret=FUTEX, a0=SLEEP_S),
        # A D-state sleep inside a sync is not moved: only sleeps (S) are.
        _event(T0 + 50 * MS, 2 * MS, "cudaStreamSynchronize"),
        _event(T0 + 50 * MS + 100 * US, 1 * MS, "off_cpu", a0=SLEEP_D),
        # Another thread's sleep during the main thread's sync is its own.
        _event(T0 + 10 * MS, 1 * MS, "cudaMemcpy", tid=WORKER),
        _event(T0 + 12 * MS, 2 * MS, "off_cpu", tid=WORKER, ret=FUTEX, a0=SLEEP_S),
    ]
    t = _threads(_write(tmp_path / "a.db", events))
    main, worker = t[MAIN_TID], t[WORKER]
    assert main["gpu_sync_ns"] == 3 * MS + 1 * MS
    assert main["lock_ns"] == 2 * MS + 2 * MS and main["timer_ns"] == 3 * MS
    assert main["d_state_ns"] == 1 * MS
    assert worker["gpu_sync_ns"] == 0 and worker["lock_ns"] == 2 * MS


def test_the_move_never_takes_more_than_the_reason_holds(tmp_path: Path) -> None:
    # A 3 ms futex sleep inside a sync whose last 2.9 ms were run-queue wait (the tail
    # after the wakeup): the lock reason holds 0.1 ms, and only that moves.
    tail = 2900 * US
    events = [
        _event(T0 + 10 * MS, 5 * MS, "cudaStreamSynchronize"),
        _event(T0 + 11 * MS, 3 * MS, "off_cpu", ret=FUTEX, a0=SLEEP_S),
        _event(T0 + 14 * MS - tail, tail, "runq_wait", ret=FUTEX, a0=SLEEP_S),
    ]
    main = _threads(_write(tmp_path / "b.db", events))[MAIN_TID]
    assert main["gpu_sync_ns"] == 100 * US and main["lock_ns"] == 0
    assert main["runq_ns"] == tail


def _one_by_one(a: dict[str, int], calls: list[tuple[int, int]],
                sleeps: list[tuple[int, int, int]]) -> None:
    """The move as first written: sleep by sleep in time order, each clamped to what
    its reason holds then, each summing its overlap with the calls from the last that
    began at or before it (found by a scan here, not a bisection)."""
    for ts, end, ret in sorted(sleeps, key=lambda s: s[0]):
        before = [j for j, (s0, _) in enumerate(calls) if s0 <= ts]
        first = before[-1] if before else 0
        inside = sum(max(0, min(s1, end) - max(s0, ts)) for s0, s1 in calls[first:]
                     if s0 < end)
        if inside:
            why = reason(ret)
            moved = min(inside, max(0, a[f"slept_{why}"]))
            a[f"slept_{why}"] -= moved
            a["slept_gpu_sync"] += moved


def test_moving_each_reasons_sum_once_equals_moving_sleep_by_sleep() -> None:
    rng = random.Random(44)
    rets = [0, FUTEX, NANOSLEEP, NR["read"] + 1, NR["ioctl"] + 1]
    moved_some = clamped = 0
    for _ in range(400):
        calls = []
        for _ in range(rng.randint(1, 12)):
            s0 = rng.randrange(0, 1000)
            calls.append((s0, s0 + rng.choice([0, 5, 40, 200, 600])))
        calls.sort(key=lambda c: c[0])  # stable, as the reader sorts them
        sleeps = []
        for _ in range(rng.randint(1, 12)):
            ts = rng.randrange(0, 1000)
            sleeps.append((ts, ts + rng.choice([1, 30, 150, 500]), rng.choice(rets)))
        start = {f"slept_{r}": rng.choice([-50, 0, 20, 100, 10_000]) for r in REASONS
                 if r != "gpu_sync"}
        want: dict[str, int] = defaultdict(int, start)
        got: dict[str, int] = defaultdict(int, start)
        _one_by_one(want, calls, sleeps)
        rng.shuffle(sleeps)  # the reader hands them over in no particular order
        _move_to_sync(got, calls, sleeps)
        assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}
        moved_some += want["slept_gpu_sync"] > 0
        clamped += any(want[k] == 0 < v for k, v in start.items())
    assert moved_some > 100 and clamped > 20  # the cases were there to be checked


def test_wait_channels_are_the_same_from_either_side(tmp_path: Path) -> None:
    waits = ([(MAIN_TID, "io_schedule", 4 * MS)] * 3 + [(MAIN_TID, "bit_wait_io", 2 * MS)] * 4
             + [(MAIN_TID, "folio_wait_bit", 1 * MS)] * 2
             + [(MAIN_TID, "jbd2_log_wait_commit", 500 * US), (MAIN_TID, None, 10 * MS),
                (WORKER, "bit_wait_io", 3 * MS)])
    events: list[tuple[int, ...]] = []
    args: list[tuple[int, dict[str, object]]] = []
    for i, (tid, wchan, dur) in enumerate(waits):  # D-state sleeps between launches
        events.append(_event(T0 + i * 20 * MS, dur, "off_cpu", tid=tid, a0=SLEEP_D))
        if wchan:
            args.append((len(events) - 1, {"wchan": wchan}))
        events.append(_event(T0 + i * 20 * MS + 15 * MS, 100 * US, "cudaLaunchKernel"))
    path = _write(tmp_path / "c.db", events, args)
    conn = open_reader(path)
    try:
        win, node = resolve_window(conn), nodes(conn)[0]
        walked = _wait_channels(conn, node, win, None, 0)  # args not few: walk the events
        looked_up = _wait_channels(conn, node, win, None, 10**9)  # from the args rows
        only_main = _wait_channels(conn, node, win, MAIN, 10**9)
    finally:
        conn.close()
    assert walked == looked_up == only_main
    assert walked[MAIN_TID] == [  # most time first, three at most
        {"wchan": "io_schedule", "waits": 3, "ns": 12 * MS},
        {"wchan": "bit_wait_io", "waits": 4, "ns": 8 * MS},
        {"wchan": "folio_wait_bit", "waits": 2, "ns": 2 * MS}]
    assert walked[WORKER] == [{"wchan": "bit_wait_io", "waits": 1, "ns": 3 * MS}]


def _statements(path: Path, pid: int | None = None) -> tuple[list[str], dict[int, object]]:
    """The SQL the breakdown ran, and each thread's sleeping time, locks included."""
    conn = open_reader(path)
    ran: list[str] = []
    try:
        sl = NodeSlice(conn, nodes(conn)[0], resolve_window(conn))
        _ = sl.sums, sl.stack_rows  # read before the trace: only the breakdown's own reads count
        conn.set_trace_callback(ran.append)
        threads = sl.threads if pid is None else sl.threads_of(pid)
        return ran, {int(t["tid"]): t["lock_ns"] for t in threads}
    finally:
        conn.close()


def test_reads_the_sums_show_empty_are_skipped(tmp_path: Path) -> None:
    # Launches and futex sleeps, no sync call and no D state: neither the sync calls'
    # walk nor the wait channels' reads are needed (with a pid the sync walk still runs:
    # a thread's tid may have synced in another process).
    quiet = _write(tmp_path / "q.db", [
        _event(T0 + 10 * MS, 3 * MS, "cudaLaunchKernel"),
        _event(T0 + 10 * MS + 100 * US, 2 * MS, "off_cpu", ret=FUTEX, a0=SLEEP_S)])
    ran, lock = _statements(quiet)
    assert lock == {MAIN_TID: 2 * MS}
    assert not [q for q in ran if "a0 & 2 = 0" in q or "event_args" in q]
    ran, _ = _statements(quiet, MAIN)
    assert [q for q in ran if "a0 & 2 = 0" in q] and not [q for q in ran if "event_args" in q]
    syncing = _write(tmp_path / "s.db", [
        _event(T0 + 10 * MS, 3 * MS, "cudaStreamSynchronize"),
        _event(T0 + 10 * MS + 100 * US, 2 * MS, "off_cpu", ret=FUTEX, a0=SLEEP_S),
        _event(T0 + 20 * MS, 1 * MS, "off_cpu", a0=SLEEP_D)])
    ran, lock = _statements(syncing)
    assert lock == {MAIN_TID: 0}
    assert [q for q in ran if "a0 & 2 = 0" in q] and [q for q in ran if "event_args" in q]
