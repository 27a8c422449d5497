"""Calls of tests/workloads/stamped_calls.py against what a tracer stored of them."""

from __future__ import annotations

import bisect
import signal
import sqlite3
import subprocess
import sys
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import REPO

SLACK_NS = 1_000_000  # the stored time and the workload's readings of one clock


@contextmanager
def running(out: Path, rate: int, duration: int = 900) -> Iterator[subprocess.Popen[str]]:
    """The workload, yielded once it has loaded the runtime (its pid is what to trace);
    stopped with SIGTERM on the way out (it writes its stamps to ``out`` as it goes)."""
    wl = subprocess.Popen([sys.executable, str(REPO / "tests/workloads/stamped_calls.py"),
                           "--rate", str(rate), "--duration", str(duration), "--out",
                           str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert wl.stdout is not None and wl.stdout.readline().strip() == "ready"
        yield wl
    finally:
        wl.send_signal(signal.SIGTERM)
        wl.wait(30)


def calls(out: Path) -> list[tuple[int, int]]:
    """(before, after) wall ns of each call, in the order made."""
    flat = array("q", out.read_bytes())
    return list(zip(flat[::2], flat[1::2], strict=True))


def stored(db: Path, pid: int) -> list[int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return sorted(r[0] for r in c.execute(
            "SELECT ts_ns FROM events WHERE pid = ? AND op = 'cudaStreamSynchronize'", (pid,)))


def made_in(made: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [c for c in made if lo <= c[0] and c[1] <= hi]


def unmatched(made: list[tuple[int, int]], kept: list[int]) -> list[tuple[int, int]]:
    """The calls with no stored event between their two readings."""
    out = []
    for before, after in made:
        i = bisect.bisect_left(kept, before - SLACK_NS)
        if i == len(kept) or kept[i] > after + SLACK_NS:
            out.append((before, after))
    return out
