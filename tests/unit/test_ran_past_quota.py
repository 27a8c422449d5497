"""A limit cut below what the rank ran is told from a busy neighbour inside an unchanged
quota (#43, ``fleetd.analyze.causes.throttle.ran_past_quota``).

The thread's CPU time per second is inferred from its off-CPU records, which a loaded
node can thin out (lost records, sleeps under the tracer's 50 us threshold): the fresh
clone's CI saw a rank under a constant 0.2-CPU quota, a hog beside it, called over the
quota and its hog dropped for ``cpu_throttled``. The cgroup's own samples say whether
the limit was ever higher; only those seconds count. Each recording is built here
through the store's writer: a thread's off-CPU records every 10 ms and the cgroup's
``cpu_throttle`` sample every second, as the tracer writes them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fleetd.analyze.causes.rules import Context
from fleetd.analyze.causes.throttle import Quota, ran_past_quota
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.data import nodes
from fleetd.analyze.reading.nodeview import NodeView
from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import op_code
from fleetd.store.db import open_reader
from fleetd.store.writer import BatchWriter

T0 = 1_750_000_000 * 10**9
S, MS = 10**9, 10**6
PID = 1000
CGROUP = "/kubepods/pod1/rank"
SECONDS = 40
WINDOW_FROM = 30  # the window is the last 10 s; the 30 s before it are the lookback


def _record(path: Path, ran: Callable[[int], float], limit: Callable[[int], float | None],
            lost: Callable[[int], bool] = lambda s: False) -> Path:
    """A thread that runs ``ran(s)`` CPU in second ``s`` (off the CPU the rest of each
    10 ms), 99 in 100 of its records lost in the seconds ``lost`` says, under the limit
    ``limit(s)`` (None: no limit, so no sample)."""
    events: list[tuple[int, ...]] = []
    args: list[tuple[int, dict[str, object]]] = []
    for s in range(SECONDS):
        for k in range(1 if lost(s) else 100):
            at = T0 + s * S + k * 10 * MS
            off = round(10 * MS * (1 - ran(s)))
            events.append((at, off, PID, PID, op_code("off_cpu"), 0, 0, 0, 1, 0, 0))
        cpus = limit(s)
        if cpus is not None:
            args.append((len(events), {"cgroup": CGROUP, "quota_us": round(cpus * 100_000),
                                       "period_us": 100_000, "pids": [PID]}))
            events.append((T0 + s * S, S, PID, PID, op_code("cpu_throttle"), 0,
                           0, 0, 0, 10, 0))
    order = sorted(range(len(events)), key=lambda i: events[i][0])
    where = {old: new for new, old in enumerate(order)}
    with BatchWriter(path, "gpu-01") as w:
        w.add_processes([{"pid": PID, "comm": "python", "ppid": None}])
        w.add_tasks([(PID, PID, "python")])
        w.add_events([events[i] for i in order],  # type: ignore[misc]
                     [(where[i], a) for i, a in args])
    return path


def _ran_past(path: Path, cpus: float) -> bool:
    conn = open_reader(path)
    try:
        win = Window(T0 + WINDOW_FROM * S, T0 + SECONDS * S, "test")
        sl = NodeSlice(conn, nodes(conn)[0], win)
        view = NodeView(sl.conn, sl.node, win, sl.tasks, sl.names)
        ctx = Context(view, sl.span, sl.ops, sl.threads, sl.parents)
        return ran_past_quota(ctx, PID, Quota(CGROUP, round(cpus * 100_000), 100_000))
    finally:
        conn.close()


def test_a_limit_cut_below_what_the_thread_ran_is_the_cause(tmp_path: Path) -> None:
    # 0.25 CPU under a 0.9 limit until second 25, then 0.03 under a 0.03 limit.
    db = _record(tmp_path / "cut.db", lambda s: 0.25 if s < 25 else 0.03,
                 lambda s: 0.9 if s < 25 else 0.03)
    assert _ran_past(db, 0.03)


def test_a_limit_set_where_there_was_none_is_the_cause(tmp_path: Path) -> None:
    db = _record(tmp_path / "set.db", lambda s: 0.25 if s < 25 else 0.03,
                 lambda s: None if s < 25 else 0.03)
    assert _ran_past(db, 0.03)


def test_seconds_of_lost_records_under_an_unchanged_quota_are_not_a_cut(
        tmp_path: Path) -> None:
    # Under a constant 0.2 quota the thread runs 0.1; in 4 seconds of the lookback most of
    # its off-CPU records were lost (kept: one in a hundred), so those seconds look like
    # nearly a whole CPU run. The cgroup's samples say 0.2 all along: no cut.
    ran = lambda s: 0.1  # noqa: E731
    thin = _record(tmp_path / "thin.db", ran, lambda s: 0.2, lambda s: 10 <= s < 14)
    assert not _ran_past(thin, 0.2)
    # The same seconds under a limit that was 0.9 then are a cut: the rule itself would
    # count them (the inference is what the samples guard).
    assert _ran_past(_record(tmp_path / "was.db", ran, lambda s: 0.9 if s < 20 else 0.2,
                             lambda s: 10 <= s < 14), 0.2)


def test_the_seconds_before_the_sampler_first_looked_are_not_unlimited(
        tmp_path: Path) -> None:
    # The sampler's first sample of a cgroup starts at its first look: the first second
    # or two of a trace have records but no sample. Lost records there are no cut either.
    db = _record(tmp_path / "start.db", lambda s: 0.1, lambda s: None if s < 2 else 0.2,
                 lambda s: s < 2)
    assert not _ran_past(db, 0.2)
