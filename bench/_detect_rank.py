"""One rank of tests/workloads/nccl_ranks.py with faults switched on from outside, for
bench/detect.py: before each step's compute the rank reads its fault file (``--fault-file``;
its mtime first, so a step costs one stat) and, while it names a fault, does it in-process
(the loader in its loader process):

* ``gc``: a garbage-collection storm: builds cyclic garbage and collects it every step;
* ``loader``: a starved data loader: the step waits for its batch from a loader process
  (a pipe, as a DataLoader worker's queue) that makes one in 150 ms instead of 1 ms;
* ``disk``: slow disk I/O: writes 16 MiB and fsyncs it every step (``--io-dir``), the
  same bytes each time (made once: a fresh ``os.urandom`` per step was megabytes of CPU
  work, a CPU fault on a host short of CPU, not an I/O one).

Faults outside the process (a CPU hog beside it, a CPU quota, SIGSTOP) need no help here,
but the step's compute is counted in CPU time, not wall time (:func:`_cpu_busy`), so that
they stretch it as they would a real step.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "workloads"))
import nccl_ranks  # noqa: E402

LOADER_MS = 150
DISK_MB = 16  # 4 MiB fsynced a step made its rank late by 10% of a step: barely one


class Faults:
    def __init__(self, path: Path, io_dir: Path) -> None:
        self.path, self.io_dir = path, io_dir
        self.mtime = 0.0
        self.now = ""
        self.block = os.urandom(DISK_MB << 20)  # incompressible, made before the job runs
        self.batches, self.requests = _start_loader(path)

    def next_batch(self) -> None:
        """The step's batch from the loader process (a pipe read: the wait a DataLoader
        worker's queue makes), then the next one asked for ahead, as prefetching does."""
        os.read(self.batches, 1)
        os.write(self.requests, b"?")

    def step(self) -> None:
        try:
            m = self.path.stat().st_mtime
        except FileNotFoundError:
            m = 0.0
        if m != self.mtime:
            self.mtime = m
            self.now = self.path.read_text().strip() if m else ""
        if self.now == "gc":
            junk = []
            for i in range(60_000):
                a: list[object] = [i]
                a.append(a)  # a cycle: only the collector frees it
                junk.append(a)
            del junk
            gc.collect()
        elif self.now == "disk":
            f = self.io_dir / f"rank-{os.getpid()}.bin"
            with f.open("wb") as fh:
                fh.write(self.block)
                fh.flush()
                os.fsync(fh.fileno())
        # Every step takes a batch; a healthy loader has it ready, a starved one makes the
        # step wait for it (the fault is the loader's: it reads the same fault file).
        self.next_batch()


def _start_loader(fault_file: Path) -> tuple[int, int]:
    """A data-loader process (forked before NCCL starts, as DataLoader workers are
    separate processes): it serves one batch per request, made in 1 ms, or in LOADER_MS
    while the fault file says ``loader``. (read end of the batches, write end of the
    requests); the first batch is asked for at once."""
    batches_r, batches_w = os.pipe()
    requests_r, requests_w = os.pipe()
    if os.fork() == 0:
        os.close(batches_r)
        os.close(requests_w)
        try:
            _serve(fault_file, requests_r, batches_w)
        finally:
            os._exit(0)
    os.close(batches_w)
    os.close(requests_r)
    os.write(requests_w, b"?")
    return batches_r, requests_w


def _serve(fault_file: Path, requests: int, batches: int) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: go with the rank
    libc.prctl(15, b"loader", 0, 0, 0)  # PR_SET_NAME
    mtime, now = 0.0, ""
    while os.read(requests, 1):
        try:
            m = fault_file.stat().st_mtime
        except FileNotFoundError:
            m = 0.0
        if m != mtime:
            mtime = m
            now = fault_file.read_text().strip() if m else ""
        time.sleep((LOADER_MS if now == "loader" else 1) / 1000)
        os.write(batches, b"b")


def _cpu_busy(ms: float) -> None:
    """``ms`` of this thread's CPU time (nccl_ranks.py's own busy loop counts wall time,
    which a CPU hog or a quota could not stretch: a real step's host work is CPU work)."""
    end = time.thread_time() + ms / 1000.0
    x = 0
    while time.thread_time() < end:
        x += 1


def main() -> int:
    argv = sys.argv[1:]
    fault_file = Path(argv[argv.index("--fault-file") + 1])
    io_dir = Path(argv[argv.index("--io-dir") + 1])
    for flag in ("--fault-file", "--io-dir"):
        i = argv.index(flag)
        del argv[i:i + 2]
    faults = Faults(fault_file, io_dir)

    def step_then_busy(ms: float) -> None:
        faults.step()
        _cpu_busy(ms)

    nccl_ranks._busy = step_then_busy  # the step's compute: where a real step's host work is
    return nccl_ranks.main(argv)


if __name__ == "__main__":
    sys.exit(main())
