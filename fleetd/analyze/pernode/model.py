"""The per-node model every analyzer reads: one node of a database over one window.

A request (``fleetd explain``, a node API call, an MCP tool) resolves its window once
and builds one :class:`NodeSlice` per node. The slice loads what several analyzers
need (process and thread names, the span the node has data for, per-process op
statistics, the per-thread time breakdown) on first use and keeps it, so explain,
profile, overview, graphs and stacks over the same slice read each of them once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from functools import cached_property

from fleetd.analyze.pernode.breakdown import process_rows, thread_breakdown
from fleetd.analyze.pernode.opstats import Loaded, load_op_stats, node_kernel_stats, node_op_stats
from fleetd.analyze.reading.data import Node, comms, effective_span, tasks
from fleetd.analyze.reading.profile import StackRow, stack_rows
from fleetd.analyze.reading.rows import KernelOpRow, OpRow, ProcessRow, ThreadRow
from fleetd.analyze.reading.spanreads import CallsRead
from fleetd.analyze.reading.sums import Sum, event_sums
from fleetd.analyze.reading.window import Window
from fleetd.store.summaries import SecRun, summed_runs


class NodeSlice:
    """One node's data in a window; each part is computed once, when first asked for."""

    def __init__(self, conn: sqlite3.Connection, node: Node, window: Window) -> None:
        self.conn = conn
        self.node = node
        self.window = window
        self._summed_ops: list[OpRow] | None = None  # op_stats(None, False), read elsewhere
        # Opens the same file again (fleetd.analyze.pernode.preload): where set, reads
        # that pay for it run beside others on a connection of their own.
        self.reopen: Callable[[], sqlite3.Connection] | None = None
        # The rules' walk of the span, read by that child (NodeView.await_calls).
        self.calls_ahead: Callable[[], CallsRead | None] | None = None

    @property
    def name(self) -> str:
        return self.node.name

    @cached_property
    def _comms(self) -> tuple[dict[int, str], dict[int, int]]:
        return comms(self.conn, self.node)

    @property
    def names(self) -> dict[int, str]:
        """pid -> process name (the tracer's own pid marked as such)."""
        return self._comms[0]

    @property
    def parents(self) -> dict[int, int]:
        """pid -> parent pid."""
        return self._comms[1]

    @cached_property
    def tasks(self) -> dict[int, tuple[int | None, str | None]]:
        """tid -> (pid, thread name), including tasks seen only as peers."""
        return tasks(self.conn, self.node)

    @cached_property
    def summed(self) -> list[SecRun]:
        """The window's whole seconds the writer summed and that still hold: the span
        and the grouped read add them up from their summaries (one check shared)."""
        return summed_runs(self.conn, self.node.key, self.window.start_ns,
                           self.window.end_ns)

    @cached_property
    def span(self) -> tuple[int, int]:
        """The part of the window this node has data for: rates divide by this."""
        return effective_span(self.conn, self.node, self.window, self.summed)

    @property
    def span_ns(self) -> int:
        return max(1, self.span[1] - self.span[0])

    @cached_property
    def sums(self) -> list[Sum]:
        """The window's timed events summed per thread, op and wait: op statistics, the
        breakdown and the stall finder add up the same groups (one sort of the rows)."""
        return event_sums(self.conn, self.node, self.window, runs=self.summed)

    @cached_property
    def _op_events(self) -> Loaded:
        """Every process's stored durations and histograms: read once for the rows per
        process and the rows summed over processes (explain shows both)."""
        return load_op_stats(self.conn, self.node, self.window, span=self.span,
                             sums=self.sums)

    @cached_property
    def ops(self) -> list[OpRow]:
        """Op statistics per process, every process (largest total time first)."""
        return node_op_stats(self.conn, self.node, self.window, None, True, self.names,
                             self._op_events)

    def op_stats(self, pid: int | None = None, per_process: bool = True) -> list[OpRow]:
        """Op statistics for one process or all, per process or summed over processes."""
        if pid is None and per_process:
            return self.ops
        if pid is None and self._summed_ops is not None:
            return self._summed_ops
        if pid is None:
            return node_op_stats(self.conn, self.node, self.window, None, False, self.names,
                                 self._op_events)
        return node_op_stats(self.conn, self.node, self.window, pid, per_process, self.names)

    def kernel_stats(self, pid: int | None = None, per_process: bool = True
                     ) -> list[KernelOpRow]:
        """Launch statistics per kernel name (``fleetd ops --by kernel``)."""
        return node_kernel_stats(self.conn, self.node, self.window, pid, per_process,
                                 self.names)

    @cached_property
    def threads(self) -> list[ThreadRow]:
        """Where every traced thread's wall time went (most CUDA time first)."""
        return thread_breakdown(self.conn, self.node, self.window, self.span, self.tasks,
                                self.names, sums=self.sums, samples=self.stack_rows)

    @cached_property
    def stack_rows(self) -> list[StackRow]:
        """The on-CPU samples per thread and stack: the breakdown's lock spinning and
        the on-CPU rules' threads read the same rows."""
        return stack_rows(self.conn, self.node, self.window)

    def threads_of(self, pid: int | None) -> list[ThreadRow]:
        """:attr:`threads`, or only one process's (read for that process alone)."""
        if pid is None:
            return self.threads
        return thread_breakdown(self.conn, self.node, self.window, self.span, self.tasks,
                                self.names, pid)

    def preload(self) -> None:
        """Read what every explain reads first (names, tasks, span, op statistics, the
        breakdown), so that a progress line can tell the reading from the analysis."""
        _ = (self.names, self.tasks, self.span, self.ops, self.threads)

    def take_ops(self, ops: list[OpRow], summed: list[OpRow]) -> None:
        """The op statistics per process and summed over processes, read by a forked
        child (:mod:`fleetd.analyze.pernode.preload`): as :attr:`ops` and
        :meth:`op_stats` would have read them here."""
        self.__dict__["ops"] = ops
        self._summed_ops = summed

    def processes(self, threads: list[ThreadRow]) -> list[ProcessRow]:
        """``threads`` summed per process, with the exact histogram totals beside them."""
        return process_rows(threads, self.conn, self.node, self.window)
