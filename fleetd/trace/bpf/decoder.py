"""Ring-buffer records -> store rows.

Records are fixed-size (``bpfsrc.REC``), so a batch is decoded with one precompiled
struct; the monotonic start becomes wall-clock UTC through the session's clock map.
Extras that do not fit the generic columns (launch dims, streams, graph handles,
NCCL datatypes) go to the ``args`` side table, only when there is something to say.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from fleetd.store.catalog import (
    BY_NAME,
    CALLS,
    CPU_WAITS,
    KERNEL_LAUNCHES,
    NCCL,
    NCCL_COLLECTIVES,
    NCCL_COMM_ENDS,
    NCCL_INITS,
    NCCL_P2P,
    NCCL_REDUCING,
    OPS,
    SCHED_PEERS,
    op_code,
)
from fleetd.store.schema import EventRow, RecordArgs
from fleetd.store.syscalls import NR
from fleetd.trace.bpf.bpfsrc import PYFRAME, PYSTACK_HEAD, REC, WHY_SLOW
from fleetd.trace.bpf.ringbuf import FAST, FRAME, HDR, Chunk

_LAUNCHES = KERNEL_LAUNCHES.code_set
_NCCL = NCCL.code_set
_CALLS = CALLS.code_set  # a slow one carries its median
_SCHED_PEERS = SCHED_PEERS.code_set
# Off-CPU and run-queue records also name the task that gave the CPU back (a1), with
# its comm in x0..x1.
_RAN_BEFORE = CPU_WAITS.code_set
OP_FORK, OP_EXEC, OP_EXIT = op_code("fork"), op_code("exec"), op_code("exit")
OP_BLOCK = BY_NAME["block_io"].code
OP_OFF_CPU = BY_NAME["off_cpu"].code
OP_WAKEUP = BY_NAME["wakeup"].code
FUTEX_RET = NR["futex"] + 1  # an off-CPU record's ret: the syscall it slept in + 1
# Syscalls whose first argument is an fd worth naming when a thread sleeps in them:
# reads and writes of pipes, sockets, terminals and files (fleetd.trace.enrich.fdpeers).
FD_RETS = frozenset(NR[n] + 1 for n in (
    "read", "write", "readv", "writev", "pread64", "pwrite64", "recvfrom", "sendto",
    "recvmsg", "sendmsg", "recvmmsg", "sendmmsg", "fsync", "fdatasync") if n in NR)
_NCCL_TYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
               "float64", "bfloat16", "fp8e4m3", "fp8e5m2")
_NCCL_REDOPS = ("sum", "prod", "max", "min", "avg")  # ncclRedOp_t 0..4; custom ops beyond
# Collectives and send/recv (their record layout is bpf/nccl.bpf.c's), those with a
# reduction op, communicator creation with an id, and the calls that end a communicator.
_NCCL_CALLS = NCCL_COLLECTIVES.code_set | NCCL_P2P.code_set
_NCCL_REDUCING = NCCL_REDUCING.code_set
_NCCL_INITS = NCCL_INITS.code_set
OP_NCCL_SPLIT = BY_NAME["ncclCommSplit"].code
_NCCL_ENDS = NCCL_COMM_ENDS.code_set
_NCCL_IN_PROGRESS = 7  # ncclInProgress: a non-blocking init hands out its communicator
OP_CUDA_LAUNCH = BY_NAME["cudaLaunchKernel"].code
MAX_LAUNCH_TEXTS = 65536  # finished launch args kept for reuse (cleared when past)

# op code -> names of x0, x1, x3 (x2 is only used by launches); a handle is kept only
# when non-zero, so most records get no args row at all.
_Handle = Literal["event", "ptr", "stream", "graph", "exec"]
_Extra = tuple[_Handle | Literal["mode"] | None, _Handle | None, _Handle | None]
_EXTRAS: dict[int, _Extra] = {}
_EXTRA_NAMES: dict[str, _Extra] = {
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
}
for _name, _x in _EXTRA_NAMES.items():
    _EXTRAS[BY_NAME[_name].code] = _x
# Ops whose records carry nothing beyond the columns (and a slow call's median): the
# bulk decoder's inline case. Every other op takes the reference path.
_PLAIN = frozenset({op.code for op in OPS} - _NCCL - set(_EXTRAS) - _LAUNCHES - _SCHED_PEERS
                   - {OP_BLOCK, OP_FORK, OP_EXEC, OP_EXIT})
# The kinds the bulk decoder handles inline (calls with no extras, launches).
_INLINE = _PLAIN | _LAUNCHES


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
    Python frames read in the kernel, (code object, instruction pointer) innermost first.
    ``pid`` is the process the stack belongs to: the record's own, or for a wakeup the
    waker's."""

    row: int
    pid: int
    native: int
    py: list[tuple[int, int]]
    py_status: int  # FL_PY_* of bpf/fleetd.h


@dataclass
class Batch:
    rows: list[EventRow] = field(default_factory=list)
    # Extras per row: a dict, or the finished JSON text of a launch seen before.
    args: list[tuple[int, RecordArgs | str]] = field(default_factory=list)
    tasks: list[tuple[int, int | None, str | None]] = field(default_factory=list)
    new_tids: list[tuple[int, int]] = field(default_factory=list)  # (tid, pid) first seen
    lifecycle: list[Lifecycle] = field(default_factory=list)
    stacks: list[StackRef] = field(default_factory=list)
    kernels: list[tuple[int, int, int, int]] = field(default_factory=list)  # row, pid, op, func
    kstack_ids: list[tuple[int, int]] = field(default_factory=list)  # (row, kernel stack id)
    futex_waits: list[tuple[int, int, int]] = field(default_factory=list)  # (row, pid, addr)
    fd_waits: list[tuple[int, int, int]] = field(default_factory=list)  # (row, pid, fd)
    # Launches whose finished args may be kept for reuse: (row, launch key).
    launch_keys: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


def _hex(v: int) -> str:
    return f"{v:#x}"


_M64 = (1 << 64) - 1


def nccl_id_hash(unique_id: bytes) -> int:
    """The hash of a 128-byte ``ncclUniqueId`` that the BPF side computes at
    communicator creation (bpf/nccl.bpf.c, fl_nccl_id_hash): FNV-1a over its sixteen
    little-endian 64-bit words, then the splitmix64 finalizer. Stored as 16 hex digits
    (``comm_hash``); equal on every rank that was handed the same id."""
    if len(unique_id) != 128:
        raise ValueError(f"an ncclUniqueId has 128 bytes, not {len(unique_id)}")
    h = 0xCBF29CE484222325
    for i in range(0, 128, 8):
        h = ((h ^ int.from_bytes(unique_id[i:i + 8], "little")) * 0x100000001B3) & _M64
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _M64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _M64
    return h ^ (h >> 31)


def launch_args(x0: int, x1: int, x2: int, x3: int) -> RecordArgs:
    """Unpack the launch extras (layout documented in bpf/cuda.bpf.c)."""
    args: RecordArgs = {
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
        # A peer's (comm, pid) as last written: a peer first seen without its process (the
        # task that ran before a switch) is written again once a wakeup names its pid.
        self._peer_seen: dict[int, tuple[str, int | None]] = {}
        # (pid, communicator handle) -> (comm_hash, rank, nranks), from the traced init
        # that created the handle; collectives on it carry them.
        self.comms: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.records = 0
        self._launch_text: dict[tuple[int, ...], str] = {}

    def forget_gone(self, gone: Callable[[int], bool]) -> int:
        """Drop what is remembered of threads and processes for which ``gone(id)``: the
        memos then hold the live tasks seen, not every task a weeks-long trace ever met
        (a peer is any task on the node that wakes a target), and a reused id is written
        afresh. Returns how many entries went."""
        dead_tids = {t for t in self._tids | self._peer_seen.keys() if gone(t)}
        self._tids -= dead_tids
        for t in dead_tids & self._peer_seen.keys():
            del self._peer_seen[t]
        dead_comms = [k for k in self.comms if gone(k[0])]
        for k in dead_comms:
            del self.comms[k]
        return len(dead_tids) + len(dead_comms)

    def decode(self, blobs: Iterable[bytes]) -> Batch:
        """One record at a time: the reference the bulk decoder is tested against (and
        the path of BCC's per-record callback, where a ring cannot be mapped)."""
        out = Batch()
        unpack, size, to_wall = REC.unpack_from, REC.size, self.to_wall
        for blob in blobs:
            f = unpack(blob)
            self._one(out, to_wall(f[0]), f, blob if len(blob) > size else None)
        self.records += len(out.rows)
        return out

    def decode_bulk(self, chunks: Iterable[Chunk]) -> Batch:
        """Records drained in bulk (:mod:`fleetd.trace.bpf.ringbuf`): the same batch as
        :meth:`decode` gives for the same records, made faster by unpacking each run
        with one ``iter_unpack``, handling the common kinds inline (calls with no
        extras, launches) and reusing the finished args of a launch already seen with
        the same kernel, dims and stream (:meth:`remember_launches`).

        ``to_wall`` is monotonic + an offset that changes only between batches
        (:class:`fleetd.trace.host.clock.ClockMap`), so it is read once per batch."""
        out = Batch()
        off = self.to_wall(0)
        rows, args, kernels, new_tids = out.rows, out.args, out.kernels, out.new_tids
        tids, plain, inline, cache = self._tids, _PLAIN, _INLINE, self._launch_text
        misses = out.launch_keys
        one, unpack, size = self._one, REC.unpack_from, REC.size
        for chunk in chunks:
            raw = chunk.raw
            if not chunk.count:
                f = unpack(raw)
                one(out, f[0] + off, f, raw if len(raw) > size else None)
                continue
            first = len(rows)  # each frame of a run makes one row: row - first = frame
            for (ts, dur, pid, tid, op, ret, nbytes, peer, a0, a1, flags, x0, x1, x2, x3,
                 median, func) in FAST.iter_unpack(raw):
                if op not in inline:
                    one(out, ts + off, unpack(raw, (len(rows) - first) * FRAME + HDR.size),
                        None)
                    continue
                i = len(rows)
                rows.append((ts + off, dur, pid, tid, op, ret, nbytes, peer, a0, a1, 0))
                if tid not in tids:
                    tids.add(tid)
                    new_tids.append((tid, pid))
                if op in plain:
                    if flags & WHY_SLOW and median and op in _CALLS:
                        args.append((i, {"median_ns": median}))
                    continue
                # A launch.
                slow = flags & WHY_SLOW and median
                key = (pid, op, func, x0, x1, x2, x3)
                text = None if slow else cache.get(key)
                if text is not None:
                    args.append((i, text))
                    continue
                if func:
                    kernels.append((i, pid, op, func))
                la = launch_args(x0, x1, x2, x3)
                if slow:
                    la["median_ns"] = median
                else:
                    misses.append((i, key))
                args.append((i, la))
        self.records += len(rows)
        return out

    def remember_launches(self, batch: Batch) -> None:
        """Keep the finished args (kernel name included) of this batch's launches, as
        JSON text, for later launches of the same kernel with the same dims and stream.
        Call after the kernel names are resolved. A driver launch whose kernel has no
        name yet is not kept: its name may be learned later."""
        if not batch.launch_keys:
            return
        cache = self._launch_text
        if len(cache) > MAX_LAUNCH_TEXTS:
            cache.clear()
        by_row = {row: a for row, a in batch.args if isinstance(a, dict)}
        for row, key in batch.launch_keys:
            a = by_row.get(row)
            if a is None:
                continue
            if "kernel" in a or key[1] == OP_CUDA_LAUNCH or not key[2]:
                cache[key] = orjson.dumps(a).decode()

    def _one(self, out: Batch, wall: int, f: tuple[Any, ...], stacked: bytes | None) -> None:
        """One record (the fields of ``REC``) into ``out``; ``stacked``: the whole
        record when its Python frames follow the fixed part."""
        (_, dur, pid, tid, op, ret, nbytes, peer, peer_pid, a0, a1, stack, flags,
         x0, x1, x2, x3, median, func, comm_b) = f
        rows = out.rows
        i = len(rows)
        rows.append((wall, dur, pid, tid, op, ret, nbytes, peer, a0, a1, 0))
        if tid not in self._tids:
            self._tids.add(tid)
            out.new_tids.append((tid, pid))
        if stacked is not None:  # a stacked record: its Python frames follow
            # A wakeup carries its waker's stack: symbolized in the waker's process.
            owner = peer_pid if op == OP_WAKEUP and peer_pid else pid
            out.stacks.append(_stack_ref(i, owner, stack, stacked, REC.size))
        if func and op in _LAUNCHES:
            out.kernels.append((i, pid, op, func))
        args: RecordArgs | None
        if op in _NCCL:
            args = self._nccl(pid, op, ret, a0, a1, x0, x1, x2, x3)
        else:
            args = self._extras(op, x0, x1, x2, x3)
        if flags & WHY_SLOW and median and op in _CALLS:
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
            elif op == OP_OFF_CPU and ret in FD_RETS and 0 <= nbytes < 1 << 31:
                out.fd_waits.append((i, pid, nbytes))
            if op == OP_BLOCK and x0:
                args = {"rw": x0.to_bytes(8, "little").rstrip(b"\0").decode(
                    errors="replace")}
            if op == OP_BLOCK and x1:  # created by pid/tid, queued this long before issue
                args = args or {}
                args["queued_ns"] = x1
        elif op in (OP_FORK, OP_EXEC, OP_EXIT):
            if op != OP_FORK and self._launch_text:
                # A new program (or a pid free for reuse): its launches' addresses
                # may be another kernel's now.
                self._launch_text.clear()
            out.lifecycle.append(Lifecycle(
                op, wall, pid, tid, child=peer,
                exit_code=a0 if (op == OP_EXIT and x0) else None,
                comm=_comm(comm_b)))
        if args:
            out.args.append((i, args))

    def _extras(self, op: int, x0: int, x1: int, x2: int, x3: int) -> RecordArgs | None:
        if op in _LAUNCHES:
            return launch_args(x0, x1, x2, x3)
        names = _EXTRAS.get(op)
        if names is None:
            return None
        args: RecordArgs = {}
        for name, value in zip(names, (x0, x1, x3), strict=True):
            if not (name and value):
                continue
            if name == "mode":
                args["mode"] = value
            else:
                args[name] = _hex(value)
        return args or None

    def _nccl(self, pid: int, op: int, ret: int, a0: int, a1: int, x0: int, x1: int,
              x2: int, x3: int) -> RecordArgs | None:
        """The args of an NCCL record (layout in bpf/nccl.bpf.c; keys in docs/schema.md)."""
        if op in _NCCL_CALLS:
            dtype = x0 & 0xFFFFFFFF
            args: RecordArgs = {
                "dtype": _NCCL_TYPES[dtype] if dtype < len(_NCCL_TYPES) else dtype,
                "comm": _hex(x1),
            }
            if x3:
                args["stream"] = _hex(x3)
            if op in _NCCL_REDUCING:
                redop = x0 >> 32
                args["redop"] = _NCCL_REDOPS[redop] if redop < len(_NCCL_REDOPS) else redop
            if x2:
                args["seq"] = x2
            known = self.comms.get((pid, x1)) if x1 else None
            if known is not None:
                args["comm_hash"], args["rank"], args["nranks"] = known
            return args
        if op in _NCCL_INITS:
            args = {"comm": _hex(x1)}
            if x0:
                args["comm_hash"] = f"{x0:016x}"
                if x1 and ret in (0, _NCCL_IN_PROGRESS):
                    self.comms[(pid, x1)] = (args["comm_hash"], a1, a0)
            return args
        if op == OP_NCCL_SPLIT:
            return {"parent": _hex(x0), "color": a0, "key": a1, "comm": _hex(x1)}
        if op in _NCCL_ENDS:
            self.comms.pop((pid, x1), None)
            return {"comm": _hex(x1)}
        return None  # group start/end, init-all: nothing beyond the columns

    def _peer(self, out: Batch, tid: int, pid: int | None, comm_b: bytes,
              own_pid: int | None) -> None:
        if tid == 0:
            return
        comm = _comm(comm_b)
        if not comm:
            return
        owner = own_pid if own_pid is not None else pid
        seen = self._peer_seen.get(tid)
        known = owner if owner is not None else (seen[1] if seen is not None else None)
        if seen != (comm, known):
            self._peer_seen[tid] = (comm, known)
            out.tasks.append((tid, owner, comm))


def _stack_ref(row: int, pid: int, native: int, blob: bytes, at: int) -> StackRef:
    n, status = PYSTACK_HEAD.unpack_from(blob, at)
    at += PYSTACK_HEAD.size
    n = min(n, (len(blob) - at) // PYFRAME.size)
    frames = [PYFRAME.unpack_from(blob, at + k * PYFRAME.size) for k in range(n)]
    return StackRef(row, pid, native, frames, status)


def _comm(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode(errors="replace")
