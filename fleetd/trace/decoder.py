"""Ring-buffer records -> store rows.

Records are fixed-size (``bpfsrc.REC``), so a batch is decoded with one precompiled
struct; the monotonic start becomes wall-clock UTC through the session's clock map.
Extras that do not fit the generic columns (launch dims, streams, graph handles,
NCCL datatypes) go to the ``args`` side table, only when there is something to say.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fleetd.store.catalog import BY_NAME
from fleetd.store.schema import EventRow
from fleetd.store.syscalls import NR
from fleetd.trace.bpfsrc import PYFRAME, PYSTACK_HEAD, REC

_LAUNCHES = {BY_NAME[n].code for n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")}
_NCCL = {op.code for op in BY_NAME.values() if op.source == "nccl"}
_SCHED_PEERS = {BY_NAME[n].code for n in ("off_cpu", "runq_wait", "wakeup")}
# Off-CPU and run-queue records also name the task that gave the CPU back (a1), with
# its comm in x0..x1.
_RAN_BEFORE = {BY_NAME[n].code for n in ("off_cpu", "runq_wait")}
OP_FORK, OP_EXEC, OP_EXIT = (BY_NAME[n].code for n in ("fork", "exec", "exit"))
OP_BLOCK = BY_NAME["block_io"].code
OP_OFF_CPU = BY_NAME["off_cpu"].code
FUTEX_RET = NR["futex"] + 1  # an off-CPU record's ret: the syscall it slept in + 1
_NCCL_TYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
               "float64", "bfloat16", "fp8e4m3", "fp8e5m2")
WHY_SLOW = 2

# op code -> names of x0, x1, x3 (x2 is only used by launches); a handle is kept only
# when non-zero, so most records get no args row at all.
_EXTRAS: dict[int, tuple[str | None, str | None, str | None]] = {}
for _name, _x in {
    "cudaMemcpyAsync": (None, None, "stream"),
    "cudaStreamSynchronize": (None, None, "stream"),
    "cudaEventSynchronize": ("event", None, None),
    "cudaStreamWaitEvent": ("event", None, "stream"),
    "cudaMallocAsync": (None, None, "stream"),
    "cudaFreeAsync": ("ptr", None, "stream"),
    "cudaFree": ("ptr", None, None),
    "cudaStreamBeginCapture": ("mode", None, "stream"),
    "cudaStreamEndCapture": (None, None, "stream"),
    "cudaGraphInstantiate": (None, "graph", None),
    "cudaGraphLaunch": ("exec", None, "stream"),
    "cudaGraphExecUpdate": ("exec", "graph", None),
    "cudaGraphExecDestroy": ("exec", None, None),
    "cuMemcpyHtoDAsync_v2": (None, None, "stream"),
    "cuMemcpyDtoHAsync_v2": (None, None, "stream"),
    "cuStreamSynchronize": (None, None, "stream"),
    "cuGraphLaunch": ("exec", None, "stream"),
}.items():
    _EXTRAS[BY_NAME[_name].code] = _x


@dataclass
class Lifecycle:
    """A fork/exec/exit seen in the kernel, for the tracer's process bookkeeping."""

    op: int
    ts_ns: int
    pid: int
    tid: int
    child: int = 0
    exit_code: int | None = None
    comm: str = ""


@dataclass(slots=True)
class StackRef:
    """A record that asked for its stack: the native stack id (-1: not walked) and the
    Python frames read in the kernel, (code object, instruction pointer) innermost first."""

    row: int
    pid: int
    native: int
    py: list[tuple[int, int]]
    py_status: int  # FL_PY_* of bpf/fleetd.h


@dataclass
class Batch:
    rows: list[EventRow] = field(default_factory=list)
    args: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    tasks: list[tuple[int, int | None, str | None]] = field(default_factory=list)
    new_tids: list[tuple[int, int]] = field(default_factory=list)  # (tid, pid) first seen
    lifecycle: list[Lifecycle] = field(default_factory=list)
    stacks: list[StackRef] = field(default_factory=list)
    kernels: list[tuple[int, int, int, int]] = field(default_factory=list)  # row, pid, op, func
    kstack_ids: list[tuple[int, int]] = field(default_factory=list)  # (row, kernel stack id)
    futex_waits: list[tuple[int, int, int]] = field(default_factory=list)  # (row, pid, addr)


def _hex(v: int) -> str:
    return f"{v:#x}"


def launch_args(x0: int, x1: int, x2: int, x3: int) -> dict[str, Any]:
    """Unpack the launch extras (layout documented in bpf/cuda.bpf.c)."""
    args: dict[str, Any] = {
        "grid": [x0 & 0xFFFFFFFF, x0 >> 32, x1 & 0xFFFF],
        "block": [x2 & 0xFFFFFFFF, x2 >> 32, (x1 >> 16) & 0xFFFF],
    }
    if x1 >> 32:
        args["shared_mem"] = x1 >> 32
    if x3:
        args["stream"] = _hex(x3)
    return args


class Decoder:
    """Stateful: remembers which tids and peer comms it has already reported."""

    def __init__(self, to_wall: Callable[[int], int]) -> None:
        self.to_wall = to_wall
        self._tids: set[int] = set()
        self._peer_comm: dict[int, str] = {}
        self.records = 0

    def decode(self, blobs: Iterable[bytes]) -> Batch:
        out = Batch()
        rows, unpack, size = out.rows, REC.unpack_from, REC.size
        to_wall = self.to_wall
        for blob in blobs:
            (ts, dur, pid, tid, op, ret, nbytes, peer, peer_pid, a0, a1, stack, flags,
             x0, x1, x2, x3, median, func, comm_b) = unpack(blob)
            i = len(rows)
            rows.append((to_wall(ts), dur, pid, tid, op, ret, nbytes, peer, a0, a1, 0))
            if tid not in self._tids:
                self._tids.add(tid)
                out.new_tids.append((tid, pid))
            if len(blob) > size:  # a stacked record: its Python frames follow
                out.stacks.append(_stack_ref(i, pid, stack, blob, size))
            if func and op in _LAUNCHES:
                out.kernels.append((i, pid, op, func))
            args = self._extras(op, a1, x0, x1, x2, x3)
            if flags & WHY_SLOW and median and op < 500:
                args = args or {}
                args["median_ns"] = median
            if op in _SCHED_PEERS or op == OP_BLOCK:
                self._peer(out, peer if op != OP_BLOCK else tid, peer_pid or None, comm_b,
                           pid if op == OP_BLOCK else None)
                if op in _RAN_BEFORE and a1:
                    self._peer(out, a1, None, (x0 | x1 << 64).to_bytes(16, "little"), None)
                if op == OP_OFF_CPU and x2:  # a D-state wait: its kernel stack, id + 1
                    out.kstack_ids.append((i, x2 - 1))
                if op == OP_OFF_CPU and ret == FUTEX_RET and nbytes:
                    out.futex_waits.append((i, pid, nbytes))
                if op == OP_BLOCK and x0:
                    args = {"rw": x0.to_bytes(8, "little").rstrip(b"\0").decode(
                        errors="replace")}
            elif op in (OP_FORK, OP_EXEC, OP_EXIT):
                out.lifecycle.append(Lifecycle(
                    op, to_wall(ts), pid, tid, child=peer,
                    exit_code=a0 if (op == OP_EXIT and x0) else None,
                    comm=_comm(comm_b)))
            if args:
                out.args.append((i, args))
        self.records += len(rows)
        return out

    def _extras(self, op: int, a1: int, x0: int, x1: int, x2: int,
                x3: int) -> dict[str, Any] | None:
        if op in _LAUNCHES:
            return launch_args(x0, x1, x2, x3)
        if op in _NCCL:
            args: dict[str, Any] = {
                "dtype": _NCCL_TYPES[x0] if x0 < len(_NCCL_TYPES) else int(x0),
                "comm": _hex(x1),
            }
            if x3:
                args["stream"] = _hex(x3)
            return args
        names = _EXTRAS.get(op)
        if names is None:
            return None
        args = {}
        for name, value in zip(names, (x0, x1, x3), strict=True):
            if name and value:
                args[name] = value if name == "mode" else _hex(value)
        return args or None

    def _peer(self, out: Batch, tid: int, pid: int | None, comm_b: bytes,
              own_pid: int | None) -> None:
        if tid == 0:
            return
        comm = _comm(comm_b)
        if comm and self._peer_comm.get(tid) != comm:
            self._peer_comm[tid] = comm
            out.tasks.append((tid, own_pid if own_pid is not None else pid, comm))


def _stack_ref(row: int, pid: int, native: int, blob: bytes, at: int) -> StackRef:
    n, status = PYSTACK_HEAD.unpack_from(blob, at)
    at += PYSTACK_HEAD.size
    n = min(n, (len(blob) - at) // PYFRAME.size)
    frames = [PYFRAME.unpack_from(blob, at + k * PYFRAME.size) for k in range(n)]
    return StackRef(row, pid, native, frames, status)


def _comm(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode(errors="replace")
