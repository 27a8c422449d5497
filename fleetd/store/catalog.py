"""The catalogue of sources and operations: one numeric code per traced op.

Codes are stored in ``event_data.op`` (an integer keeps rows small and inserts fast);
the ``ops`` table written from this catalogue lets a user write
``WHERE op = 'cudaLaunchKernel'`` against the ``events`` view. The same codes reach
the BPF programs as ``-DOP_<NAME>=<code>`` cflags, so C and Python cannot drift.

Codes are stable forever: add new ones, never renumber. Each source owns a block of 100.
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
# Collectives share one sequence counter per (process, communicator); send and recv
# count per (process, communicator, op, peer).
NCCL_COLLECTIVES = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
                    "ncclReduceScatter")
NCCL_P2P = ("ncclSend", "ncclRecv")
NCCL_INITS = ("ncclCommInitRank", "ncclCommInitRankConfig")


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
