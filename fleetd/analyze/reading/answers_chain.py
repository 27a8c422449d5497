"""The inside of a causal chain (docs/explain.md, "A chain"): its ``detail`` and its
evidence items, as typed dictionaries.

A chain's ``detail`` holds the figures behind it, and which ones depends on its root
cause (a spike chain's spike counts, a lock's address and holder, a cgroup's quota...):
:class:`ChainDetail` names every key any cause sets, each with its one type, all
``NotRequired``; docs/explain.md lists which cause sets which. An evidence item is one
:class:`EvidenceItem`: ``kind`` and ``text`` always, then the keys of its kind. The
nested shapes (a frame ranking, a GC pause, a shadowed chain in ``also``...) are their
own classes below. Only ``typing`` and the rows' module (which imports only ``typing``)
are imported: a client-only install reads these.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

# Where a process ran: the keys a victim and a culprit gain, as a process row does.
from fleetd.analyze.reading.rows import Placement as Placement


class Task(TypedDict):
    """A task as the output names it (fleetd.analyze.reading.nodeview.NodeView.who):
    its process, thread id, process name and thread name."""

    pid: int
    tid: int
    comm: str | None
    thread: str | None


class Victim(Placement, Task):
    """The thread whose calls were slow."""


class Culprit(Placement):
    """A chain's top culprit as its ``culprit`` shows it; ``self``: the victim's own
    process; ``tid``/``thread``: its thread that accounts for most of the time; ``where``
    and ``stack``: a lock holder traced with stacks."""

    pid: int
    comm: str | None
    self: bool
    tid: NotRequired[int]
    thread: NotRequired[str | None]
    where: NotRequired[str]
    stack: NotRequired[list[str]]


class RankedCulprit(Culprit):
    """One of a chain's ``culprits``, most time first (``ns``: the time attributed,
    ``share`` of the chain's attributed time; ``presence``: how often it took over from
    the victim, cpu_contention)."""

    tids: NotRequired[list[int]]
    ns: NotRequired[int]  # not for a pipe's other end (``role``), found by its fd
    share: float
    presence: NotRequired[float]
    busy: NotRequired[float | None]
    inferred: NotRequired[bool]  # a lock holder found awake, not seen releasing it
    role: NotRequired[str]  # pipe_blocked: "reader" or "woken by"


class FlameStack(TypedDict):
    frames: list[str]  # outermost first
    samples: int


class FlameStacks(TypedDict):
    """A thread's stacks for a flame graph (the HTML report)."""

    samples: int
    stacks: list[FlameStack]


class TopFrame(TypedDict):
    """A function the thread's on-CPU samples were in, at its hottest line
    (fleetd.analyze.causes.idle_frames.rank_frames); ``samples`` apportioned where the
    sampling intervals were split, ``share`` of all the samples considered."""

    frame: str
    where: str
    samples: float
    share: float


class IdleFrames(TypedDict):
    """What a GPU process's thread ran on the CPU while its GPUs sat idle
    (fleetd.analyze.causes.idle_frames.during_idle); ``text``: the sentence saying it
    (an evidence item takes it out)."""

    tid: int
    gaps: int
    idle_ns: int
    samples: float
    host_samples: float
    host_ns: int
    host_share_of_idle: float
    period_ns: int
    top_frames: list[TopFrame]
    share_from: str
    text: NotRequired[str]


class GcTrigger(TypedDict):
    """A Python line running when the collector started, by GC samples."""

    frame: str
    samples: int


class GcPause(TypedDict):
    """One GC pause: ``samples`` 0 and ``generation`` known when the interpreter's
    probes measured it, else a run of samples (generation -1)."""

    ts_ns: int
    dur_ns: int
    samples: int
    generation: int


class ShadowedChain(TypedDict):
    """A chain whose lost share another chain of the same thread and breakdown column
    states (``detail.also``)."""

    root_cause: str
    op: str | None
    estimate: float
    culprit: Culprit | None


class NcclErrorCount(TypedDict):
    """How often one NCCL op returned one error code."""

    op: str
    ret: int
    error: str
    count: int


class QuotaFigures(TypedDict):
    """The CPU quota a contention chain's culprit spends with the victim."""

    cgroup: str
    quota_us: int
    period_us: int
    cpus: float
    throttled_share: float
    throttled_period_share: float


class KernelWork(TypedDict):
    """Work the victim queued for the kernel's workers (``detail.own_kernel_work``)."""

    queued: int
    functions: dict[str, int]  # the top work functions, by count
    reclaim: bool


class Reader(TypedDict):
    """A process the tracer found holding a pipe's read end."""

    pid: int
    comm: str | None


class ChainDetail(TypedDict):
    """The figures behind a chain. Every key belongs to some root causes only (docs/
    explain.md lists them per cause), so all are ``NotRequired``; the grouping below
    follows the causes that set them.

    ``host_ns`` is the one key of two meanings: a spike chain's host time by cause
    (``{"runq": ns, ...}``), host_cpu_bound's time on the CPU outside CUDA calls."""

    # spike chains (cpu_contention, lock_wait, block_io, irq_preemption, unexplained)
    spikes: NotRequired[int]
    spikes_scaled: NotRequired[int]
    stalls: NotRequired[int]
    slow_calls: NotRequired[int]
    worst_ns: NotRequired[int]
    median_spike_ns: NotRequired[int]
    baseline_ns: NotRequired[int]
    kind: NotRequired[str]
    ops: NotRequired[list[str]]
    excess_ns: NotRequired[int]
    host_ns: NotRequired[dict[str, int] | int]
    # the lost share, from the breakdown (chains.account)
    estimate: NotRequired[float]
    share: NotRequired[float]
    share_of: NotRequired[str]
    share_also: NotRequired[list[str]]
    share_from: NotRequired[str]
    also: NotRequired[list[ShadowedChain]]
    # dataloader_oversubscription
    workers: NotRequired[int]
    pages_per_s: NotRequired[float]
    # host_sync
    syncs: NotRequired[int]
    launches: NotRequired[int]
    sync_share: NotRequired[float]
    syncs_per_s: NotRequired[float]
    readbacks: NotRequired[int]
    readback_bytes: NotRequired[int]
    # startup, alloc_churn, graph_recapture
    calls: NotRequired[int]
    startup_ns: NotRequired[int]
    first_ns: NotRequired[int]
    first_op: NotRequired[str]
    first_launch_ns: NotRequired[int]
    allocs: NotRequired[int]
    frees: NotRequired[int]
    allocs_per_s: NotRequired[float]
    alloc_share: NotRequired[float]
    captures: NotRequired[int]
    launch_rate_drop: NotRequired[float]
    capture_share: NotRequired[float]
    # lock_contention
    lock_addr: NotRequired[str]
    lock_symbol: NotRequired[str | None]
    lock_share: NotRequired[float]
    waits: NotRequired[int]
    released: NotRequired[int]
    holder_tid: NotRequired[int]
    holder_thread: NotRequired[str | None]
    holder_inferred: NotRequired[bool]
    holder_busy: NotRequired[float | None]
    gil: NotRequired[bool]
    addresses: NotRequired[int]
    holder_where: NotRequired[str | None]
    holder_stacks: NotRequired[int]
    holder_where_share: NotRequired[float | None]
    # lock_wait with kernel lock spinning (oncpu)
    lock_spin_share: NotRequired[float]
    spin_samples: NotRequired[int]
    # data_starvation
    data_share: NotRequired[float]
    producers: NotRequired[int]
    producer_busy: NotRequired[float | None]
    producer_bound: NotRequired[bool]
    # pipe_blocked
    fd: NotRequired[int]
    object: NotRequired[str | None]
    remote: NotRequired[str | None]
    blocked_ns: NotRequired[int]
    blocked_share: NotRequired[float]
    longest_ns: NotRequired[int]
    fd_share: NotRequired[float]
    readers: NotRequired[list[Reader]]
    # gpu_idle
    device: NotRequired[int]
    gaps: NotRequired[int]
    idle_ns: NotRequired[int]
    covered_ns: NotRequired[int]
    gaps_covered: NotRequired[int]
    launch_tids: NotRequired[list[int]]
    waits_ns: NotRequired[dict[str, int]]
    dominant: NotRequired[str]
    # nccl_failures
    failed: NotRequired[int]
    by_error: NotRequired[list[NcclErrorCount]]
    longest_failed_ns: NotRequired[int]
    # gc_pause and host_cpu_bound (on-CPU samples)
    pauses: NotRequired[int]
    gc_ns: NotRequired[int]
    gc_share: NotRequired[float]
    gc_samples: NotRequired[int]
    samples: NotRequired[int]
    period_ns: NotRequired[int]
    generation: NotRequired[int | None]
    by_generation: NotRequired[dict[str, int]]
    measured: NotRequired[str]
    running_share: NotRequired[float]
    triggers: NotRequired[list[GcTrigger]]
    host_share: NotRequired[float]
    host_share_of_runnable: NotRequired[float]
    host_samples: NotRequired[int]
    cuda_samples: NotRequired[int]
    gpu_wait_share: NotRequired[float]
    top_frames: NotRequired[list[TopFrame]]
    flame: NotRequired[FlameStacks]
    gpu_idle: NotRequired[IdleFrames]
    reclaim_ns: NotRequired[int]
    # memory_reclaim
    stall_ns: NotRequired[int]
    pages: NotRequired[int]
    by_kind: NotRequired[dict[str, int]]
    limit_bytes: NotRequired[int]
    usage_bytes: NotRequired[int]
    peak_bytes: NotRequired[int]
    limit_hits: NotRequired[int]
    file_bytes: NotRequired[int | None]
    anon_bytes: NotRequired[int | None]
    psi_some_share: NotRequired[float]
    psi_system_share: NotRequired[float]
    cpu_bound_without_reclaim: NotRequired[float]
    # cpu_throttled, memory_reclaim: the cgroup and where it runs (cgroup_samples)
    cgroup: NotRequired[str]
    quota_us: NotRequired[int]
    period_us: NotRequired[int]
    cpus: NotRequired[float]
    throttled_ns: NotRequired[int]
    throttled_share: NotRequired[float]
    throttled_periods: NotRequired[int]
    periods: NotRequired[int]
    throttled_period_share: NotRequired[float]
    members: NotRequired[list[int]]
    container: NotRequired[str]
    container_name: NotRequired[str]
    runtime: NotRequired[str]
    pod: NotRequired[str]
    namespace: NotRequired[str]
    pod_uid: NotRequired[str]
    # cpu_contention: the quota its culprit spends, the time left after throttling,
    # work the victim queued itself
    quota: NotRequired[QuotaFigures]
    quota_share: NotRequired[float]
    throttled_away: NotRequired[bool]
    own_kernel_work: NotRequired[KernelWork]


class EvidenceItem(TypedDict):
    """One piece of evidence: ``kind`` and ``text`` always, then its kind's keys. A
    recorded event (a slow call, an off-CPU interval, a block I/O...) has ``ts_ns``,
    ``time``, ``dur_ns``, ``id`` and ``tid``; one overlapping a spike names it
    (``spike``, the spike's ``id``) and how much of it overlapped; ``culprit``: the task
    that took the time. docs/explain.md lists the kinds."""

    kind: str
    text: str
    ts_ns: NotRequired[int]
    time: NotRequired[str]
    dur_ns: NotRequired[int]
    overlap_ns: NotRequired[int]
    id: NotRequired[str]
    tid: NotRequired[int]
    op: NotRequired[str | None]
    spike: NotRequired[str]
    culprit: NotRequired[Task | None]
    state: NotRequired[str]
    irq: NotRequired[int]
    file: NotRequired[str]
    where: NotRequired[str | None]
    stack: NotRequired[list[str]]
    kernel: NotRequired[str]
    # sleeps: why, on what
    reason: NotRequired[str]
    addr: NotRequired[str]
    fd: NotRequired[int]
    # op statistics (``pid``: the op row's), ratios, read-backs
    pid: NotRequired[int | None]
    count: NotRequired[int]
    total_ns: NotRequired[int | None]
    p50_ns: NotRequired[int | None]
    p99_ns: NotRequired[int | None]
    calls_per_s: NotRequired[float | None]
    stats_from: NotRequired[str]
    launches: NotRequired[int]
    syncs: NotRequired[int]
    launches_per_sync: NotRequired[float]
    late_share: NotRequired[float]
    max_bytes: NotRequired[int]
    rate_outside: NotRequired[float]
    rate_during: NotRequired[float]
    drop: NotRequired[float]
    # dataloader workers
    ns: NotRequired[int]
    pids: NotRequired[list[int]]
    allocations: NotRequired[int]
    pages: NotRequired[int]
    pages_per_s: NotRequired[float]
    # locks, data, pipes
    waits: NotRequired[int]
    lost_ns: NotRequired[int]
    released_ns: NotRequired[int]
    thread: NotRequired[str | None]
    running_share: NotRequired[float | None]
    comm: NotRequired[str | None]
    role: NotRequired[str]
    object: NotRequired[str | None]
    what: NotRequired[str]
    remote: NotRequired[str | None]
    # NCCL errors, GPU gaps, on-CPU samples, memory, kernel work
    ret: NotRequired[int]
    error: NotRequired[str]
    device: NotRequired[int]
    covered_ns: NotRequired[int]
    pauses: NotRequired[list[GcPause]]
    top_frames: NotRequired[list[TopFrame]]
    stalls: NotRequired[int]
    stall_ns: NotRequired[int]
    queued: NotRequired[int]


CHAIN_SHAPES: tuple[type, ...] = (
    Task, ChainDetail, EvidenceItem, TopFrame, IdleFrames, GcTrigger, GcPause, ShadowedChain,
    NcclErrorCount, QuotaFigures, KernelWork, Reader,
)
