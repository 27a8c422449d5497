"""The agent gives the C heap's free pages back (memtrace.trim_forever): memory freed
below the top of glibc's heap stays resident otherwise. A real process fragments its
heap (keeps one 1 kB object in 64 of 100 MB) and reads its RssAnon before and after."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import sys, time
from pathlib import Path
from fleetd.node import memtrace

def anon():
    line = [x for x in Path('/proc/self/status').read_text().splitlines()
            if x.startswith('RssAnon:')][0]
    return int(line.split()[1]) // 1024

blocks = [bytes(1000) + bytes([i % 251]) for i in range(100_000)]  # malloc'd, not pymalloc
kept = blocks[::64]
del blocks
before = anon()
if sys.argv[1] == 'trim':
    assert memtrace.trim_forever(0.05) is not None
time.sleep(0.5)
print(before, anon(), len(kept))
"""


def _run(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    return int(out[0]), int(out[1])


def test_the_trim_thread_gives_freed_heap_pages_back() -> None:
    before, after = _run("keep")
    assert after > before - 10, (before, after)  # freed, yet resident: glibc kept it
    before, after = _run("trim")
    assert after < before - 50, (before, after)  # most of the 100 MB given back
