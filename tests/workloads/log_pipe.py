"""A training loop that prints every step to stdout, piped to a slow log shipper.

The loop is the reference workload's step (tests/workloads/train_loop.py: the real CUDA
runtime through ctypes) followed by one ``print`` of a log line. Before the first step
it forks the shipper (a process named ``log-shipper``) and points its own stdout at a
pipe the shipper reads: ``--read-bytes`` at a time, sleeping ``--reader-delay`` seconds
after each read (0: it keeps up). Once the pipe is full every write of the loop sleeps
in ``pipe_write`` until the shipper makes room, as a job whose stdout goes to a slow
log collector does. ``--pipe-size`` sets the pipe's buffer (F_SETPIPE_SZ; default: the
kernel's 64 KiB). ``--sink socket``: stdout is a TCP connection over loopback that the
shipper accepted (a remote collector's socket, 4 KiB buffers); ``--sink pty``: a
pseudo-terminal whose master side the shipper reads (a slow SSH terminal).

Prints one JSON summary on the original stdout: pid, tid, the shipper's pid, what
stdout was (``pipe:[INODE]``, ``socket to HOST:PORT``, ``/dev/pts/N``), steps, step
time p50/p99, and the time the loop spent inside its prints. For bench/accuracy.py
and tests/integration/test_peer_waits.py::

    python tests/workloads/log_pipe.py --duration 4 --reader-delay 0.2 --line-bytes 1000 \
        --pipe-size 4096 [--sink socket|pty]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import pty
import socket
import sys
import threading
import time
import tty
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


def _ends(sink: str, pipe_size: int) -> tuple[int, int, str]:
    """(the shipper's end, the job's end, what the job's end is) of a new channel: a
    pipe, a TCP connection over loopback, or a pseudo-terminal (the shipper holds the
    master side, as sshd does for a remote shell)."""
    if sink == "socket":
        with socket.create_server(("127.0.0.1", 0)) as srv:
            job = socket.create_connection(srv.getsockname())
            ship, _ = srv.accept()
        # Small buffers: a collector that reads slowly fills them within a second.
        for sk, opt in ((job, socket.SO_SNDBUF), (ship, socket.SO_RCVBUF)):
            sk.setsockopt(socket.SOL_SOCKET, opt, 4096)
        where = f"socket to 127.0.0.1:{ship.getsockname()[1]}"
        return ship.detach(), job.detach(), where
    if sink == "pty":
        master, slave = pty.openpty()
        tty.setraw(slave)  # no echo or line editing: the bytes go through as written
        return master, slave, os.ttyname(slave)
    r, w = os.pipe()
    if pipe_size:
        fcntl.fcntl(w, F_SETPIPE_SZ, pipe_size)
    return r, w, f"pipe:[{os.fstat(w).st_ino}]"


def start_shipper(read_bytes: int, delay: float, pipe_size: int, sink: str = "pipe"
                  ) -> tuple[int, str]:
    """Fork the shipper on a new pipe (socket, pseudo-terminal) and make it this
    process's stdout; returns (the shipper's pid, what stdout now is: ``pipe:[INODE]``,
    ``socket to HOST:PORT``, ``/dev/pts/N``)."""
    r, w, what = _ends(sink, pipe_size)
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
    return child, what


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
    p.add_argument("--sink", choices=("pipe", "socket", "pty"), default="pipe",
                   help="what stdout is: a pipe, a TCP connection to the shipper (a remote "
                        "collector), or a pseudo-terminal it reads (an SSH session)")
    p.add_argument("--launches", type=int, default=8, help="kernel launches per step")
    p.add_argument("--cpu-us", type=float, default=40.0, help="CPU work before each launch")
    p.add_argument("--go-file", default="", help="wait for this file before the first step")
    a = p.parse_args(argv)
    summary_out = os.fdopen(os.dup(1), "w")
    ship_pid, stdout_is = start_shipper(a.read_bytes, a.reader_delay, a.pipe_size, a.sink)
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
        "stdout": stdout_is, "steps": len(steps), "step_p50_ns": _pct(steps, 0.5),
        "step_p99_ns": _pct(steps, 0.99), "printing_s": printing / 1e9,
        "calls": dict(wl.calls)}, sort_keys=True) + "\n")
    summary_out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
