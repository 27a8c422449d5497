"""Noise for bench/accuracy.py ``--noise``: a node where other work runs, kept off the
victim's CPU, as on a real GPU node whose feeding thread has a core of its own.

One busy loop at normal priority on each noise CPU, and a writer that writes and
fsyncs 4 MiB every 50 ms into a file on the disk the scenarios use (the disk noise of
``busy-node.sh --io``). Everything it starts is killed by pid when the block ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

_BUSY = "while True: pass"
_WRITER = """
import os, sys, time
path = sys.argv[1]
blob = b"n" * (4 << 20)
while True:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, blob)
        os.fsync(fd)
    finally:
        os.close(fd)
    time.sleep(0.05)
"""


@contextmanager
def noise(cpus: Sequence[int], disk: Path) -> Iterator[list[int]]:
    """CPU noise on ``cpus`` and disk noise in ``disk`` (a directory) while the block
    runs; yields the noise processes' pids. The writer runs on ``cpus`` too."""
    procs: list[subprocess.Popen[bytes]] = []
    target = disk / f"fleetd-acc-noise-{os.getpid()}"
    pinned = set(cpus)
    try:
        for cpu in cpus:
            procs.append(subprocess.Popen([sys.executable, "-c", _BUSY],
                                          preexec_fn=lambda c=cpu: os.sched_setaffinity(0, {c})))
        procs.append(subprocess.Popen([sys.executable, "-c", _WRITER, str(target)],
                                      preexec_fn=lambda: os.sched_setaffinity(0, pinned)))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            with suppress(subprocess.TimeoutExpired):
                p.wait(10)
        target.unlink(missing_ok=True)

