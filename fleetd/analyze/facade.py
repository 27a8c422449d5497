"""The one door into the analyzers: a database, a window, and every question asked of it.

:class:`Analysis` is what the node API, the MCP server and the CLI call. It resolves the
window once, builds one :class:`~fleetd.analyze.pernode.model.NodeSlice` per node of the file
(one for a node's own database, several for a merged one) and hands the same slices to
every analyzer: explain, op statistics, overview, straggler profiles, the time
breakdown, stacks and CUDA graph lifecycle. Two questions in one request (chains and
stragglers, say) therefore read names, op statistics and threads once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Sequence
from functools import cached_property

from fleetd.analyze import explain as explainer
from fleetd.analyze.distributed import collectives as coll
from fleetd.analyze.distributed.stragglers import rank
from fleetd.analyze.gpu.device import gpu_report
from fleetd.analyze.gpu.graphs import graph_lifecycle
from fleetd.analyze.overview import node_overview
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.answers import (
    ChainJson,
    ExplainReport,
    GpuAnswer,
    GraphsAnswer,
    NodeProfile,
    NoProfile,
    OverviewAnswer,
    StackGroup,
    StacksAnswer,
    StragglerEntry,
)
from fleetd.analyze.reading.answers_collectives import CollectivesAnswer
from fleetd.analyze.reading.data import Node, nodes
from fleetd.analyze.reading.rows import KernelOpRow, OpRow, ProcessRow
from fleetd.analyze.reading.window import Window, resolve
from fleetd.analyze.stacks import NOTE_NO_STACKS, op_code, stack_groups
from fleetd.errors import UsageError
from fleetd.store.bounds import Bounds

# The deadline of one analysis request (the agent's endpoints, the MCP tools): explain
# over a large window reads much more than one query may.
ANALYSIS_TIMEOUT_S = 60.0


class Analysis:
    """Every analysis of one database over one window, for all its nodes or one.

    Overview, stacks, graphs and gpu answer with the typed dictionaries of
    :mod:`fleetd.analyze.reading.answers` (docs/json.md)."""

    def __init__(self, conn: sqlite3.Connection, window: Window, node: str | None = None
                 ) -> None:
        self.conn = conn
        self.window = window
        self.only = node

    @classmethod
    def of(cls, conn: sqlite3.Connection, bounds: Bounds | None = None,
           node: str | None = None) -> Analysis:
        """Resolve ``bounds`` (default: the whole recording) against this database
        (UsageError for a window its data empties)."""
        return cls(conn, resolve(conn, bounds or Bounds()), node)

    # ---- the model --------------------------------------------------------------------

    @cached_property
    def nodes(self) -> list[Node]:
        return nodes(self.conn, self.only)

    @cached_property
    def slices(self) -> list[NodeSlice]:
        return [NodeSlice(self.conn, n, self.window) for n in self.nodes]

    def node_names(self) -> list[str]:
        """The nodes analyzed; a UsageError naming the file's nodes when the one asked
        for is not there."""
        if self.only is not None and not self.nodes:
            present = ", ".join(n.name for n in nodes(self.conn)) or "none"
            raise UsageError(f"no node {self.only!r} in this database",
                             f"nodes here: {present}")
        return [n.name for n in self.nodes]

    def slice(self, name: str) -> NodeSlice | None:
        return next((sl for sl in self.slices if sl.name == name), None)

    # ---- the analyzers ----------------------------------------------------------------

    def explain(self, pid: int | None = None, per_process: bool = False,
                pids: Collection[int] | None = None) -> ExplainReport:
        """Chains, processes and op statistics, node by node (docs/explain.md); only of
        ``pids`` when given (``--pod``, ``--namespace``)."""
        return explainer.report(self.slices, self.window, pid, per_process, pids)

    def op_stats(self, pid: int | None = None, per_process: bool = False) -> list[OpRow]:
        """p50/p95/p99 per op (and process), every node's rows one after another."""
        return [r for sl in self.slices for r in sl.op_stats(pid, per_process)]

    def kernel_stats(self, pid: int | None = None, per_process: bool = False
                     ) -> list[KernelOpRow]:
        """p50/p95/p99 per launched kernel name (and process), every node's rows one
        after another."""
        return [r for sl in self.slices for r in sl.kernel_stats(pid, per_process)]

    def overview(self, node: str) -> OverviewAnswer:
        """One node's events by source, sessions, chain counts and top ops."""
        return node_overview(self.conn, self.window, node, self.slice(node))

    def profile(self, node: str) -> NodeProfile | NoProfile:
        """The straggler features of one node."""
        sl = self.slice(node)
        if sl is None:
            return {"node": node, "error": "no such node in this database"}
        return explainer.node_profile(sl)

    def stragglers(self, chains: Sequence[ChainJson],
                   collectives: CollectivesAnswer | None = None) -> list[StragglerEntry]:
        """The nodes of the file ranked as the fleet client ranks live ones (two or more),
        led by the ranks collective arrival names (``collectives``: :meth:`collectives`'
        report, computed here when not given)."""
        found = collectives if collectives is not None else self.collectives()
        ranked = (rank({sl.name: explainer.node_profile(sl) for sl in self.slices}, {}, chains)
                  if len(self.slices) > 1 else [])  # one node: nothing to compare it with
        return coll.straggler_entries(found, chains) + ranked

    def arrivals(self, max_rows: int | None = None, max_bytes: int | None = None
                 ) -> list[coll.NodeArrivals]:
        """Every node's NCCL collective calls in the window (the newest ``max_rows`` per
        node, all without), with the processes that made them and the node's clock error."""
        return [coll.read_arrivals(sl, max_rows, max_bytes) for sl in self.slices]

    def collectives(self, clocks: dict[str, coll.Clock] | None = None,
                    max_rows: int = coll.LOCAL_ROWS) -> CollectivesAnswer:
        """Collective arrival per communicator and rank, and the straggler rank it names
        (docs/explain.md, "Collective arrival"), over the newest ``max_rows`` calls per
        node; ``clocks``: node -> (offset, error)."""
        # coll.analyze assembles it from untyped parts; tests/unit/test_answer_shapes.py
        # holds real answers to the class.
        return coll.analyze(self.arrivals(max_rows), clocks)

    def breakdown(self, pid: int | None = None, pids: Collection[int] | None = None
                  ) -> list[ProcessRow]:
        """Where each process's threads spent their wall time (most CUDA time first);
        only of ``pids`` when given (a pod's processes)."""
        procs: list[ProcessRow] = []
        for sl in self.slices:
            mine = sl.processes(sl.threads_of(pid))
            if pids is not None:
                mine = [p for p in mine if p["pid"] in pids]
            pods.annotate(mine, sl.node.key, pods.placements(sl.conn, sl.node.key))
            procs += mine
        procs.sort(key=lambda p: (-p["in_cuda_ns"], -p["off_cpu_ns"]))
        return procs

    def stacks(self, op: str | None, pid: int | None, top_n: int, frames_n: int,
               *, min_dur_ns: int = 0) -> StacksAnswer:
        """The heaviest recorded stacks of CUDA calls (of one op / process, at least
        ``min_dur_ns`` long)."""
        code = op_code(op) if op else None
        found: list[StackGroup] = []
        bare = 0
        for sl in self.slices:
            groups, without = stack_groups(sl, code, pid, top_n, frames_n, min_dur_ns)
            found += groups
            bare += without
        found.sort(key=lambda s: -int(s["total_ns"]))
        out: StacksAnswer = {"window": self.window.to_json(), "op": op, "pid": pid,
                             "stacks": found, "events_without_stack": bare,
                             "warnings": list(self.window.warnings)}
        if not found:
            out["note"] = NOTE_NO_STACKS
        return out

    def graphs(self, pid: int | None = None, buckets: int = 20) -> GraphsAnswer:
        """CUDA graph capture / instantiate / launch per process, over time."""
        out = graph_lifecycle(self.slices, self.window, pid, buckets)
        if not out["processes"]:
            out["note"] = "no CUDA graph call (capture, instantiate, launch) in the window"
        return out

    def gpu(self, pid: int | None = None, steps_only: bool = False,
            thresholds: dict[str, float] | None = None) -> GpuAnswer:
        """GPU idle, compute/communication/copy shares, launch delays and the M1-M5
        host-overhead verdict per rank (imported GPU timelines; docs/json.md)."""
        return gpu_report(self.slices, self.window, pid, steps_only, thresholds)
