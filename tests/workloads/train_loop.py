"""The reference workload: a training-like loop over the REAL CUDA runtime, via ctypes.

Per step: ``--launches`` cudaLaunchKernel calls (grid/block dims given) with
``--cpu-us`` of Python-side CPU work before each, ``--memcpy`` cudaMemcpyAsync
host-to-device copies, optional alloc churn (cudaMalloc/cudaFree), optional host
syncs (a 4-byte cudaMemcpy device-to-host, like ``loss.item()``), optional CUDA
graph calls, then one cudaStreamSynchronize (or cudaDeviceSynchronize). Without a
GPU every call fails fast (35: no driver, 100: no device) and uprobes still fire;
``--gpu-ms`` stands in for device time by waiting until that long after the step's
first launch before the sync returns, as a GPU-bound step would.

Injections: ``--dstate fsync:MB`` writes MB and fsyncs each step (the thread sleeps
in D state waiting for the disk), ``--dstate vfork:N`` spawns /bin/true N times per
step through posix_spawn (the parent waits in D state for the child's exec),
``--dstate lock:PATH`` writes a small step record into the shared file PATH each step
(a writer in another process that holds the file's inode lock keeps it waiting in D
state: tests/workloads/neighbour.py lock-holder), ``--workers N`` forks N
DataLoader-style worker processes named ``dl-worker`` that allocate, fill and hash
fresh buffers without pause (CPU and page-allocation pressure),
``--sleep-ms`` sleeps voluntarily, ``--driver`` also calls libcuda (cuInit,
cuMemAlloc_v2, cuLaunchKernel, cuMemcpyHtoD_v2, cuCtxSynchronize...).

Waits of the job's own making: ``--gil-thread`` starts a pure-Python thread in the same
process (native name ``py-busy``) that computes without pause (``--gil-duty F``: only
for that share of every 10 ms, asleep the rest), so the feeding thread waits for the
interpreter lock; ``--producer-ms MS`` feeds each step from
``--producers N`` worker processes (``dl-producer``) through a ``multiprocessing.Queue``,
each batch costing its producer MS of CPU, so a feeding thread with too few producers
waits for data. ``--touch-mb MB`` stages each step's batch in a fresh MB of host memory
(a ring of 16 buffers given back with MADV_FREE): inside a smaller memory limit the
feeding thread reclaims on every step.

Prints one JSON summary (calls and return codes per op, pid, tids, steps/s, and the
helpers' ids: the busy thread's tid, the worker and producer pids) so tests can compare
recorded counts with calls made, and a diagnosis's culprit with the task injected.
Usable as a library: ``Workload(Config(...)).run()``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import json
import mmap
import os
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CUDA_MEMCPY_HOST_TO_DEVICE = 1
CUDA_MEMCPY_DEVICE_TO_HOST = 2
TOUCH_RING = 16  # --touch-mb: buffers written in turn, so the ring is 16x one batch


def find_cudart() -> str:
    """libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel of this interpreter."""
    roots = {sysconfig.get_paths()["purelib"], *[p for p in sys.path if "site-packages" in p]}
    for root in sorted(roots):
        hits = sorted(glob.glob(os.path.join(root, "nvidia/cuda_runtime/lib/libcudart.so*")))
        if hits:
            return os.path.realpath(hits[0])
    raise FileNotFoundError("libcudart.so not found; pip install nvidia-cuda-runtime-cu12")


def find_libcuda(repo: Path | None = None) -> str | None:
    """libcuda.so.1 unpacked by scripts/fetch-libcuda.sh, if present."""
    base = repo or Path(__file__).resolve().parents[2]
    hits = sorted(glob.glob(str(base / ".venv/libcuda/usr/lib/*/libcuda.so.1")))
    hits += sorted(glob.glob(str(base / ".venv/libcuda/usr/lib/*/nvidia/current/libcuda.so.1")))
    return os.path.realpath(hits[0]) if hits else None


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


@dataclass
class Config:
    steps: int = 100
    duration_s: float = 0.0  # > 0: run until then instead of a step count
    launches: int = 20
    grid: tuple[int, int, int] = (64, 2, 1)
    block: tuple[int, int, int] = (128, 1, 1)
    shared_mem: int = 0
    memcpy: int = 2
    memcpy_bytes: int = 1 << 20
    host_syncs: int = 0
    alloc_churn: int = 0
    graph: bool = False
    device_sync: bool = False
    cpu_us: float = 0.0
    gpu_ms: float = 0.0
    rate: float = 0.0  # target CUDA calls per second (0 = as fast as possible)
    sleep_ms: float = 0.0
    dstate: str = ""  # "fsync:MB" or "vfork:N"
    driver: bool = False
    cudart: str = ""
    libcuda: str = ""
    go_file: str = ""  # wait for this file to exist before the first call
    tmpdir: str = ""
    workers: int = 0  # DataLoader-style worker processes
    worker_mb: int = 4  # buffer each worker allocates and fills per item
    gil_thread: bool = False  # a pure-Python CPU thread beside the feeding thread
    gil_duty: float = 1.0  # the share of every 10 ms that thread computes (1: all of it)
    producer_ms: float = 0.0  # > 0: each step waits for a batch costing a producer this
    producers: int = 1
    kernel: str = ""  # LIB:SYMBOL: launch this exported function (its host stub)
    touch_mb: int = 0  # > 0: write a fresh MiB-sized batch buffer of this size each step


@dataclass
class Summary:
    pid: int
    tid: int
    lib: str
    libcuda: str | None
    steps: int = 0
    elapsed_s: float = 0.0
    steps_per_s: float = 0.0
    calls_per_s: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    returns: dict[str, dict[str, int]] = field(default_factory=dict)
    blocked_s: float = 0.0  # time spent in the D-state injection
    launch_dims: dict[str, list[int]] = field(default_factory=dict)
    gil_tid: int | None = None  # the busy thread (--gil-thread)
    worker_pids: list[int] = field(default_factory=list)  # --workers
    producer_pids: list[int] = field(default_factory=list)  # --producer-ms


class Workload:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.lib_path = cfg.cudart or find_cudart()
        self.rt = ctypes.CDLL(self.lib_path)
        self._declare_runtime()
        self.cu: ctypes.CDLL | None = None
        self.cu_path: str | None = None
        if cfg.driver:
            self.cu_path = cfg.libcuda or find_libcuda()
            if not self.cu_path:
                raise FileNotFoundError("--driver needs libcuda: run scripts/fetch-libcuda.sh")
            self.cu = ctypes.CDLL(self.cu_path)
            self._declare_driver()
        self.calls: Counter[str] = Counter()
        self.returns: defaultdict[str, Counter[int]] = defaultdict(Counter)
        self.blocked_ns = 0
        self._host = (ctypes.c_char * max(cfg.memcpy_bytes, 4))()
        self._lock_fd: int | None = None
        self._workers: list[int] = []
        self._queue: Any = None
        self._stop = threading.Event()
        self._go = threading.Event()
        self._gil: threading.Thread | None = None
        self._gil_tid: list[int] = []  # the busy thread's native id, once it runs
        self._ring: list[mmap.mmap] = []  # --touch-mb's buffers, made on first use
        self._ring_at = 0
        self.worker_pids: list[int] = []
        self.producer_pids: list[int] = []
        self._func = ctypes.c_void_p(ctypes.addressof(self._host))  # any non-null "kernel"
        if cfg.kernel:  # a real function as the kernel: its symbol names the launches
            lib, _, sym = cfg.kernel.rpartition(":")
            self._kernel_lib = ctypes.CDLL(lib)
            self._func = ctypes.c_void_p(ctypes.cast(self._kernel_lib[sym],
                                                     ctypes.c_void_p).value)

    # ---- ctypes declarations ---------------------------------------------------------

    def _declare_runtime(self) -> None:
        rt, P, S = self.rt, ctypes.c_void_p, ctypes.c_size_t
        sig: dict[str, list[Any]] = {
            "cudaLaunchKernel": [P, Dim3, Dim3, P, S, P],
            "cudaMemcpyAsync": [P, P, S, ctypes.c_int, P],
            "cudaMemcpy": [P, P, S, ctypes.c_int],
            "cudaMalloc": [ctypes.POINTER(P), S],
            "cudaFree": [P],
            "cudaStreamSynchronize": [P],
            "cudaDeviceSynchronize": [],
            "cudaStreamBeginCapture": [P, ctypes.c_int],
            "cudaStreamEndCapture": [P, ctypes.POINTER(P)],
            "cudaGraphInstantiate": [ctypes.POINTER(P), P, ctypes.c_ulonglong],
            "cudaGraphLaunch": [P, P],
            "cudaGraphExecDestroy": [P],
            "cudaEventSynchronize": [P],
        }
        for name, args in sig.items():
            fn = getattr(rt, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int

    def _declare_driver(self) -> None:
        assert self.cu is not None
        cu, P, S, U = self.cu, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        sig: dict[str, list[Any]] = {
            "cuInit": [U],
            "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), S],
            "cuLaunchKernel": [P, U, U, U, U, U, U, U, P, P, P],
            "cuMemcpyHtoD_v2": [ctypes.c_uint64, P, S],
            "cuMemcpyDtoH_v2": [P, ctypes.c_uint64, S],
            "cuCtxSynchronize": [],
            "cuStreamSynchronize": [P],
        }
        for name, args in sig.items():
            fn = getattr(cu, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int

    # ---- calls ---------------------------------------------------------------------

    def _rec(self, name: str, ret: int) -> None:
        self.calls[name] += 1
        self.returns[name][ret] += 1

    def launch(self) -> int:
        c = self.cfg
        ret: int = self.rt.cudaLaunchKernel(self._func, Dim3(*c.grid), Dim3(*c.block), None,
                                            c.shared_mem, None)
        self._rec("cudaLaunchKernel", ret)
        return ret

    def tight_loop(self, n: int) -> int:
        """``n`` back-to-back launches; returns elapsed ns (for overhead benchmarks)."""
        fn, func, g, b = self.rt.cudaLaunchKernel, self._func, Dim3(1, 1, 1), Dim3(1, 1, 1)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn(func, g, b, None, 0, None)
        dt = time.perf_counter_ns() - t0
        self.calls["cudaLaunchKernel"] += n
        return dt

    def _cpu(self, us: float) -> None:
        if us <= 0:
            return
        end = time.perf_counter_ns() + int(us * 1000)
        x = 0
        while time.perf_counter_ns() < end:
            x += 1

    def _dstate(self) -> None:
        spec = self.cfg.dstate
        if not spec:
            return
        kind, _, arg = spec.partition(":")
        t0 = time.perf_counter_ns()
        if kind == "fsync":
            mb = int(arg or "4")
            fd, path = tempfile.mkstemp(prefix="fleetd-dstate-", dir=self.cfg.tmpdir or None)
            try:
                chunk = os.urandom(1 << 20)
                for _ in range(mb):
                    os.write(fd, chunk)
                os.fsync(fd)  # waits for the disk, uninterruptibly
            finally:
                os.close(fd)
                os.unlink(path)
        elif kind == "vfork":
            for _ in range(int(arg or "1")):
                pid = os.posix_spawn("/bin/true", ["/bin/true"], os.environ)
                os.waitpid(pid, 0)
        elif kind == "lock":
            if self._lock_fd is None:
                self._lock_fd = os.open(arg, os.O_RDWR | os.O_CREAT, 0o600)
            # A write takes the inode lock; while another process holds it we sleep in D.
            os.pwrite(self._lock_fd, b"step done\n", 0)
        else:
            raise ValueError(f"unknown --dstate {spec!r}: use fsync:MB, vfork:N or lock:PATH")
        self.blocked_ns += time.perf_counter_ns() - t0

    def _driver_step(self) -> None:
        cu = self.cu
        assert cu is not None
        ptr = ctypes.c_uint64(0)
        self._rec_cu("cuMemAlloc_v2", cu.cuMemAlloc_v2(ctypes.byref(ptr), 4096))
        for _ in range(max(1, self.cfg.launches // 4)):
            self._rec_cu("cuLaunchKernel", cu.cuLaunchKernel(
                self._func, 8, 1, 1, 32, 1, 1, 0, None, None, None))
        self._rec_cu("cuMemcpyHtoD_v2", cu.cuMemcpyHtoD_v2(ptr.value, self._host, 4096))
        self._rec_cu("cuMemcpyDtoH_v2", cu.cuMemcpyDtoH_v2(self._host, ptr.value, 4))
        self._rec_cu("cuCtxSynchronize", cu.cuCtxSynchronize())

    def _rec_cu(self, name: str, ret: int) -> None:
        self._rec(name, ret)

    def step(self) -> None:
        c, rt = self.cfg, self.rt
        if self._queue is not None:
            self._queue.get()  # the next batch: waits while the producers are behind
        t_first = time.perf_counter_ns()
        for _ in range(c.alloc_churn):
            p = ctypes.c_void_p()
            self._rec("cudaMalloc", rt.cudaMalloc(ctypes.byref(p), 1 << 20))
            self._rec("cudaFree", rt.cudaFree(p))
        self._touch()
        for _ in range(c.launches):
            self._cpu(c.cpu_us)
            self.launch()
        for _ in range(c.memcpy):
            self._rec("cudaMemcpyAsync", rt.cudaMemcpyAsync(
                None, self._host, c.memcpy_bytes, CUDA_MEMCPY_HOST_TO_DEVICE, None))
        if c.graph:
            g, e = ctypes.c_void_p(), ctypes.c_void_p()
            self._rec("cudaStreamBeginCapture", rt.cudaStreamBeginCapture(None, 0))
            self._rec("cudaStreamEndCapture", rt.cudaStreamEndCapture(None, ctypes.byref(g)))
            self._rec("cudaGraphInstantiate", rt.cudaGraphInstantiate(ctypes.byref(e), g, 0))
            self._rec("cudaGraphLaunch", rt.cudaGraphLaunch(e, None))
            self._rec("cudaGraphExecDestroy", rt.cudaGraphExecDestroy(e))
        for _ in range(c.host_syncs):
            self._rec("cudaMemcpy", rt.cudaMemcpy(self._host, None, 4,
                                                  CUDA_MEMCPY_DEVICE_TO_HOST))
        if self.cu is not None:
            self._driver_step()
        self._dstate()
        if c.sleep_ms > 0:
            time.sleep(c.sleep_ms / 1000)
        if c.gpu_ms > 0:  # the device would still be busy: wait as a sync would
            left = t_first + int(c.gpu_ms * 1e6) - time.perf_counter_ns()
            if left > 0:
                time.sleep(left / 1e9)
        if c.device_sync:
            self._rec("cudaDeviceSynchronize", rt.cudaDeviceSynchronize())
        else:
            self._rec("cudaStreamSynchronize", rt.cudaStreamSynchronize(None))

    def _touch(self) -> None:
        """Stage a batch in host memory: write every page of the next of TOUCH_RING
        buffers, then give it back with MADV_FREE as allocators (jemalloc, tcmalloc) do.
        Lazily freed pages are the kernel's to drop without swap, so under a memory
        limit smaller than the ring each step's charges reclaim the older buffers (in
        this thread, on its time) where an anonymous working set would be OOM-killed."""
        mb = self.cfg.touch_mb
        if mb <= 0:
            return
        if not self._ring:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._ring = [mmap.mmap(-1, mb << 20, flags=flags) for _ in range(TOUCH_RING)]
        buf = self._ring[self._ring_at % TOUCH_RING]
        self._ring_at += 1
        for off in range(0, mb << 20, mmap.PAGESIZE):
            buf[off] = 1
        buf.madvise(mmap.MADV_FREE)

    def calls_per_step(self) -> int:
        c = self.cfg
        n = c.launches + c.memcpy + c.host_syncs + 2 * c.alloc_churn + 1
        return n + (5 if c.graph else 0)

    def start_workers(self, until_s: float) -> None:
        """Fork DataLoader-style workers; they stop at ``until_s`` or when we exit."""
        parent = os.getpid()
        for i in range(self.cfg.workers):
            pid = os.fork()
            if pid == 0:
                try:
                    _worker(parent, i, self.cfg.worker_mb << 20, until_s)
                finally:
                    os._exit(0)
            self._workers.append(pid)
            self.worker_pids.append(pid)

    def start_gil_thread(self) -> None:
        """The GIL-holding thread, idle until :meth:`start_helpers` lets it go: started
        before the go signal, a tracer that attaches in between knows it from the start
        (stacks: it reads the interpreter's thread list when it starts)."""
        if self.cfg.gil_thread and self._gil is None:
            self._gil = threading.Thread(target=_gil_hog, daemon=True, args=(
                self._go, self._stop, self.cfg.gil_duty, self._gil_tid))
            self._gil.start()

    def start_helpers(self, until_s: float) -> None:
        """The GIL-holding thread and the queue producers, when asked for."""
        self.start_gil_thread()
        self._go.set()
        if self.cfg.producer_ms > 0:
            import multiprocessing as mp

            ctx = mp.get_context("fork")
            self._queue = ctx.Queue(maxsize=4)
            for i in range(self.cfg.producers):
                proc = ctx.Process(target=_producer, daemon=True, args=(
                    self._queue, os.getpid(), i, self.cfg.producer_ms, until_s))
                proc.start()
                assert proc.pid is not None
                self._workers.append(proc.pid)
                self.producer_pids.append(proc.pid)

    def stop_workers(self) -> None:
        self._stop.set()
        for pid in self._workers:
            try:
                os.kill(pid, 15)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self._workers.clear()

    def run(self) -> Summary:
        c = self.cfg
        if self.cu is not None:
            self._rec("cuInit", self.cu.cuInit(0))
        self.start_gil_thread()
        if c.go_file:
            while not os.path.exists(c.go_file):
                time.sleep(0.005)
        t0 = time.perf_counter_ns()
        deadline = t0 + int(c.duration_s * 1e9) if c.duration_s > 0 else 0
        until = time.time() + (c.duration_s or 600) + 5
        if c.workers:
            self.start_workers(until)
        self.start_helpers(until)
        try:
            steps = self._loop(t0, deadline)
        finally:
            self.stop_workers()
        elapsed = (time.perf_counter_ns() - t0) / 1e9
        total = sum(self.calls.values())
        return Summary(
            pid=os.getpid(), tid=threading.get_native_id(), lib=self.lib_path,
            libcuda=self.cu_path, steps=steps, elapsed_s=elapsed,
            steps_per_s=steps / elapsed if elapsed else 0.0,
            calls_per_s=total / elapsed if elapsed else 0.0,
            calls=dict(self.calls),
            returns={k: {str(r): n for r, n in v.items()} for k, v in self.returns.items()},
            blocked_s=self.blocked_ns / 1e9,
            launch_dims={"grid": list(c.grid), "block": list(c.block)},
            gil_tid=self._gil_tid[0] if self._gil_tid else None,
            worker_pids=list(self.worker_pids), producer_pids=list(self.producer_pids),
        )


    def _loop(self, t0: int, deadline: int) -> int:
        c = self.cfg
        step_ns = int(self.calls_per_step() / c.rate * 1e9) if c.rate > 0 else 0
        steps = 0
        while (steps < c.steps) if not deadline else (time.perf_counter_ns() < deadline):
            self.step()
            steps += 1
            if step_ns:  # open-loop pacing toward the target call rate
                left = t0 + steps * step_ns - time.perf_counter_ns()
                if left > 0:
                    time.sleep(left / 1e9)
        return steps


def _worker(parent: int, index: int, nbytes: int, until_s: float) -> None:
    """One DataLoader worker: decode-like CPU work on freshly allocated pages, no pause."""
    import hashlib

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, b"dl-worker", 0, 0, 0)  # PR_SET_NAME
    page = b"\x01" * 4096
    while time.time() < until_s and os.getppid() == parent:
        buf = bytearray(nbytes)  # fresh anonymous pages: the kernel allocates on touch
        for off in range(0, nbytes, 4096):
            buf[off:off + 4096] = page
        hashlib.sha256(buf).digest()
        del buf


def _set_thread_name(name: bytes) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME: this thread's comm


def _gil_hog(go: threading.Event, stop: threading.Event, duty: float = 1.0,
             tid: list[int] | None = None) -> None:
    """Pure-Python arithmetic without pause: it holds the interpreter lock except when
    the interpreter makes it let go (every switch interval), as a metrics or logging
    thread doing CPU work in Python would. The interpreter lets go at the inner loop's
    backward jump, so the last line is where it releases the lock (tests assert it).
    ``duty`` < 1: a lighter thread, computing that share of every 10 ms and sleeping
    (the lock let go) for the rest."""
    _set_thread_name(b"py-busy")
    if tid is not None:
        tid.append(threading.get_native_id())
    go.wait()
    if duty < 1.0:
        _gil_pulses(stop, duty)
        return
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x = (x + i * i) % 1_000_003


def _gil_pulses(stop: threading.Event, duty: float, period_ns: int = 10_000_000) -> None:
    """The light busy thread: pure Python for ``duty`` of each period, then asleep."""
    y = 0
    while not stop.is_set():
        until = time.perf_counter_ns() + int(max(0.0, duty) * period_ns)
        while time.perf_counter_ns() < until:
            for j in range(1_000):
                y = (y + j * 3) % 999_983
        time.sleep(max(0.0, 1.0 - duty) * period_ns / 1e9)


def _producer(queue: Any, parent: int, index: int, cost_ms: float, until_s: float) -> None:
    """A data producer: each batch costs ``cost_ms`` of CPU (decoding, augmenting)."""
    _set_thread_name(b"dl-producer")
    batch = bytes(64 * 1024)
    while time.time() < until_s and os.getppid() == parent:
        end = time.perf_counter_ns() + int(cost_ms * 1e6)
        x = 0
        while time.perf_counter_ns() < end:
            x += 1
        queue.put(batch)


def _dims(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.split(",")]
    while len(parts) < 3:
        parts.append(1)
    return (parts[0], parts[1], parts[2])


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--duration", type=float, default=0.0, help="seconds (overrides --steps)")
    p.add_argument("--launches", type=int, default=20, help="kernel launches per step")
    p.add_argument("--grid", type=_dims, default=(64, 2, 1), help="x,y,z")
    p.add_argument("--block", type=_dims, default=(128, 1, 1), help="x,y,z")
    p.add_argument("--shared-mem", type=int, default=0)
    p.add_argument("--memcpy", type=int, default=2, help="cudaMemcpyAsync per step")
    p.add_argument("--memcpy-bytes", type=int, default=1 << 20)
    p.add_argument("--host-syncs", type=int, default=0, help="cudaMemcpy DtoH per step")
    p.add_argument("--alloc-churn", type=int, default=0, help="cudaMalloc+cudaFree per step")
    p.add_argument("--graph", action="store_true", help="CUDA graph calls each step")
    p.add_argument("--device-sync", action="store_true",
                   help="cudaDeviceSynchronize instead of cudaStreamSynchronize")
    p.add_argument("--cpu-us", type=float, default=0.0, help="CPU work before each launch")
    p.add_argument("--gpu-ms", type=float, default=0.0, help="simulated device time per step")
    p.add_argument("--rate", type=float, default=0.0, help="target CUDA calls per second")
    p.add_argument("--sleep-ms", type=float, default=0.0, help="voluntary sleep per step")
    p.add_argument("--dstate", default="", help="fsync:MB or vfork:N per step")
    p.add_argument("--driver", action="store_true", help="also call libcuda")
    p.add_argument("--cudart", default="", help="libcudart path (default: the venv wheel's)")
    p.add_argument("--libcuda", default="", help="libcuda path for --driver")
    p.add_argument("--go-file", default="", help="wait for this file before the first call")
    p.add_argument("--tmpdir", default="", help="directory for --dstate fsync files")
    p.add_argument("--workers", type=int, default=0,
                   help="DataLoader-style worker processes (CPU and page-allocation load)")
    p.add_argument("--worker-mb", type=int, default=4, help="MiB each worker fills per item")
    p.add_argument("--gil-thread", action="store_true",
                   help="a pure-Python CPU thread in this process (interpreter lock waits)")
    p.add_argument("--gil-duty", type=float, default=1.0,
                   help="with --gil-thread: the share of every 10 ms the thread computes")
    p.add_argument("--producer-ms", type=float, default=0.0,
                   help="feed each step through a queue; CPU ms per batch per producer")
    p.add_argument("--producers", type=int, default=1, help="producer processes")
    p.add_argument("--touch-mb", type=int, default=0,
                   help="write a fresh buffer of this many MiB each step (a ring of "
                        f"{TOUCH_RING}, given back with MADV_FREE)")
    p.add_argument("--kernel", default="", metavar="LIB:SYMBOL",
                   help="launch this exported function of LIB as the kernel")
    a = p.parse_args(argv)
    return Config(
        steps=a.steps, duration_s=a.duration, launches=a.launches, grid=a.grid,
        block=a.block, shared_mem=a.shared_mem, memcpy=a.memcpy,
        memcpy_bytes=a.memcpy_bytes, host_syncs=a.host_syncs, alloc_churn=a.alloc_churn,
        graph=a.graph, device_sync=a.device_sync, cpu_us=a.cpu_us, gpu_ms=a.gpu_ms,
        rate=a.rate, sleep_ms=a.sleep_ms, dstate=a.dstate, driver=a.driver,
        cudart=a.cudart, libcuda=a.libcuda, go_file=a.go_file, tmpdir=a.tmpdir,
        workers=a.workers, worker_mb=a.worker_mb, gil_thread=a.gil_thread,
        gil_duty=a.gil_duty,
        producer_ms=a.producer_ms, producers=a.producers, kernel=a.kernel,
        touch_mb=a.touch_mb,
    )


def main(argv: list[str] | None = None) -> int:
    summary = Workload(parse_args(argv)).run()
    print(json.dumps(asdict(summary), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
