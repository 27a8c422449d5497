"""The JSON shapes of the analyzers' answers (docs/json.md), as typed dictionaries.

The analyzers build their answers as these types (:class:`fleetd.analyze.facade.Analysis`
returns them), the agent serves them and the CLI and the MCP server render them, so mypy
holds producer and consumer to one shape. They live here, beside their producers, because
an analyzer may not import a layer above its own (docs/architecture.md); the agent and
the client take them from :mod:`fleetd.wire.answers`, which names the same classes.

Only ``typing`` is imported: a client-only install reads these without the analyzers'
dependencies. A key that is not always there is ``NotRequired``; a value that may be
JSON ``null`` has ``None`` in its type. ``window`` is
:class:`WindowJson` (:meth:`fleetd.analyze.reading.window.Window.to_json`). An op row (a
row of ``fleetd ops``) and a process row of the breakdown are
:mod:`fleetd.analyze.reading.rows`' :class:`OpRow` and :class:`ProcessRow`, named here
too. A chain's parts (victim, culprits, ``detail``,
evidence items) live in :mod:`fleetd.analyze.reading.answers_chain` and are named here
too; a ``detail``'s keys depend on the root cause and an evidence item's on its kind,
and docs/explain.md lists them per case. docs/json.md lists every key of every class in
:data:`ANSWERS`, and tests/unit/test_answer_shapes.py holds the two, and a real answer
(its chains' details and evidence included), to each other.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

# The NCCL collectives' answer and a chain's parts have their own modules (one family
# per module, under the line limit); they are named here with the rest, and ANSWERS
# lists the collectives' with the others.
from fleetd.analyze.reading.answers_chain import ChainDetail as ChainDetail
from fleetd.analyze.reading.answers_chain import Culprit as Culprit
from fleetd.analyze.reading.answers_chain import EvidenceItem as EvidenceItem
from fleetd.analyze.reading.answers_chain import FlameStack as FlameStack
from fleetd.analyze.reading.answers_chain import FlameStacks as FlameStacks
from fleetd.analyze.reading.answers_chain import GcPause as GcPause
from fleetd.analyze.reading.answers_chain import GcTrigger as GcTrigger
from fleetd.analyze.reading.answers_chain import IdleFrames as IdleFrames
from fleetd.analyze.reading.answers_chain import KernelWork as KernelWork
from fleetd.analyze.reading.answers_chain import NcclErrorCount as NcclErrorCount
from fleetd.analyze.reading.answers_chain import Placement as Placement
from fleetd.analyze.reading.answers_chain import QuotaFigures as QuotaFigures
from fleetd.analyze.reading.answers_chain import RankedCulprit as RankedCulprit
from fleetd.analyze.reading.answers_chain import Reader as Reader
from fleetd.analyze.reading.answers_chain import ShadowedChain as ShadowedChain
from fleetd.analyze.reading.answers_chain import Task as Task
from fleetd.analyze.reading.answers_chain import TopFrame as TopFrame
from fleetd.analyze.reading.answers_chain import Victim as Victim
from fleetd.analyze.reading.answers_collectives import COLLECTIVE_SHAPES, CollectivesAnswer
from fleetd.analyze.reading.answers_diff import DIFF_SHAPES

# An op row (``fleetd ops``) and a process of the breakdown: the rows' own module.
from fleetd.analyze.reading.rows import OpRow as OpRow
from fleetd.analyze.reading.rows import ProcessRow as ProcessRow

# ---- explain (fleetd explain, GET /api/v1/chains) -------------------------------------------


class WindowJson(TypedDict):
    """The analyzed window: half-open ``[start_ns, end_ns)`` in UTC ns, ISO ends, label."""

    start_ns: int
    end_ns: int
    start: str
    end: str
    label: str




class ChainCore(TypedDict):
    """What every reader of a chain shows: :class:`ChainJson` without its key, ranked
    culprits and evidence (which the MCP tools cut short)."""

    id: str  # node:hash of key
    node: str
    severity: str  # HIGH | MEDIUM | LOW
    root_cause: str
    summary: str
    op: str | None
    victim: Victim
    culprit: Culprit | None
    explained: float
    impact: float
    ts_ns: int
    dur_ns: int
    time: str | None
    detail: ChainDetail
    fixes: list[str]


class ChainJson(ChainCore):
    """A causal chain (docs/explain.md, "A chain"): what was slow, why, who, what to do."""

    key: str
    culprits: list[RankedCulprit]  # up to 5
    evidence: list[EvidenceItem]


class NodeExplain(TypedDict):
    """One node's part of a report: the unit the fleet client asks each node for."""

    chains: list[ChainJson]
    processes: list[ProcessRow]
    ops: list[OpRow]
    warnings: list[str]


class ExplainReport(TypedDict):
    """``fleetd explain --format json`` of one database; the command adds ``collectives``
    and, over several nodes or ranks, ``stragglers`` and ``skew``; ``gpu`` with an
    imported GPU timeline; ``stored`` with ``--store``."""

    window: WindowJson
    nodes: list[str]
    quiet: bool
    verdict: str
    chains: list[ChainJson]
    processes: list[ProcessRow]
    ops: list[OpRow]
    warnings: list[str]
    collectives: NotRequired[CollectivesAnswer]
    gpu: NotRequired[list[GpuBrief]]
    stragglers: NotRequired[list[StragglerEntry]]
    # node -> its clock offset, {"offset_ms", "error_ms"} (fleetd.fleet.skew.Skew.to_json)
    skew: NotRequired[dict[str, dict[str, float]]]
    stored: NotRequired[int]


class StragglerEntry(TypedDict):
    """A node (or, ``metric`` ``collective_arrival``, a rank) as the straggler ranking
    lists it (docs/json.md, "stragglers"); ``flagged`` None: it could not be ranked."""

    node: str
    score: float | None
    flagged: bool | None
    metric: str | None
    reason: str
    z: NotRequired[float | None]
    metrics: NotRequired[dict[str, MetricScore]]
    rank: NotRequired[int]
    pid: NotRequired[int]
    comm: NotRequired[str | None]
    peers: NotRequired[list[int]]
    communicator: NotRequired[str]
    matching: NotRequired[str]
    share_last: NotRequired[float]
    judged: NotRequired[int]
    lateness_p50_ns: NotRequired[int | None]
    lateness_p99_ns: NotRequired[int | None]


class MetricScore(TypedDict):
    """A node's value of one straggler metric against the fleet's."""

    value: float
    score: float
    z: float | None
    fleet_median: float
    best: float


class NodeProfile(TypedDict):
    """``GET /api/v1/profile``: the straggler features of a node's main CUDA process;
    ``features`` empty (and only ``node``, ``window``, ``main_pid``) without CUDA work."""

    node: str
    window: WindowJson
    span_s: NotRequired[float]
    main_pid: int | None
    main_comm: NotRequired[str | None]
    rate_span_s: NotRequired[float | None]
    counted_from: NotRequired[str | None]
    features: dict[str, float | str | None]


class NoProfile(TypedDict):
    """A profile asked of a node the database does not hold."""

    node: str
    error: str


class GpuBrief(TypedDict):
    """A rank's GPU verdict as the explain report carries it (the HTML report draws it)."""

    node: str
    pid: int
    rank: int | None
    host_overhead: str
    summary: str
    idle_pct: float | None
    compute_pct: float | None
    comm_pct: float | None
    memcpy_pct: float | None
    metrics: dict[str, float | None] | None
    thresholds: dict[str, float] | None

# ---- overview (GET /api/v1/overview, fleetd overview) ----------------------------------


class OverviewSession(TypedDict):
    """One trace session of the node; ``end_reason`` ``stopped``, ``crashed`` or None
    (still running); columns a database of an older schema lacks are None."""

    id: str  # NODE:SEQ
    started_ns: int
    ended_ns: int | None
    end_reason: str | None
    lost_events: int | None
    rank: int | None
    world_size: int | None
    headers_route: str | None


class OverviewAnswer(TypedDict):
    """One node's events by source, sessions, chain counts and top ops."""

    node: str
    window: WindowJson
    events: int
    by_source: dict[str, int]
    sessions: list[OverviewSession]
    lost_events: int
    crashed_sessions: int
    chains: dict[str, int]  # {"HIGH": n, "MEDIUM": n, "LOW": n}
    verdict: str
    top_ops: list[OpRow]  # the ten op rows with the most total time
    warnings: list[str]


# ---- on-CPU profile (fleetd profile, GET /api/v1/cpu_stacks) ----------------------------


class FrameShare(TypedDict):
    """A frame of the profile: its samples as the innermost frame and anywhere."""

    frame: str
    self_samples: int
    total_samples: int
    self_share: float  # of the profile's samples
    total_share: float


class CpuProfile(TypedDict):
    """``fleetd profile --format json``: the summary of on-CPU samples."""

    samples: int
    gc_samples: int
    period_ns: int
    on_cpu_ns: int  # samples x period
    threads: int
    stacks: int
    top: list[FrameShare]
    note: str | None


class CpuStack(TypedDict):
    """One thread's stack and its samples, frames innermost first."""

    pid: int
    tid: int
    frames: list[str]
    samples: int
    gc: int


class CpuStacksAnswer(TypedDict):
    """``GET /api/v1/cpu_stacks``: the window's samples per (thread, stack)."""

    node: str
    window: WindowJson
    period_ns: int
    stacks: list[CpuStack]
    stacks_omitted: int
    warnings: list[str]


# ---- stacks (GET /api/v1/stacks, fleetd stacks) -----------------------------------------


class StackProcess(TypedDict):
    pid: int
    comm: str | None


class StackGroup(TypedDict):
    """One recorded user stack and the calls that had it; frames innermost first."""

    stack: str  # the hash, 16 hex digits
    events: int
    total_ns: int
    mean_ns: int | None
    max_ns: int
    ops: list[str]
    processes: list[StackProcess]  # at most ten
    frames: list[str]
    frames_omitted: NotRequired[int]
    node: str


class StacksAnswer(TypedDict):
    """The heaviest stacks of the window's CUDA calls (the agent adds ``node``)."""

    node: NotRequired[str]
    window: WindowJson
    op: str | None
    pid: int | None
    stacks: list[StackGroup]
    events_without_stack: int
    warnings: list[str]
    note: NotRequired[str]


# ---- CUDA graphs (GET /api/v1/graphs, fleetd graphs) ------------------------------------


class GraphPhase(TypedDict):
    """Count and latency of one phase (begin_capture, instantiate, launch, ...)."""

    count: int
    total_ns: int | None
    p50_ns: float | None
    p99_ns: float | None
    max_ns: int | None


class GraphRates(TypedDict):
    launches_per_s: float
    instantiations_per_s: float
    launches_per_instantiation: float | None
    build_share_of_wall: float
    launches_per_s_outside_captures: float | None
    launches_per_s_during_captures: float | None


class GraphEpisode(TypedDict):
    """A run of timeline buckets that instantiate or update graphs."""

    start: str
    captures: int
    instantiations: int
    updates: int
    launches: int
    build_ms: float
    duration_ms: float


class GraphTimeline(TypedDict):
    bucket_ns: int
    columns: list[str]
    rows: list[list[Any]]  # one per bucket, values in ``columns`` order


class GraphProcess(TypedDict):
    node: str
    pid: int
    comm: str | None
    phases: dict[str, GraphPhase]
    rates: GraphRates
    first_capture: str | None
    episodes: list[GraphEpisode]
    timeline: GraphTimeline
    verdict: str


class GraphsAnswer(TypedDict):
    """CUDA graph capture / instantiate / launch per process (the agent adds ``node``)."""

    node: NotRequired[str]
    window: WindowJson
    processes: list[GraphProcess]
    warnings: list[str]
    note: NotRequired[str]


# ---- GPU timeline (GET /api/v1/gpu, fleetd gpu) ----------------------------------------


class Delays(TypedDict):
    """A distribution of delays in ns (None without any)."""

    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    max: int | None


class ExposedPrep(TypedDict):
    """M3: the host preparation exposed to the GPU's idle time."""

    M3a: float | None
    M3b: float | None
    M3c: float | None
    host_prep_ns: int | None
    exposed_ns: int | None
    reason: str | None


class Judgement(TypedDict):
    """The M1-M5 verdict of a rank or a step; ``metrics`` and ``thresholds`` by name."""

    host_overhead: str  # YES | NO
    metrics: dict[str, float | None]
    thresholds: dict[str, float]
    evidence: list[str]
    caveats: list[str]
    host_prep: str  # confirmed | not confirmed | unknown


class RankVerdict(Judgement):
    """A rank's verdict: raised by its steps' (``phases``), never lowered."""

    phase_thresholds: NotRequired[dict[str, dict[str, float]]]
    phases: list[str]


class GpuStep(TypedDict):
    """One profiler step of a rank, judged by its own thresholds."""

    name: str
    start_ns: int
    step_ns: int
    idle_ns: int
    idle_pct: float
    kernels: int
    launches: int
    tklqt_ns: int
    metrics: dict[str, float | None]
    host_overhead: str
    evidence: list[str]


class RankSpan(TypedDict):
    """Which process and device, and the window its figures cover."""

    node: str
    pid: int
    rank: int | None
    device: int
    start_ns: int
    end_ns: int


class GpuFigures(TypedDict):
    """Where the GPU time of a window went, and how late kernels started."""

    m3: ExposedPrep
    window_ns: int
    idle_ns: int
    idle_pct: float
    compute_pct: float
    comm_pct: float
    memcpy_pct: float
    kernels: int
    nccl_kernels: int
    nccl_ns: int
    launches: int
    tklqt_ns: int
    launch_delay_ns: Delays
    queue_delay_ns: Delays


class GpuRank(RankSpan, GpuFigures):
    """One process and device: its span, its figures, then the host-overhead verdict."""

    tklqt_reading: str  # CPU-bound | GPU-bound | unknown
    summary: str
    verdict: RankVerdict
    steps: list[GpuStep]
    host_frames: NotRequired[IdleFrames]  # fleetd.analyze.causes.idle_frames.during_idle


class KernelFigures(TypedDict):
    count: int
    total_ns: int
    mean_ns: float
    p50_ns: float
    p99_ns: float
    share_pct: float


class KernelRow(KernelFigures):
    name: str


class RankStraggler(TypedDict):
    """The slowest of two or more ranks, scored as ``explain`` scores nodes."""

    node: str
    pid: int
    rank: int | None
    device: int
    metric: str
    value: float
    median: float
    best: float
    score: float
    flagged: bool
    reason: str


class GpuAnswer(TypedDict):
    """Every rank of the window's GPU timelines (the agent adds ``node``)."""

    node: NotRequired[str]
    window: WindowJson
    ranks: list[GpuRank]
    kernels: list[KernelRow]
    warnings: list[str]
    straggler: RankStraggler | None
    note: NotRequired[str]


# Every shape above (and the collectives'), in the order docs/json.md lists them.
ANSWERS: tuple[type, ...] = (
    WindowJson, ExplainReport, StragglerEntry, MetricScore, NodeProfile, NoProfile,
    GpuBrief,
    NodeExplain, ChainJson, Victim, Culprit, RankedCulprit,
    OverviewAnswer, OverviewSession, CpuProfile, FrameShare, CpuStacksAnswer, CpuStack,
    FlameStacks, FlameStack, StacksAnswer, StackGroup, StackProcess, GraphsAnswer,
    GraphProcess, GraphPhase, GraphRates, GraphEpisode, GraphTimeline, GpuAnswer, GpuRank,
    RankSpan, GpuFigures, Delays, ExposedPrep, Judgement, RankVerdict, GpuStep, KernelRow,
    RankStraggler,
    *COLLECTIVE_SHAPES, *DIFF_SHAPES,
)
