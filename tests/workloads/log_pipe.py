"""A training loop that prints every step to stdout, piped to a slow log shipper.

The loop is the reference workload's step (tests/workloads/train_loop.py: the real CUDA
runtime through ctypes) followed by one ``print`` of a log line. Before the first step
it forks the shipper (a process named ``log-shipper``) and points its own stdout at a
pipe the shipper reads: ``--read-bytes`` at a time, sleeping ``--reader-delay`` seconds
after each read (0: it keeps up). Once the pipe is full every write of the loop sleeps
in ``pipe_write`` until the shipper makes room, as a job whose stdout goes to a slow
log collector does. ``--pipe-size`` sets the pipe's buffer (F_SETPIPE_SZ; default: the
kernel's 64 KiB).

Prints one JSON summary on the original stdout: pid, tid, the shipper's pid and the
pipe's inode, steps, step time p50/p99, and the time the loop spent inside its prints.
For bench/accuracy.py and tests/integration/test_peer_waits.py::

    python tests/workloads/log_pipe.py --duration 4 --reader-delay 0.05
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_loop import Config, Workload  # noqa: E402  (the workloads' own directory)

F_SETPIPE_SZ = 1031


def _name(comm: bytes) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, comm, 0, 0, 0)  # PR_SET_NAME


def shipper(fd: int, read_bytes: int, delay: float) -> None:
    """The slow reader: a chunk, then a pause, until the writer closes the pipe."""
    _name(b"log-shipper")
    while True:
        try:
            data = os.read(fd, read_bytes)
        except InterruptedError:
            continue
        if not data:
            return
        if delay > 0:
            time.sleep(delay)


def start_shipper(read_bytes: int, delay: float, pipe_size: int) -> tuple[int, int]:
    """Fork the shipper on a new pipe and make the pipe this process's stdout; returns
    (the shipper's pid, the pipe's inode)."""
    r, w = os.pipe()
    if pipe_size:
        fcntl.fcntl(w, F_SETPIPE_SZ, pipe_size)
    child = os.fork()
    if child == 0:  # the shipper: only the read end
        os.close(w)
        try:
            shipper(r, read_bytes, delay)
        finally:
            os._exit(0)
    os.close(r)
    os.dup2(w, 1)
    os.close(w)
    return child, os.fstat(1).st_ino


def _pct(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=4.0, help="seconds of training")
    p.add_argument("--reader-delay", type=float, default=0.05,
                   help="the shipper's pause after each read, seconds (0: it keeps up)")
    p.add_argument("--read-bytes", type=int, default=4096, help="the shipper's read size")
    p.add_argument("--line-bytes", type=int, default=200, help="log line length per step")
    p.add_argument("--pipe-size", type=int, default=0, help="F_SETPIPE_SZ (0: the default)")
    p.add_argument("--launches", type=int, default=8, help="kernel launches per step")
    p.add_argument("--cpu-us", type=float, default=40.0, help="CPU work before each launch")
    p.add_argument("--go-file", default="", help="wait for this file before the first step")
    a = p.parse_args(argv)
    summary_out = os.fdopen(os.dup(1), "w")
    ship_pid, inode = start_shipper(a.read_bytes, a.reader_delay, a.pipe_size)
    wl = Workload(Config(launches=a.launches, memcpy=1, cpu_us=a.cpu_us))
    while a.go_file and not os.path.exists(a.go_file):
        time.sleep(0.005)
    steps: list[int] = []
    printing = 0
    pad = "x" * max(0, a.line_bytes - 60)
    deadline = time.perf_counter_ns() + int(a.duration * 1e9)
    while time.perf_counter_ns() < deadline:
        t0 = time.perf_counter_ns()
        wl.step()
        t1 = time.perf_counter_ns()
        print(f"step {len(steps)} loss {1.0 / (1 + len(steps)):.6f} {pad}", flush=True)
        t2 = time.perf_counter_ns()
        printing += t2 - t1
        steps.append(t2 - t0)
    sys.stdout.flush()
    os.close(1)  # EOF for the shipper (sys.stdout never closes its fd itself)
    os.waitpid(ship_pid, 0)
    summary_out.write(json.dumps({
        "pid": os.getpid(), "tid": threading.get_native_id(), "shipper_pid": ship_pid,
        "pipe_inode": inode, "steps": len(steps), "step_p50_ns": _pct(steps, 0.5),
        "step_p99_ns": _pct(steps, 0.99), "printing_s": printing / 1e9,
        "calls": dict(wl.calls)}, sort_keys=True) + "\n")
    summary_out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
