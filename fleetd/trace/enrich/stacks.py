"""Stacks: user stacks of CUDA calls, kernel names of launches, and the wait channel
of D-state waits.

A CUDA record that asked for a stack (every call past ``--stack-slow``, 1 in
``--stack-sample`` kept calls) carries a native stack id (the kernel's stack map,
walked by frame pointers) and the Python frames the kernel read from the calling
thread's interpreter frame chain. Here they are symbolized while the process is alive
(:class:`fleetd.trace.enrich.symbols.FunctionSymbols`, :mod:`fleetd.trace.enrich.pyframes`) and
merged
into one list, innermost first: the native frames down to the first one inside the
interpreter, then the Python frames in place of the interpreter's eval frames. Each
distinct list is hashed and stored once in the ``stacks`` table; the event refers to it.
Python frames read ``qualname (/path/file.py:line)``, native ones ``function (lib.so)``.

A launch's kernel is named from its function: ``cudaLaunchKernel``'s host stub by the
process's symbols (demangled), ``cuLaunchKernel``'s ``CUfunction`` by what the driver's
naming calls returned for it (``fl_knames``). The name goes into the event's args.

A D-state switch-out also records its kernel stack; the first frame past the scheduler
is the wait channel (what ``/proc/PID/wchan`` would say at that moment: an inode lock's
``rwsem_down_write_slowpath``, a page's ``folio_wait_bit_common``), kept in the event's
args with the frames above it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
from typing import Any

import orjson

from fleetd.store.caps import cap
from fleetd.store.catalog import BY_NAME
from fleetd.store.writer import BatchWriter
from fleetd.trace.bpf.decoder import Batch, StackRef
from fleetd.trace.enrich import pyframes
from fleetd.trace.enrich.symbols import FunctionSymbols, demangle

log = logging.getLogger("fleetd.trace.enrich.stacks")

OP_CUDA_LAUNCH = BY_NAME["cudaLaunchKernel"].code
PY_DEEPER = 3  # FL_PY_DEEPER: the kernel stopped at FL_PY_FRAMES
MAX_KERNELS = 100_000  # (pid, function) names remembered


def stack_hash(frames: list[str]) -> int:
    """A signed 64-bit content hash (fits SQLite's INTEGER), 0 reserved for none."""
    digest = hashlib.blake2b(orjson.dumps(frames), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


class PythonTargets:
    """Tells the kernel, per target process, how its CPython lays out frames and where
    each of its threads' state is; keeps what could not be followed, once per process."""

    def __init__(self, bpf: Any) -> None:
        self.procs = bpf[b"fl_pyprocs"]
        self.threads = bpf[b"fl_pythreads"]
        self.interps: dict[int, pyframes.Interpreter | None] = {}
        self._mem: dict[int, pyframes.Memory] = {}
        self._tids: dict[int, set[int]] = {}
        self.problems: dict[int, str] = {}  # pid -> why its Python frames are not read

    def refresh(self, pids: list[int]) -> None:
        """(Re)scan the targets' thread lists: new threads get frames from now on."""
        for pid in pids:
            if pid not in self.interps:
                self._add(pid)
            interp = self.interps.get(pid)
            if interp is not None and interp.layout is not None and not interp.problem:
                self._scan(interp)
        for gone in set(self.interps) - set(pids):
            self.forget(gone)

    def _add(self, pid: int) -> None:
        interp = pyframes.find_interpreter(pid)
        self.interps[pid] = interp
        if interp is None:
            return
        if interp.problem or interp.layout is None:
            self.problems[pid] = interp.problem or "unsupported"
            return
        lay = interp.layout
        leaf = self.procs.Leaf()
        leaf.tstate_frame, leaf.cframe_frame = lay.tstate_frame, lay.cframe_frame
        leaf.code, leaf.previous, leaf.instr = lay.frame_code, lay.frame_previous, lay.frame_instr
        leaf.owner, leaf.owner_skip = lay.frame_owner, lay.owner_skip
        self.procs[ctypes.c_uint32(pid)] = leaf
        self._mem[pid] = pyframes.Memory(pid)

    def _scan(self, interp: pyframes.Interpreter) -> None:
        try:
            states = pyframes.thread_states(interp, self._mem[interp.pid])
        except OSError as exc:
            log.debug("threads of pid %d unreadable: %s", interp.pid, exc)
            return
        old = self._tids.get(interp.pid, set())
        for tid, ts in states.items():
            self.threads[ctypes.c_uint32(tid)] = ctypes.c_uint64(ts)
        for tid in old - set(states):
            self._drop_thread(tid)
        self._tids[interp.pid] = set(states)

    def _drop_thread(self, tid: int) -> None:
        with contextlib.suppress(KeyError):
            del self.threads[ctypes.c_uint32(tid)]

    def forget(self, pid: int) -> None:
        for tid in self._tids.pop(pid, set()):
            self._drop_thread(tid)
        if self.interps.pop(pid, None) is not None:
            with contextlib.suppress(KeyError):
                del self.procs[ctypes.c_uint32(pid)]
        mem = self._mem.pop(pid, None)
        if mem is not None:
            mem.close()

    def frames(self, ref: StackRef) -> list[str]:
        interp = self.interps.get(ref.pid)
        mem = self._mem.get(ref.pid)
        if interp is None or mem is None:
            return []
        out = []
        for code, instr in ref.py:
            name = pyframes.frame_name(interp, mem, code, instr)
            out.append(name if name is not None else f"{code:#x} (python)")
        if ref.py_status == PY_DEEPER:
            out.append("... (more Python frames)")
        return out


class StackResolver:
    """Symbolizes, merges and stores the stacks of a batch; counts what it could not."""

    def __init__(self, bpf: Any, python: PythonTargets | None,
                 symbols: FunctionSymbols | None = None) -> None:
        self.bpf = bpf
        self.table = bpf[b"fl_stacks"]
        self.symbols = symbols or FunctionSymbols()
        self.python = python
        self._stored: set[int] = set()
        self.unresolved = 0  # stacked records that ended with no frame at all

    def native(self, stack_id: int, pid: int) -> list[tuple[str, str | None]]:
        """(frame text, file base name) per native frame, innermost first. The walk
        follows frame pointers; code built without them sends it into data (a stack
        address, the heap), and from the first address outside any mapped file on the
        frames are noise: the stack ends there."""
        out: list[tuple[str, str | None]] = []
        for addr in self.table.walk(stack_id):
            name, lib, rel = self.symbols.locate(pid, addr)
            if lib is None:
                break
            out.append((f"{name or hex(rel)} ({lib})", lib))
        return out

    def frames(self, ref: StackRef) -> list[str]:
        native: list[tuple[str, str | None]] = []
        if ref.native >= 0:
            try:
                native = self.native(ref.native, ref.pid)
            except Exception as exc:  # an id the map no longer holds, a process gone
                log.debug("stack %d of pid %d unreadable: %s", ref.native, ref.pid, exc)
        py = self.python.frames(ref) if self.python is not None else []
        return merge(native, py, self._interp_file(ref.pid))

    def _interp_file(self, pid: int) -> str | None:
        interp = self.python.interps.get(pid) if self.python is not None else None
        return interp.path.rsplit("/", 1)[-1] if interp is not None else None

    def resolve(self, batch: Batch, writer: BatchWriter) -> None:
        new: list[tuple[int, list[str]]] = []
        for ref in batch.stacks:
            frames = self.frames(ref)
            if not frames:
                self.unresolved += 1
                continue
            h = stack_hash(frames)
            if h not in self._stored:
                self._stored.add(h)
                new.append((h, frames))
            row = batch.rows[ref.row]
            batch.rows[ref.row] = (*row[:10], h)
        if new:
            writer.add_stacks(new)


def merge(native: list[tuple[str, str | None]], py: list[str],
          interp_file: str | None) -> list[str]:
    """One stack, innermost first: the native frames above the interpreter, then the
    Python frames in place of the interpreter's own (eval loop) frames. Without frame
    pointers the native walk often stops before reaching the interpreter: the Python
    frames then follow the native ones directly."""
    if not py:
        return [text for text, _ in native]
    out = []
    for text, lib in native:
        if interp_file is not None and lib == interp_file:
            break
        out.append(text)
    return out + py


class KernelNames:
    """Puts ``args.kernel`` on launch records: the name of the launched function."""

    def __init__(self, bpf: Any, symbols: FunctionSymbols) -> None:
        self.symbols = symbols
        try:
            self.driver = bpf[b"fl_knames"]
        except KeyError:  # the driver layer is off
            self.driver = None
        self._names: dict[tuple[int, int], str | None] = {}

    def name(self, pid: int, op: int, func: int) -> str | None:
        key = (pid, func)
        if key in self._names:
            return self._names[key]
        if op == OP_CUDA_LAUNCH:
            sym, _ = self.symbols.name(pid, func)
            found = sym
        else:
            found = self._driver_name(pid, func)
        if found is None and op != OP_CUDA_LAUNCH:
            return None  # the naming call may not have been seen yet: ask again later
        # Capped now, not only by the writer: launches reuse their args as finished JSON.
        found = cap("kernel", found) if found is not None else None
        if len(self._names) >= MAX_KERNELS:
            self._names.clear()
        self._names[key] = found
        return found

    def _driver_name(self, pid: int, func: int) -> str | None:
        if self.driver is None:
            return None
        key = self.driver.Key()
        key.handle, key.tgid = func, pid
        try:
            raw = bytes(self.driver[key].name)
        except KeyError:
            return None
        return demangle(raw.split(b"\0", 1)[0].decode(errors="replace"))

    def resolve(self, batch: Batch) -> None:
        if not batch.kernels:
            return
        # Only the launches' own args: building a map of every row's would cost a pass
        # over the whole batch for each one.
        wanted = {row for row, _, _, _ in batch.kernels}
        # (A launch whose args came finished from the decoder's cache has its name.)
        args = {row: a for row, a in batch.args if row in wanted and isinstance(a, dict)}
        for row, pid, op, func in batch.kernels:
            name = self.name(pid, op, func)
            if name is None:
                continue
            if row in args:
                args[row]["kernel"] = name
            else:
                args[row] = {"kernel": name}
                batch.args.append((row, args[row]))


# Scheduler frames sit below every sleep: the wait channel is the first frame past them.
_SCHED_PREFIXES = ("schedule", "__schedule", "io_schedule", "preempt_schedule",
                   "__preempt_schedule", "__cond_resched")
WAIT_FRAMES = 4  # frames kept above the wait channel, innermost first


class WaitChannels:
    """Names the kernel wait of each D-state off-CPU record, once per stack id."""

    def __init__(self, bpf: Any) -> None:
        self.bpf = bpf
        self.table = bpf[b"fl_kstacks"]
        self._cache: dict[int, list[str]] = {}

    def frames(self, stack_id: int) -> list[str]:
        found = self._cache.get(stack_id)
        if found is None:
            names = []
            for addr in self.table.walk(stack_id):
                sym = self.bpf.ksym(addr)
                names.append(sym.decode(errors="replace") if isinstance(sym, bytes) else str(sym))
            found = [n for n in names if not n.startswith(_SCHED_PREFIXES)][:WAIT_FRAMES]
            self._cache[stack_id] = found
        return found

    def resolve(self, batch: Batch) -> None:
        have = {row for row, _ in batch.args}
        for row_i, stack_id in batch.kstack_ids:
            try:
                frames = self.frames(stack_id)
            except Exception as exc:  # an id the map no longer holds
                log.debug("kernel stack %d unreadable: %s", stack_id, exc)
                continue
            if not frames or row_i in have:
                continue
            batch.args.append((row_i, {"wchan": frames[0], "kstack": frames}))
