"""What explain reads first, read on two CPUs where a machine has them.

A slice's op statistics (the exact percentiles' durations, the syscalls) and its
per-thread breakdown (the sleeps inside sync calls, the wait channels) are each a few
seconds of fetching rows into Python on a long recording, and neither needs the other:
both add up the shared grouped read, which is read first. Python threads would take
turns at the interpreter lock, so the op statistics are read by a forked child on its
own connection to the file, and handed back pickled (a few hundred rows), while this
process reads the breakdown. Only where it pays: a window of at least
:data:`FORK_FROM_EVENTS` timed events, two CPUs, a file that can be opened again, and
``fork`` (a failed child costs nothing but the time: its part is read here).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sqlite3
from collections.abc import Callable, Sequence

from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.rows import OpRow

FORK_FROM_EVENTS = 1_000_000  # below, a fork and a second connection cost more than saved
Reopen = Callable[[], sqlite3.Connection]


def preload(slices: Sequence[NodeSlice], reopen: Reopen | None = None) -> None:
    """Every slice's :meth:`~NodeSlice.preload`, its op statistics forked off where
    that pays (``reopen`` opens the same file again, read-only)."""
    for sl in slices:
        if reopen is not None and _pays(sl):
            _split(sl, reopen)
        sl.preload()


def _pays(sl: NodeSlice) -> bool:
    if not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2:
        return False
    return sum(s.count for s in sl.sums) >= FORK_FROM_EVENTS


def _split(sl: NodeSlice, reopen: Reopen) -> None:
    """The op statistics in a child, the breakdown here, at the same time."""
    _ = (sl.names, sl.tasks, sl.span, sl.sums, sl.stack_rows)  # shared, read once
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(sl, reopen, write_end)
    os.close(write_end)
    try:
        _ = sl.threads
    finally:
        got = _collect(pid, read_end)
    if got is not None:
        sl.take_ops(*got)


def _child(sl: NodeSlice, reopen: Reopen, out: int) -> None:
    """Read the op statistics on a connection of its own (SQLite's rule: none opened
    before a fork is used after it) and write them pickled; exit without running the
    parent's cleanups."""
    code = 1
    try:
        sl.conn = reopen()
        payload = pickle.dumps((sl.ops, sl.op_stats(None, False)))
        with os.fdopen(out, "wb") as f:
            f.write(payload)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent reads it itself; nothing to say here
        pass
    finally:
        os._exit(code)


def _collect(pid: int, fd: int) -> tuple[list[OpRow], list[OpRow]] | None:
    """The child's answer, or None when it failed (the parent then reads it)."""
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not data:
        return None
    with contextlib.suppress(pickle.UnpicklingError, EOFError, ValueError):
        ops, summed = pickle.loads(data)  # noqa: S301 - our own child's bytes
        return list(ops), list(summed)
    return None
