"""A feeding thread that reads its own mmapped dataset through page faults, optionally
beside a neighbour reading another file of the same disk.

Each step is the reference workload's step (tests/workloads/train_loop.py: the real
CUDA runtime through ctypes) followed by reading ``--pages`` pages of the dataset, a
file of ``--dataset-mb`` MiB mapped with mmap and dropped from the page cache first
(posix_fadvise DONTNEED), at places never read before in the run: every read is a
major fault (the kernel reads around the page; ``--random``: the page alone, as
MADV_RANDOM asks; ``--access read``: the same pages with pread(2) on an fd), and the
thread sleeps in D state (``folio_wait_bit_common``) until
its own read completes. ``--neighbour read`` forks a process named ``disk-reader`` that reads
another file of ``--neighbour-mb`` MiB in the same directory (so the same disk) with
O_DIRECT, ``--chunk-mb`` at a time without pause: the victim's requests queue behind its
requests. ``--neighbour none`` (the default) runs alone.

Prints one JSON summary: pid, tid, the neighbour's pid, steps, faults, the dataset's
path, and the time the loop spent in its page reads. For bench/accuracy.py and
tests/integration/test_io_ownership.py::

    python tests/workloads/own_faults.py --dir /var/tmp --duration 4 --random \
        --neighbour read --chunk-mb 16 [--access read]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_loop import Config, Workload  # noqa: E402  (the workloads' own directory)

PAGE = mmap.PAGESIZE
CHUNK = 1 << 20


def make_file(path: Path, mb: int) -> None:
    """``mb`` MiB of bytes that are not zero (no sparse holes: each page is a real
    block), written once and kept for later runs of the same size."""
    if path.exists() and path.stat().st_size == mb * CHUNK:
        return
    block = bytes(range(256)) * (CHUNK // 256)
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_reader(path: Path, until: float, chunk: int) -> None:
    """The neighbour: O_DIRECT reads of its own file, round and round."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, b"disk-reader", 0, 0, 0)  # PR_SET_NAME
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    size = os.fstat(fd).st_size
    off = 0
    while time.time() < until and os.getppid() > 1:
        n = os.preadv(fd, [buf], off)
        off = off + chunk if n == chunk and off + chunk < size else 0


def start_neighbour(path: Path, seconds: float, chunk: int) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            disk_reader(path, time.time() + seconds, chunk)
        finally:
            os._exit(0)
    return pid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp", help="where the files go (a disk, not tmpfs)")
    p.add_argument("--duration", type=float, default=4.0, help="seconds of training")
    p.add_argument("--neighbour", choices=("none", "read"), default="none",
                   help="read: a disk-reader process reads another file of the same disk")
    p.add_argument("--dataset-mb", type=int, default=256)
    p.add_argument("--neighbour-mb", type=int, default=256)
    p.add_argument("--pages", type=int, default=4, help="dataset pages read per step")
    p.add_argument("--launches", type=int, default=8, help="kernel launches per step")
    p.add_argument("--cpu-us", type=float, default=40.0, help="CPU work before each launch")
    p.add_argument("--access", choices=("mmap", "read"), default="mmap",
                   help="read: os.pread of each page through a file descriptor instead")
    p.add_argument("--random", action="store_true",
                   help="MADV_RANDOM: a page per fault (default: the kernel's read-around)")
    p.add_argument("--chunk-mb", type=int, default=4, help="the neighbour's read size")
    p.add_argument("--go-file", default="", help="wait for this file before the first step")
    a = p.parse_args(argv)
    d = Path(a.dir)
    data = d / f"fleetd-dataset-{a.dataset_mb}.bin"
    make_file(data, a.dataset_mb)
    drop_cache(data)
    neighbour = 0
    if a.neighbour == "read":
        other = d / f"fleetd-neighbour-{a.neighbour_mb}.bin"
        make_file(other, a.neighbour_mb)
        neighbour = start_neighbour(other, a.duration + 30, a.chunk_mb * CHUNK)
    wl = Workload(Config(launches=a.launches, memcpy=1, cpu_us=a.cpu_us))
    fd = os.open(data, os.O_RDONLY)
    view = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    if a.random:
        view.madvise(mmap.MADV_RANDOM)  # one page per fault, no read-around
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # and no readahead for reads
    order = list(range(len(view) // PAGE))
    random.Random(42).shuffle(order)
    while a.go_file and not os.path.exists(a.go_file):
        time.sleep(0.005)
    steps = faults = reading = 0
    deadline = time.perf_counter_ns() + int(a.duration * 1e9)
    checksum = 0
    while time.perf_counter_ns() < deadline and faults + a.pages <= len(order):
        wl.step()
        t0 = time.perf_counter_ns()
        for page in order[faults:faults + a.pages]:
            if a.access == "read":  # a read(2) that waits for the disk, on the fd
                checksum ^= os.pread(fd, 1, page * PAGE + page % PAGE)[0]
            else:
                checksum ^= view[page * PAGE + page % PAGE]  # a major fault
        reading += time.perf_counter_ns() - t0
        faults += a.pages
        steps += 1
    if neighbour:
        os.kill(neighbour, 9)
        os.waitpid(neighbour, 0)
    print(json.dumps({
        "pid": os.getpid(), "tid": threading.get_native_id(), "neighbour_pid": neighbour,
        "steps": steps, "faults": faults, "reading_s": reading / 1e9,
        "dataset": str(data), "checksum": checksum, "calls": dict(wl.calls)},
        sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
