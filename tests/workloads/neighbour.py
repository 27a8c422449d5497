"""Noisy neighbours for recorded scenarios: processes that are not the workload but slow it.

``hog``: a busy loop (``cpu-hog``), meant to be pinned to the workload's CPU.
``lock-holder PATH``: a sidecar (``stats-sidecar``) that rewrites a large shared file
in a loop; each write holds the file's inode lock for milliseconds, so a workload that
writes to the same file (train_loop.py ``--dstate lock:PATH``) waits in D state until
the sidecar lets go, and the sidecar is the task that wakes it.

Each names itself with prctl(PR_SET_NAME) so the culprit reads well in ``fleetd explain``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import time


def _name(comm: str) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, comm.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def hog(seconds: float, nice: int = 0) -> None:
    _name("cpu-hog")
    if nice:
        os.nice(nice)  # negative: a neighbour with a higher priority (root only)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def lock_holder(path: str, mb: int, seconds: float) -> None:
    _name("stats-sidecar")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    blob = b"s" * (mb << 20)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            os.pwrite(fd, blob, 0)  # one write = the inode lock held for its whole copy
            time.sleep(0.002)  # let the lock go between rewrites, as a periodic dump would
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="kind", required=True)
    h = sub.add_parser("hog", help="busy loop")
    h.add_argument("--seconds", type=float, default=60.0)
    h.add_argument("--nice", type=int, default=0, help="niceness change, e.g. -10")
    lk = sub.add_parser("lock-holder", help="rewrite a shared file, holding its inode lock")
    lk.add_argument("path")
    lk.add_argument("--mb", type=int, default=32)
    lk.add_argument("--seconds", type=float, default=60.0)
    a = p.parse_args(argv)
    if a.kind == "hog":
        hog(a.seconds, a.nice)
    else:
        lock_holder(a.path, a.mb, a.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
