"""The rows the per-node analyzers build, as typed dictionaries: an op row (``fleetd
ops``, docs/explain.md "fleetd ops --format json"), a kernel row (``fleetd ops --by
kernel``), a thread and a process of the time breakdown (docs/explain.md, "A process"),
where a process ran (:class:`Placement`, fleetd.analyze.reading.pods) and the pods
answer (``fleetd pods``, ``GET /api/v1/pods``).

The explain answer holds op and process rows
(:mod:`fleetd.analyze.reading.answers` takes them from here); the column tuples
(:data:`OP_COLUMNS`, :data:`KERNEL_COLUMNS`, the breakdown's columns) are typed as the
rows' own keys, so a reader that picks columns at runtime still reads a known shape.
Only ``typing`` is imported, as for the answers: a client-only install reads these.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

# ---- where a process ran (fleetd.analyze.reading.pods) --------------------------------


class Placement(TypedDict):
    """Where a process ran, when the tracer knew it (fleetd.analyze.reading.pods): the
    keys a victim, a culprit, a process row and an op row gain, after their own."""

    pod: NotRequired[str]
    namespace: NotRequired[str]
    pod_uid: NotRequired[str]
    container: NotRequired[str]


PlacementKey = Literal["pod", "namespace", "pod_uid", "container"]
# In the order pods.fields adds them (the JSON's key order).
PLACEMENT_KEYS: tuple[PlacementKey, ...] = ("pod", "namespace", "pod_uid", "container")


CgroupPlaceKey = Literal["container", "container_name", "runtime", "pod", "namespace",
                         "pod_uid"]


class CgroupPlace(TypedDict):
    """What the tracer stored of where a process or a cgroup runs: process_data's
    placement columns, or a cgroup sample's args (only the ones known, as text)."""

    cgroup: NotRequired[str]
    runtime: NotRequired[str]
    container: NotRequired[str]
    container_name: NotRequired[str]
    pod: NotRequired[str]
    namespace: NotRequired[str]
    pod_uid: NotRequired[str]


# ---- op statistics (fleetd.analyze.pernode.opstats) ------------------------------------


class OpFigures(TypedDict):
    """What an op row and a kernel row both say of their calls: ``pid`` and ``comm`` None
    when summed over processes; ``total_ns`` and the percentiles None where no call was
    timed."""

    node: str
    pid: int | None
    comm: str | None
    op: str
    count: int
    errors: int
    total_ns: int | None
    mean_ns: int | None
    p50_ns: int | None
    p95_ns: int | None
    p99_ns: int | None
    max_ns: int | None
    calls_per_s: float | None
    stats_from: str


class OpRow(Placement, OpFigures):
    """A row of ``fleetd ops``: one op (per process with ``--per-process``);
    ``stats_from``: ``events``, ``histogram``, ``timed_sample`` or ``duty_cycle``. The op
    rows of a pod's selection carry its :class:`Placement`."""

    source: str
    max_exact: bool
    events: int


OpColumn = Literal[
    "node", "pid", "comm", "op", "source", "count", "errors", "total_ns", "mean_ns",
    "p50_ns", "p95_ns", "p99_ns", "max_ns", "max_exact", "calls_per_s", "stats_from",
    "events",
]
OP_COLUMNS: tuple[OpColumn, ...] = (
    "node", "pid", "comm", "op", "source", "count", "errors", "total_ns", "mean_ns",
    "p50_ns", "p95_ns", "p99_ns", "max_ns", "max_exact", "calls_per_s", "stats_from",
    "events",
)


class KernelOpRow(Placement, OpFigures):
    """A row of ``fleetd ops --by kernel``: one kernel name (and process) of the stored
    launches; ``est_calls`` scales its stored count by its op's sampling, and
    ``stats_from`` is ``sample`` when that scaled it, else ``events``. The kernel rows
    of a pod's selection carry its :class:`Placement`."""

    kernel: str
    est_calls: int


KernelColumn = Literal[
    "node", "pid", "comm", "kernel", "op", "count", "est_calls", "errors", "total_ns",
    "mean_ns", "p50_ns", "p95_ns", "p99_ns", "max_ns", "calls_per_s", "stats_from",
]
KERNEL_COLUMNS: tuple[KernelColumn, ...] = (
    "node", "pid", "comm", "kernel", "op", "count", "est_calls", "errors", "total_ns",
    "mean_ns", "p50_ns", "p95_ns", "p99_ns", "max_ns", "calls_per_s", "stats_from",
)


class TopOp(TypedDict):
    """One of a process row's ``top_ops``: the op row's figures a reader needs."""

    op: str
    count: int
    total_ns: int | None
    p50_ns: int | None
    p99_ns: int | None
    stats_from: str


# ---- the time breakdown (fleetd.analyze.pernode.breakdown) -----------------------------


class SyscallOutlier(TypedDict):
    """One of a thread's slowest stored syscalls."""

    id: str  # the event, node:seq
    ts_ns: int
    dur_ns: int
    nr: int
    name: str
    ret: int


class WaitChannel(TypedDict):
    """A kernel function a thread's D-state waits slept in, and their time."""

    wchan: str
    waits: int
    ns: int


# The keys of :class:`TimeSplit`, which a process sums over its threads. The five sleep
# reasons are fleetd.analyze.reading.waits.REASONS + "_ns".
TimeColumn = Literal[
    "running_ns", "runq_ns", "irq_ns", "d_state_ns", "sleeping_ns", "lock_ns", "data_ns",
    "timer_ns", "gpu_sync_ns", "other_ns", "off_cpu_ns", "in_cuda_ns", "reclaim_ns",
    "lock_spin_ns", "switches",
]
SUMMED_COLUMNS: tuple[TimeColumn, ...] = (
    "running_ns", "runq_ns", "irq_ns", "d_state_ns", "sleeping_ns", "lock_ns", "data_ns",
    "timer_ns", "gpu_sync_ns", "other_ns", "off_cpu_ns", "in_cuda_ns", "reclaim_ns",
    "lock_spin_ns", "switches",
)


class TimeSplit(TypedDict):
    """Where wall time went, for a thread and (summed over its threads) a process:
    ``running_ns`` to ``other_ns`` add up to the wall time; ``in_cuda_ns``,
    ``reclaim_ns`` and ``lock_spin_ns`` overlap them; ``switches``: stored off-CPU
    intervals."""

    running_ns: int
    runq_ns: int
    irq_ns: int
    d_state_ns: int
    sleeping_ns: int
    lock_ns: int
    data_ns: int
    timer_ns: int
    gpu_sync_ns: int
    other_ns: int
    off_cpu_ns: int
    in_cuda_ns: int
    reclaim_ns: int
    lock_spin_ns: int
    switches: int


class ThreadRow(TimeSplit):
    """Where one thread's wall time went (docs/explain.md, "A process", ``threads``)."""

    pid: int
    tid: int
    comm: str | None
    thread: str | None
    wall_ns: int
    in_cuda_estimated: bool
    cuda_calls_stored: int
    syscall_outliers: list[SyscallOutlier]
    d_state_wchan: list[WaitChannel]


class HistTotal(TypedDict):
    """An in-kernel histogram's exact totals (every switch, every request)."""

    count: int
    total_ns: int


class PageAllocs(TypedDict):
    count: int
    pages: int


class ProcessTotals(Placement, TimeSplit):
    """A process of the breakdown without its threads and ops: its threads' columns
    summed, the exact in-kernel totals beside them, then its :class:`Placement`."""

    node: str
    pid: int
    comm: str | None
    hist_off_cpu: HistTotal
    hist_runq: HistTotal
    page_allocs: PageAllocs
    block_io: HistTotal


class ProcessRow(ProcessTotals):
    """A process of the breakdown (docs/explain.md, "A process"): its totals, its
    threads and its heaviest ops (``threads`` comes after ``comm`` in the JSON)."""

    threads: list[ThreadRow]
    top_ops: list[TopOp]  # up to 5


# ---- pods (fleetd pods, GET /api/v1/pods) ---------------------------------------------


class PodProcess(Placement):
    """A process that ran in a container or a pod."""

    node: str
    pid: int
    comm: str


class PodGroup(TypedDict):
    """The processes of one pod on one node (a container outside any pod stands for its
    pod); ``namespace`` and ``pod`` None where the tracer did not know them."""

    node: str
    namespace: str | None
    pod: str | None
    pids: list[int]


class PodsAnswer(TypedDict):
    """``fleetd pods --format json``: the processes and, grouped, the pods; ``note``
    when no traced process ran in a container."""

    processes: list[PodProcess]
    pods: list[PodGroup]
    note: NotRequired[str]

