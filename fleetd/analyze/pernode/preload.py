"""What explain reads first, read on two CPUs where a machine has them.

A slice's op statistics (the exact percentiles' durations, the syscalls) and its
per-thread breakdown (the sleeps inside sync calls, the wait channels) are each a few
seconds of fetching rows into Python on a long recording, and neither needs the other:
both add up the shared grouped read, which is read first. Python threads would take
turns at the interpreter lock, so the op statistics are read by a forked child on its
own connection to the file, and handed back pickled (a few hundred rows), while this
process reads the breakdown. Only where it pays: a window of at least
:data:`FORK_FROM_EVENTS` timed events, two CPUs, a file that can be opened again, and
``fork`` (a failed child costs nothing but the time: its part is read here). The same
bar starts the rules' walk of the span in a thread (``NodeView.prefetch_calls``): SQLite
steps it without the interpreter lock while the spikes are found.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import pickle
import sqlite3
from collections.abc import Callable, Sequence
from typing import BinaryIO

from fleetd.analyze.causes.rules import dense_plan, gpu_pids
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.nodeview import NodeView
from fleetd.analyze.reading.spanreads import CallRow, CallsRead

PIECE_ROWS = 100_000  # rows per message of the rules' walk
FORK_FROM_EVENTS = 1_000_000  # below, a fork and a second connection cost more than saved
MAP_BYTES = 1 << 32  # SQLite's map of the file (it maps no more than the file holds)
Reopen = Callable[[], sqlite3.Connection]


def preload(slices: Sequence[NodeSlice], reopen: Reopen | None = None) -> None:
    """Every slice's :meth:`~NodeSlice.preload`, its op statistics forked off where
    that pays (``reopen`` opens the same file again, read-only)."""
    for sl in slices:
        big = reopen is not None and pays(sl)
        sl.reopen = _mapped(reopen) if big and reopen is not None else reopen
        if big:
            map_file(sl.conn)
        if sl.reopen is not None and big and hasattr(os, "fork"):
            _split(sl, sl.reopen)
        sl.preload()


def map_file(conn: sqlite3.Connection) -> None:
    """Read the file through a memory map (SQLite's mmap_size) for the big walks: pages
    come from the kernel's cache without a copy each (on the ten-minute file, 0.8 s of
    system time less). Only for a file fleetd reads whole and nobody shrinks (a writer
    never truncates its database), since a file cut short under a map ends the process."""
    conn.execute(f"PRAGMA mmap_size = {MAP_BYTES}")


def _mapped(reopen: Reopen) -> Reopen:
    def opened() -> sqlite3.Connection:
        conn = reopen()
        map_file(conn)
        return conn

    return opened


def pays(sl: NodeSlice) -> bool:
    """Whether reading beside the main line pays for ``sl``: two CPUs to run on and a
    window of at least :data:`FORK_FROM_EVENTS` timed events."""
    if len(os.sched_getaffinity(0)) < 2:
        return False
    return sum(s.count for s in sl.sums) >= FORK_FROM_EVENTS


def _split(sl: NodeSlice, reopen: Reopen) -> None:
    """The op statistics in a child, the breakdown here, at the same time; then the
    child reads the rules' walk of the span (taken when the rules ask for it)."""
    _ = (sl.names, sl.tasks, sl.span, sl.sums, sl.stack_rows)  # shared, read once
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(sl, reopen, write_end)
    os.close(write_end)
    child = _Child(pid, os.fdopen(read_end, "rb"))
    try:
        _ = sl.threads
    finally:
        got = child.message()
    if got is None:
        child.close()
        return
    ops, summed = pickle.loads(got)  # noqa: S301 - our own child's bytes
    sl.take_ops(list(ops), list(summed))
    sl.calls_ahead = child.calls


def _child(sl: NodeSlice, reopen: Reopen, out: int) -> None:
    """Read the op statistics on a connection of its own (SQLite's rule: none opened
    before a fork is used after it) and write them pickled, then the rules' walk of the
    span where a process calls CUDA (marshal: plain values, several times faster than
    pickle for millions of rows); exit without running the parent's cleanups."""
    code = 1
    try:
        sl.conn = reopen()
        with os.fdopen(out, "wb") as f:
            _send(f, pickle.dumps((sl.ops, sl.op_stats(None, False))))
            if gpu_pids(sl.ops):  # the rules read the walk for each of them
                view = NodeView(sl.conn, sl.node, sl.window, sl.tasks, sl.names, sl.sums,
                                sl.stack_rows)
                _send_calls(f, view.calls_read(*dense_plan(sl.span, sl.sums)))
        code = 0
    except BaseException:  # noqa: BLE001 - the parent reads it itself; nothing to say here
        pass
    finally:
        os._exit(code)


def _send_calls(f: BinaryIO, read: CallsRead) -> None:
    """``read`` as marshalled pieces of at most :data:`PIECE_ROWS` rows (the parent
    holds one piece's bytes at a time beside the rows, not a copy of them all): a head
    (span, op sets, sleepers), then (kind, key, thread or process, rows) in each list's order."""
    _send(f, marshal.dumps((read.t0, read.t1, list(read.calls), None if read.sleeps is None
                            else read.sleeps[0])))
    for ops, by_pid in read.calls.items():
        for pid, rows in by_pid.items():
            for i in range(0, max(1, len(rows)), PIECE_ROWS):
                _send(f, marshal.dumps((0, ops, pid, rows[i:i + PIECE_ROWS])))
    for op, by_tid in ({} if read.sleeps is None else read.sleeps[1]).items():
        for tid, rows in by_tid.items():
            for i in range(0, max(1, len(rows)), PIECE_ROWS):
                _send(f, marshal.dumps((1, op, tid, rows[i:i + PIECE_ROWS])))
    _send(f, marshal.dumps((2, None, None, None)))  # the end


def _send(f: BinaryIO, payload: bytes) -> None:
    f.write(len(payload).to_bytes(8, "little"))
    f.write(payload)
    f.flush()


class _Child:
    """The forked reader: its messages in order, then its exit."""

    def __init__(self, pid: int, pipe: BinaryIO) -> None:
        self.pid, self.pipe = pid, pipe

    def message(self) -> bytes | None:
        """The next message, or None once the child ended or failed."""
        head = self.pipe.read(8)
        if len(head) < 8:
            return None
        body = self.pipe.read(int.from_bytes(head, "little"))
        return body if len(body) == int.from_bytes(head, "little") else None

    def calls(self) -> CallsRead | None:
        """The rules' walk of the span (:func:`_send_calls`), as
        :meth:`NodeView.await_calls` takes it; None when the child failed on the way."""
        try:
            head = self.message()
            if head is None:
                return None
            t0, t1, sets, sleepers = marshal.loads(head)
            calls: dict[tuple[int, ...], dict[int, list[CallRow]]] = {ops: {} for ops in sets}
            slept: dict[int, dict[int, list[CallRow]]] = {}
            while (got := self.message()) is not None:
                kind, key, who, rows = marshal.loads(got)
                if kind == 2:
                    return CallsRead(calls, t0, t1, None if sleepers is None
                                     else (sleepers, slept))
                into = calls if kind == 0 else slept
                into.setdefault(key, {}).setdefault(who, []).extend(rows)
            return None
        except (ValueError, EOFError, TypeError):
            return None
        finally:
            self.close()

    def close(self) -> None:
        self.pipe.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
