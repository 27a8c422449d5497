"""Op statistics' reads of stored rows, on recordings written through the store's
writer: the exact durations of chosen (pid, op) groups, read keyed by one packed integer
where that is exact and by (pid, op) where it is not, and the syscalls' counts,
failures and durations."""

from __future__ import annotations

import random
from pathlib import Path

from synth import MAIN, MAIN_TID, MS, T0, US

from fleetd.analyze.pernode.opstats import EVENTS, _durations, _load_syscalls
from fleetd.analyze.reading.data import nodes
from fleetd.analyze.reading.window import resolve_window
from fleetd.store.catalog import op_code
from fleetd.store.db import open_reader
from fleetd.store.syscalls import NR
from fleetd.store.writer import BatchWriter

OTHER = 4242
HUGE = 1 << 52  # a pid the packed key cannot hold: read by (pid, op)
SYNC, COPY, SYSCALL = op_code("cudaStreamSynchronize"), op_code("cudaMemcpy"), op_code("syscall")


def _recording(path: Path) -> tuple[Path, dict[tuple[int, int], list[int]]]:
    """Calls of three processes, in no order of duration; what each group holds."""
    rng = random.Random(3)
    events, want = [], {}
    for pid in (MAIN, OTHER, HUGE):
        for op in (SYNC, COPY):
            durs = [rng.randrange(1, 50) * US for _ in range(40)]
            want[(pid, op)] = sorted(durs)
            events += [(T0 + i * MS + pid % 7 * US, d, pid, pid, op, 0, 0, 0, 0, 0, 0)
                       for i, d in enumerate(durs)]
    events.sort()
    with BatchWriter(path, "gpu-01") as w:
        w.add_processes([{"pid": p, "comm": "python3", "ppid": 1} for p in (MAIN, OTHER, HUGE)])
        w.add_events(events)  # type: ignore[arg-type]
    return path, want


def test_exact_durations_packed_or_not(tmp_path: Path) -> None:
    path, want = _recording(tmp_path / "a.db")
    conn = open_reader(path)
    try:
        win, node = resolve_window(conn), nodes(conn)[0]
        packed = _durations(conn, node, win, None, EVENTS, {(MAIN, SYNC), (OTHER, COPY)})
        plain = _durations(conn, node, win, None, EVENTS, {(MAIN, SYNC), (HUGE, COPY)})
        one = _durations(conn, node, win, OTHER, EVENTS, {(OTHER, SYNC), (OTHER, COPY)})
    finally:
        conn.close()
    assert dict(packed) == {k: want[k] for k in ((MAIN, SYNC), (OTHER, COPY))}
    assert dict(plain) == {k: want[k] for k in ((MAIN, SYNC), (HUGE, COPY))}
    assert dict(one) == {k: want[k] for k in ((OTHER, SYNC), (OTHER, COPY))}


def test_syscalls_counts_failures_and_durations(tmp_path: Path) -> None:
    calls = [(NR["read"], 30 * US, 4096), (NR["read"], 10 * US, -11), (NR["read"], 20 * US, 0),
             (NR["futex"], 5 * US, -110), (NR["futex"], 7 * US, -110)]
    events = [(T0 + i * MS, dur, MAIN, MAIN_TID, SYSCALL, ret, 0, 0, nr, 0, 0)
              for i, (nr, dur, ret) in enumerate(calls)]
    with BatchWriter(tmp_path / "s.db", "gpu-01") as w:
        w.add_processes([{"pid": MAIN, "comm": "python3", "ppid": 1}])
        w.add_events(events)  # type: ignore[arg-type]
    conn = open_reader(tmp_path / "s.db")
    try:
        groups, durs = _load_syscalls(conn, nodes(conn)[0], resolve_window(conn), None)
    finally:
        conn.close()
    read, futex = groups[(MAIN, NR["read"])], groups[(MAIN, NR["futex"])]
    assert (read.count, read.total, read.top, read.errors) == (3, 60 * US, 30 * US, 1)
    assert (futex.count, futex.errors) == (2, 2)
    assert durs[(MAIN, NR["read"])] == [10 * US, 20 * US, 30 * US]
