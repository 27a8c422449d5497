"""The catalogue of sources and operations: one numeric code per traced op.

Codes are stored in ``event_data.op`` (an integer keeps rows small and inserts fast);
the ``ops`` table written from this catalogue lets a user write
``WHERE op = 'cudaLaunchKernel'`` against the ``events`` view. The same codes reach
the BPF programs as ``-DOP_<NAME>=<code>`` cflags, so C and Python cannot drift.

Codes are stable forever: add new ones, never renumber. Each source owns a block of 100.

The op families (launches, syncs, NCCL collectives, the calls...) are defined here too,
each once, by name and code (``Family``); every other module imports them, and the BPF
programs get them as ``FL_OPS_<FAMILY>(op)`` (``c_defines``). docs/schema.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Op:
    code: int
    name: str
    source: str
    kind: str  # call | interval | instant | aggregate
    a0: str | None = None  # what the generic a0/a1 columns mean for this op
    a1: str | None = None


SOURCES: dict[str, str] = {
    "cuda": "CUDA runtime API (libcudart)",
    "graph": "CUDA graph capture and launch (libcudart)",
    "driver": "CUDA driver API (libcuda)",
    "nccl": "NCCL collectives and point-to-point (libnccl)",
    "sched": "scheduler: off-CPU intervals, run-queue waits, wakeups",
    "mem": "page allocation, aggregated in the kernel; reclaim and compaction stalls",
    "block": "block I/O requests",
    "proc": "process lifecycle",
    "irq": "hard and soft interrupts that preempted a traced thread",
    "syscall": "system calls slower than the threshold",
    "cgroup": "a traced process's cgroup: CPU quota and throttling, memory limit, usage and "
              "pressure, from its own accounting",
    "cpu": "on-CPU samples of traced threads (perf CPU clock) and the GC pauses they show",
}

_CUDA = [
    ("cudaLaunchKernel", "grid_threads", "block_threads"),
    ("cudaMemcpy", "kind", None),
    ("cudaMemcpyAsync", "kind", None),
    ("cudaMalloc", None, None),
    ("cudaFree", None, None),
    ("cudaMallocManaged", None, None),
    ("cudaStreamSynchronize", None, None),
    ("cudaDeviceSynchronize", None, None),
    ("cudaEventSynchronize", None, None),
    ("cudaStreamWaitEvent", None, None),
    ("cudaMallocAsync", None, None),
    ("cudaFreeAsync", None, None),
]
_GRAPH = [
    "cudaStreamBeginCapture",
    "cudaStreamEndCapture",
    "cudaGraphInstantiate",
    "cudaGraphLaunch",
    "cudaGraphExecUpdate",
    "cudaGraphExecDestroy",
]
_DRIVER = [
    ("cuLaunchKernel", "grid_threads", "block_threads"),
    ("cuLaunchKernelEx", None, None),
    ("cuMemAlloc_v2", None, None),
    ("cuMemcpyHtoD_v2", None, None),
    ("cuMemcpyDtoH_v2", None, None),
    ("cuMemcpyHtoDAsync_v2", None, None),
    ("cuMemcpyDtoHAsync_v2", None, None),
    ("cuCtxSynchronize", None, None),
    ("cuStreamSynchronize", None, None),
    ("cuGraphLaunch", None, None),
]
# a1 of a collective is the root (broadcast, reduce) or -1; of send/recv the peer rank.
_NCCL = [
    ("ncclAllReduce", "count", "peer"),
    ("ncclBroadcast", "count", "peer"),
    ("ncclReduce", "count", "peer"),
    ("ncclAllGather", "count", "peer"),
    ("ncclReduceScatter", "count", "peer"),
    ("ncclSend", "count", "peer"),
    ("ncclRecv", "count", "peer"),
    # Communicators and groups (codes 407..): rank identity, per docs/schema.md.
    ("ncclCommInitRank", "nranks", "rank"),
    ("ncclCommInitRankConfig", "nranks", "rank"),
    ("ncclCommInitAll", "ndev", None),
    ("ncclCommSplit", "color", "key"),
    ("ncclGroupStart", None, None),
    ("ncclGroupEnd", None, None),
    ("ncclCommDestroy", None, None),
    ("ncclCommAbort", None, None),
]

# The one op only imported traces have: a runtime call fleetd has no probe for.
IMPORTED_CALL = "cuda_api"


def _build() -> list[Op]:
    ops: list[Op] = []
    for i, (name, a0, a1) in enumerate(_CUDA):
        ops.append(Op(100 + i, name, "cuda", "call", a0, a1))
    # Imported traces (nsys, Kineto) hold every runtime call; the ones fleetd does not
    # probe itself keep their real name in the event's args (``args.name``).
    ops.append(Op(190, IMPORTED_CALL, "cuda", "call", "correlation", None))
    for i, name in enumerate(_GRAPH):
        ops.append(Op(200 + i, name, "graph", "call"))
    for i, (name, a0, a1) in enumerate(_DRIVER):
        ops.append(Op(300 + i, name, "driver", "call", a0, a1))
    for i, (name, a0, a1) in enumerate(_NCCL):
        ops.append(Op(400 + i, name, "nccl", "call", a0, a1))
    ops += [
        # peer: who took the CPU when the thread left it; a1: who gave it back.
        Op(500, "off_cpu", "sched", "interval", "prev_state", "ran_before"),
        Op(501, "runq_wait", "sched", "interval", "prev_state", "ran_before"),
        Op(502, "wakeup", "sched", "instant", None, None),
        # Kernel work a traced thread queued for the kernel's workers over an interval:
        # a0 = how many, a1 = the work function (args.function: its name).
        Op(503, "kwork_queued", "sched", "aggregate", "count", "function"),
        Op(600, "page_alloc", "mem", "aggregate", "order", None),
        # A run of one thread's stalls reclaiming at its cgroup's memory limit (memcg),
        # reclaiming for a machine short of memory (direct) or compacting memory for a
        # high-order allocation: bytes = ns stalled in the run, a0 stalls, a1 pages.
        Op(601, "memcg_reclaim", "mem", "interval", "stalls", "pages"),
        Op(602, "direct_reclaim", "mem", "interval", "stalls", "pages"),
        Op(603, "direct_compaction", "mem", "interval", "stalls", "pages"),
        Op(700, "block_io", "block", "interval", "dev", "sector"),
        Op(800, "fork", "proc", "instant", None, None),
        Op(801, "exec", "proc", "instant", None, None),
        Op(802, "exit", "proc", "instant", "exit_code", None),
        Op(900, "hardirq", "irq", "interval", "irq", None),
        Op(901, "softirq", "irq", "interval", "vec", None),
        Op(1000, "syscall", "syscall", "interval", "nr", None),
        # bytes: ns throttled in the interval (cpu.stat); args: cgroup, quota, pod.
        Op(1100, "cpu_throttle", "cgroup", "interval", "throttled_periods", "periods"),
        # bytes: memory in use at the sample; a0: the limit (-1 none); a1: us of memory
        # pressure stall (PSI "some") in the interval (-1 unknown); args: cgroup, pod.
        Op(1101, "mem_cgroup", "cgroup", "interval", "limit", "psi_some_us"),
        # One row per (thread, stack) per interval: a0 samples, a1 of them in the garbage
        # collector, bytes the sampling period (ns); stack: the sampled stack.
        Op(1200, "cpu_sample", "cpu", "aggregate", "samples", "gc_samples"),
        # A run of GC samples of one thread: its start, estimated length, the stack that
        # triggered it; a1 the generation (-1: not known from samples).
        Op(1201, "gc_pause", "cpu", "interval", "samples", "generation"),
    ]
    return ops


OPS: tuple[Op, ...] = tuple(_build())
BY_NAME: dict[str, Op] = {op.name: op for op in OPS}
BY_CODE: dict[int, Op] = {op.code: op for op in OPS}


def op_code(name: str) -> int:
    """The code of an op by name; KeyError for an unknown one."""
    return BY_NAME[name].code


def cflag_name(op: Op) -> str:
    """The C macro name for an op, e.g. ``OP_CUDALAUNCHKERNEL``."""
    return "OP_" + op.name.upper()


# ---- op families ------------------------------------------------------------------------
# Every named set of ops is defined here and only here (tests/unit/test_op_families.py
# fails on a literal set of op names, or an op code compared with a number, anywhere
# else in fleetd/). The BPF programs get each family as FL_OPS_<NAME>(op) (c_defines).


@dataclass(frozen=True, slots=True)
class Family:
    """A named set of ops, by name and by code; ``names``/``codes`` in code order."""

    name: str  # C: FL_OPS_<NAME>(op)
    names: tuple[str, ...]
    codes: tuple[int, ...]
    name_set: frozenset[str]
    code_set: frozenset[int]


def _family(name: str, ops: list[Op]) -> Family:
    ops = sorted(ops, key=lambda op: op.code)
    return Family(name, tuple(op.name for op in ops), tuple(op.code for op in ops),
                  frozenset(op.name for op in ops), frozenset(op.code for op in ops))


def _of(name: str, *names: str) -> Family:
    """A family by op names (KeyError for one the catalogue lacks)."""
    return _family(name, [BY_NAME[n] for n in names])


def _by_source(name: str, sources: tuple[str, ...]) -> Family:
    """Every op of these sources: their blocks of codes (``op < 500`` = the calls)."""
    return _family(name, [op for op in OPS if op.source in sources])


# Code ranges, by source block: the calls of an application into CUDA and NCCL (their
# in-kernel histograms are call latencies), and the CUDA API among them.
CUDA_SOURCES = ("cuda", "graph", "driver")
CALL_SOURCES = (*CUDA_SOURCES, "nccl")
CALLS = _by_source("calls", CALL_SOURCES)
CUDA_CALLS = _by_source("cuda_calls", CUDA_SOURCES)
NCCL = _by_source("nccl", ("nccl",))
# The on-CPU samples and the GC pauses they show: no call, no host wait.
ON_CPU = _by_source("on_cpu", ("cpu",))
# Ops with a duration worth a percentile: calls and host intervals.
TIMED = _family("timed", [op for op in OPS if op.kind in ("call", "interval")])

# CUDA. Kernel launches (their records carry the kernel and its dims); graph launches;
# both together: every launch of GPU work.
KERNEL_LAUNCHES = _of("kernel_launches", "cudaLaunchKernel", "cuLaunchKernel",
                      "cuLaunchKernelEx")
GRAPH_LAUNCHES = _of("graph_launches", "cudaGraphLaunch", "cuGraphLaunch")
LAUNCHES = _of("launches", *KERNEL_LAUNCHES.names, *GRAPH_LAUNCHES.names)
# Copies that only enqueue work; with the kernel launches, the high-rate calls traced at
# entry with their return sampled (probes.ProbeSpec.entry_only). Every other CUDA call is
# always recorded.
ASYNC_COPIES = _of("async_copies", "cudaMemcpyAsync", "cuMemcpyHtoDAsync_v2",
                   "cuMemcpyDtoHAsync_v2")
ENQUEUES = _of("enqueues", *KERNEL_LAUNCHES.names, *ASYNC_COPIES.names)
# Blocking copies that read device memory back (cudaMemcpy of any kind: its a0 says
# which; cuMemcpyDtoH_v2): the host waits for the device's queue to drain.
READBACKS = _of("readbacks", "cudaMemcpy", "cuMemcpyDtoH_v2")
# Calls where the host waits for the device: the explicit syncs and the readbacks.
SYNCS = _of("syncs", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaEventSynchronize", "cuCtxSynchronize", "cuStreamSynchronize",
            *READBACKS.names)
# Allocations and frees outside stream order (cudaMallocAsync/cudaFreeAsync are not in
# it): the calls whose churn after start-up costs.
ALLOCS = _of("allocs", "cudaMalloc", "cudaFree", "cudaMallocManaged", "cuMemAlloc_v2")
# Calls that build a CUDA graph rather than run one: capture, instantiate, update.
GRAPH_BUILDS = _of("graph_builds", "cudaStreamBeginCapture", "cudaStreamEndCapture",
                   "cudaGraphInstantiate", "cudaGraphExecUpdate")

# NCCL. Collectives share one sequence counter per (process, communicator); send and
# recv count per (process, communicator, op, peer).
NCCL_COLLECTIVES = _of("nccl_collectives", "ncclAllReduce", "ncclBroadcast", "ncclReduce",
                       "ncclAllGather", "ncclReduceScatter")
NCCL_P2P = _of("nccl_p2p", "ncclSend", "ncclRecv")
# The op a rank's peer calls to match each point-to-point op.
NCCL_P2P_MATCH: dict[str, str] = {"ncclSend": "ncclRecv", "ncclRecv": "ncclSend"}
# Collectives with a reduction op (x0's high half).
NCCL_REDUCING = _of("nccl_reducing", "ncclAllReduce", "ncclReduce", "ncclReduceScatter")
# Communicator creation from a unique id (its hash names the communicator on every
# rank): a rank that made one but no collective yet sits at seq 0.
NCCL_INITS = _of("nccl_inits", "ncclCommInitRank", "ncclCommInitRankConfig")
# Calls that hand back one new communicator through their first argument (read at the
# return, bpf/common.bpf.c); ncclCommInitAll fills an array and is not followed.
NCCL_COMM_RETURNS = _of("nccl_comm_returns", *NCCL_INITS.names, "ncclCommSplit")
# Every call that creates communicators: a failed one explains the failures after it.
NCCL_COMM_CREATES = _of("nccl_comm_creates", *NCCL_COMM_RETURNS.names, "ncclCommInitAll")
# Calls that end a communicator.
NCCL_COMM_ENDS = _of("nccl_comm_ends", "ncclCommDestroy", "ncclCommAbort")

# Host. A thread's waits for a CPU (the records name who ran before it got one back);
# with wakeups, the scheduler records that name another task (peer).
CPU_WAITS = _of("cpu_waits", "off_cpu", "runq_wait")
SCHED_PEERS = _of("sched_peers", *CPU_WAITS.names, "wakeup")
# Host intervals that hold a thread up: what a slow call or a stall can cite.
HOST_DELAYS = _of("host_delays", *CPU_WAITS.names, "block_io", "hardirq", "softirq")
# A run of reclaim or compaction stalls, by the kind the kernel side keeps (0, 1, 2):
# this order is bpf/host.bpf.c's fl_reclaim_op, not the codes'.
RECLAIM_RUNS_BY_KIND = ("direct_reclaim", "memcg_reclaim", "direct_compaction")
RECLAIM_RUNS = _of("reclaim_runs", *RECLAIM_RUNS_BY_KIND)

FAMILIES: tuple[Family, ...] = (
    CALLS, CUDA_CALLS, NCCL, ON_CPU, TIMED, KERNEL_LAUNCHES, GRAPH_LAUNCHES, LAUNCHES, ASYNC_COPIES,
    ENQUEUES, READBACKS, SYNCS, ALLOCS, GRAPH_BUILDS, NCCL_COLLECTIVES, NCCL_P2P,
    NCCL_REDUCING, NCCL_INITS, NCCL_COMM_RETURNS, NCCL_COMM_CREATES, NCCL_COMM_ENDS,
    CPU_WAITS, SCHED_PEERS, HOST_DELAYS, RECLAIM_RUNS,
)


def family_macro(family: Family) -> str:
    """The C test for a family, e.g. ``FL_OPS_NCCL_P2P(op)``."""
    return f"FL_OPS_{family.name.upper()}"


def c_defines() -> list[str]:
    """The catalogue as C macros (bpf/fleetd.h says how they arrive): ``OP_<NAME>=code``
    per op, and ``FL_OPS_<FAMILY>(op)`` true when ``op`` is in the family."""
    defines = [f"{cflag_name(op)}={op.code}" for op in OPS]
    for f in FAMILIES:
        test = " || ".join(f"(op) == {code}" for code in f.codes)
        defines.append(f"{family_macro(f)}(op)=({test})")
    return defines
