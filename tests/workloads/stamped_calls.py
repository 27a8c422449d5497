"""Steady CUDA calls whose times are kept: cudaStreamSynchronize at ``--rate`` calls/s
over the real runtime (without a GPU each call fails fast; the uprobe still fires).
Each call's CLOCK_REALTIME nanoseconds just before and just after it go to ``--out``
(pairs of 8-byte little-endian integers) when the run ends or on SIGTERM, so a test can
say which calls a tracer never stored (tests/stamped.py): the call's stored time lies
between the two, however long this process was kept off the CPU around it."""

from __future__ import annotations

import argparse
import ctypes
import signal
import sys
import time
from array import array
from pathlib import Path

from train_loop import find_cudart


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rt = ctypes.CDLL(find_cudart())
    stamps = array("q")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("ready", flush=True)
    every = 1 / args.rate
    start = time.monotonic()
    n = 0
    while not stop and time.monotonic() - start < args.duration:
        stamps.append(time.time_ns())
        rt.cudaStreamSynchronize(None)
        stamps.append(time.time_ns())
        n += 1
        # Paced from the start, so a stall is caught up rather than lost from the rate.
        time.sleep(max(0.0, start + n * every - time.monotonic()))
    Path(args.out).write_bytes(stamps.tobytes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
