"""One rank of tests/workloads/nccl_ranks.py with faults switched on from outside, for
bench/detect.py: before each step's compute the rank reads its fault file (``--fault-file``;
its mtime first, so a step costs one stat) and, while it names a fault, does it in-process:

* ``gc``: a garbage-collection storm: builds cyclic garbage and collects it every step;
* ``loader``: a starved data loader: the step waits for a batch from a loader thread that
  makes one every 150 ms;
* ``disk``: slow disk I/O: writes 4 MiB and fsyncs it every step (``--io-dir``).

Faults outside the process (a CPU hog beside it, a CPU quota, SIGSTOP) need no help here,
but the step's compute is counted in CPU time, not wall time (:func:`_cpu_busy`), so that
they stretch it as they would a real step.
"""

from __future__ import annotations

import gc
import os
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "workloads"))
import nccl_ranks  # noqa: E402

LOADER_MS = 150
DISK_MB = 4


class Faults:
    def __init__(self, path: Path, io_dir: Path) -> None:
        self.path, self.io_dir = path, io_dir
        self.mtime = 0.0
        self.now = ""
        self.batches: queue.Queue[int] = queue.Queue(maxsize=2)
        threading.Thread(target=self._loader, name="loader", daemon=True).start()

    def _loader(self) -> None:
        n = 0
        while True:
            if self.now == "loader":
                time.sleep(LOADER_MS / 1000)
            else:
                time.sleep(0.001)
            n += 1
            self.batches.put(n)

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
        elif self.now == "loader":
            self.batches.get()
        elif self.now == "disk":
            f = self.io_dir / f"rank-{os.getpid()}.bin"
            with f.open("wb") as fh:
                fh.write(os.urandom(DISK_MB << 20))
                fh.flush()
                os.fsync(fh.fileno())
        else:
            while not self.batches.empty():  # a healthy loader is always ahead
                self.batches.get_nowait()


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
