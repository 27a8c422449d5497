"""What each MCP tool answers, as typed dictionaries (the keys docs/mcp.md describes).

Most answers are an analyzer's answer (:mod:`fleetd.wire.answers`) cut for a model:
shorter lists (``<list>_total`` and the truncation keys say what was cut), traced
strings marked as data (:class:`~fleetd.mcp.safety.Untrusted`), and, over a live
fleet, led by how the fan-out went (:class:`FleetHeader`). ``_traced_names``
(:data:`fleetd.mcp.safety.NAMES_KEY`) carries the names the server quotes inside
fleetd's own sentences; it never leaves the server (:func:`fleetd.mcp.server.finish`).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any, Literal, NotRequired

# typing_extensions' TypedDict can be closed (PEP 728): a closed part (Cut, Head) may be
# unpacked into a larger answer without mypy fearing a stray key. The MCP SDK requires it.
from typing_extensions import TypedDict

from fleetd.analyze.reading.answers import (
    ChainCore,
    CpuStack,
    EvidenceItem,
    FrameShare,
    GpuRank,
    GraphProcess,
    KernelFigures,
    RankedCulprit,
    RankStraggler,
    StackGroup,
    StragglerEntry,
    WindowJson,
)
from fleetd.analyze.reading.rows import ProcessTotals, ThreadRow
from fleetd.checks import CheckJson
from fleetd.mcp.safety import Untrusted
from fleetd.wire.gpu import CheckedRank


class Truncation(TypedDict):
    """Whether a list was cut to the caller's ``top_n``, and how to see more."""

    truncated: bool
    truncated_reason: NotRequired[list[str]]


class Cut(Truncation, closed=True):
    """:class:`Truncation` as :func:`fleetd.mcp.local.cut` writes it into an answer:
    closed (no other key), so it unpacks into any answer that has those two keys."""


class CompactChain(ChainCore):
    """A chain as the MCP tools give it: :class:`~fleetd.wire.answers.ChainJson`
    without its ``key``, with three culprits, ``evidence_n`` evidence items
    (``evidence_omitted``: the rest) and without the flame graph's stacks
    (``get_cpu_profile`` gives them)."""

    culprits: list[RankedCulprit]
    evidence: list[EvidenceItem]
    evidence_omitted: NotRequired[int]


# ---- over one database file (fleetd.mcp.local) -----------------------------------------


class SessionCount(TypedDict):
    node: str
    sessions: int
    lost_events: int
    dropped_stacks: int
    sampled_out: int


class OpTable(TypedDict):
    columns: list[str]
    rows: list[list[Any]]  # one cell per column: a number, a name, or a marked comm


class TraceStats(Truncation):
    """get_trace_stats."""

    window: WindowJson
    nodes: list[str]
    events_by_source: dict[str, int]
    sessions: list[SessionCount]
    ops: OpTable
    ops_total: int
    warnings: list[str]


class ChainsTool(Truncation):
    """get_causal_chains over a file: the chains at or above ``min_severity``."""

    _traced_names: list[str]
    verdict: str
    quiet: bool
    window: WindowJson
    nodes: list[str]
    counts: dict[str, int]  # severity -> chains
    chains: list[CompactChain]
    chains_total: int
    warnings: list[str]
    stragglers: NotRequired[list[StragglerEntry]]


class StacksTool(Truncation):
    """get_stacks over a file."""

    window: WindowJson
    op: str | None
    pid: int | None
    stacks: list[StackGroup]
    stacks_total: int
    events_without_stack: int
    warnings: list[str]
    note: NotRequired[str]


class HeavyStack(CpuStack):
    """A (thread, stack) count of a fleet's profile, with its node."""

    node: str


class ProfileFigures(TypedDict):
    """:class:`~fleetd.analyze.reading.answers.CpuProfile` without its note."""

    samples: int
    gc_samples: int
    period_ns: int
    on_cpu_ns: int
    threads: int
    stacks: int
    top: list[FrameShare]


class ProfileTool(Truncation):
    """get_cpu_profile's figures (:class:`~fleetd.analyze.reading.answers.CpuProfile`
    with the heaviest stacks in place of their count)."""

    pid: int | None
    tid: int | None
    samples: int
    gc_samples: int
    period_ns: int
    on_cpu_ns: int
    threads: int
    stacks: Sequence[CpuStack]  # HeavyStacks over a fleet
    top: list[FrameShare]
    stacks_total: int
    note: NotRequired[str]


class CpuProfileTool(ProfileTool):
    """get_cpu_profile over a file."""

    window: WindowJson
    warnings: list[str]


class BreakdownThread(ThreadRow):
    """A thread of get_latency_breakdown: its row, and its columns' shares of its wall
    time (by column name less ``_ns``)."""

    share_of_wall: dict[str, float]


# typing's TypedDict, as ProcessTotals is: one class may not derive from both kinds.
class ThreadsOmitted(typing.TypedDict):
    threads_omitted: NotRequired[int]  # the threads past ``threads_n``, when there are


class BreakdownProcess(ProcessTotals, ThreadsOmitted):
    """A process of get_latency_breakdown: its totals (no ``top_ops``), its first
    ``threads_n`` threads and how many more it has."""

    threads: list[BreakdownThread]


class BreakdownTool(Truncation):
    """get_latency_breakdown: the processes, each with its first ``threads_n`` threads
    (``threads_omitted``: the rest; each thread with its ``share_of_wall``)."""

    window: WindowJson
    processes: list[BreakdownProcess]
    processes_total: int
    warnings: list[str]


class MarkedKernel(KernelFigures):
    """A kernel row whose name (the profiled program's) is marked as data."""

    name: Untrusted


class KernelsShown(Truncation):
    kernels_total: int


class GpuTool(TypedDict):
    """get_gpu_breakdown over a file: ``fleetd gpu``'s answer, its kernel table cut."""

    node: NotRequired[str]
    window: WindowJson
    ranks: list[GpuRank]
    kernels: list[MarkedKernel]
    warnings: list[str]
    straggler: RankStraggler | None
    note: NotRequired[str]
    kernels_shown: KernelsShown


class SessionRow(TypedDict):
    """A recording session as the sessions table holds it (``drops``: its JSON read)."""

    id: int
    node: str
    host: str
    kernel: str
    started_ns: int
    ended_ns: int | None
    tool_version: str
    headers_route: str | None
    lost_events: int
    dropped_stacks: int
    sampled_out: int
    drops: Any
    targets: str | None
    rank: int | None
    world_size: int | None


class Recording(TypedDict):
    """What a file says about how it was recorded (get_check over a file)."""

    db: str
    nodes: list[str]
    sessions: list[SessionRow]


class SqlTool(TypedDict):
    """run_sql over a file."""

    columns: list[str]
    rows: Untrusted
    row_count: int
    truncated: bool
    truncated_reason: list[str]
    elapsed_ms: float
    warnings: list[str]


class ExportedNode(TypedDict):
    node: str
    events: int
    chains: int
    arrows: int


class ExportAnswer(TypedDict):
    """export_timeline: the file written, and what is in it per node."""

    path: str
    bytes: int
    format: str
    open_with: str
    nodes: list[ExportedNode]
    events: int
    warnings: list[str]


# ---- over a live fleet (fleetd.mcp.fleet) -----------------------------------------------


class FanOut(TypedDict):
    """How the fan-out went: first in every fleet answer."""

    status: str  # complete | partial | none
    answered: str
    warnings: list[str]


class FanOutPart(FanOut, closed=True):
    """:class:`FanOut` as :func:`fleetd.mcp.fleet.fan_out_of` writes it (closed, as
    :class:`Cut`)."""


class FleetHeader(FanOut):
    skew: list[str]  # one line per node: its clock offset, or that it is unknown


class Head(FleetHeader, closed=True):
    """:class:`FleetHeader` as :func:`fleetd.mcp.fleet.header` writes it (closed)."""


HealthKey = Literal["status", "version", "schema_version", "tracing", "uptime_s", "trace"]


class NodeHealth(TypedDict):
    """A node's /health as the fleet tools give it: the keys it answered among
    :data:`~fleetd.mcp.fleet.HEALTH_KEYS`, or ``unreachable`` and why."""

    node: str
    address: str
    status: NotRequired[Any]
    version: NotRequired[Any]
    schema_version: NotRequired[Any]
    tracing: NotRequired[Any]
    uptime_s: NotRequired[Any]
    trace: NotRequired[Any]
    error: NotRequired[str]


class FleetHealth(FleetHeader):
    nodes: list[NodeHealth]


class FleetExport(FleetHeader, ExportAnswer):
    """export_timeline over a fleet (one warnings list: the fan-out's first)."""


class FleetSql(FleetHeader):
    """query_fleet sql: every node's rows, each led by its node."""

    columns: list[str]
    rows: Untrusted
    row_count: int
    truncated: bool
    truncated_reason: list[str]


class FleetOps(FleetHeader, Truncation):
    """query_fleet ops: every node's op rows, the busiest first."""

    columns: list[str]
    rows: list[list[Any]]
    rows_total: int


OverviewKey = Literal["node", "events", "by_source", "lost_events", "chains", "verdict",
                      "window", "warnings"]
TopOpKey = Literal["op", "count", "total_ns", "p50_ns", "p99_ns"]


class TopOp(TypedDict, total=False):
    """An op of a node's overview (each key as the node sent it)."""

    op: Any
    count: Any
    total_ns: Any
    p50_ns: Any
    p99_ns: Any


class NodeOverview(TypedDict, total=False):
    """A node's overview cut for a model (each key as the node sent it)."""

    node: Any
    events: Any
    by_source: Any
    lost_events: Any
    chains: Any
    verdict: Any
    window: Any
    warnings: Any
    sessions: int
    top_ops: list[TopOp]


class FleetOverview(FleetHeader):
    _traced_names: list[str]
    nodes: list[NodeOverview]


class FleetStacks(FleetHeader, Truncation):
    op: str | None
    pid: int | None
    stacks: list[StackGroup]
    stacks_total: int
    events_without_stack: int
    note: NotRequired[str]


class FleetGraphs(FleetHeader):
    processes: list[GraphProcess]
    note: NotRequired[str]


class FleetGpu(FleetHeader, Truncation):
    """query_fleet gpu: every node's ranks side by side, the slowest flagged."""

    ranks: list[CheckedRank]
    straggler: RankStraggler | None
    kernels: list[MarkedKernel]  # each with its node
    kernels_total: int
    note: NotRequired[str]


class FleetProfile(FleetHeader, ProfileTool):
    """get_cpu_profile over a fleet: the nodes' samples merged, stacks with their node."""


class FleetChains(FleetHeader, Truncation):
    verdicts: dict[str, str]  # node -> its verdict
    chains: list[CompactChain]
    chains_total: int


class FleetStragglers(FleetHeader):
    """query_fleet stragglers: the nodes ranked, and the top chains of each flagged one."""

    stragglers: list[StragglerEntry]
    flagged: list[str]
    why: dict[str, list[CompactChain]]
    verdicts: dict[str, str]


FleetQuery = (FleetSql | FleetOps | FleetOverview | FleetChains | FleetStragglers
              | FleetStacks | FleetGraphs | FleetGpu)


# ---- get_check -----------------------------------------------------------------------


class MachineCheck(TypedDict):
    """The checks of the machine the server runs on (``fleetd check``'s)."""

    can_trace: bool
    warnings: int
    checks: list[CheckJson]  # each check with its own figures


class FileCheck(TypedDict):
    """get_check over a file: this machine, and how the file was recorded."""

    this_machine: MachineCheck
    recording: Recording


class FleetCheck(FleetHealth):
    """get_check over a fleet: every node's health, and this machine."""

    this_machine: MachineCheck
