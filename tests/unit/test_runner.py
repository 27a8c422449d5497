"""The one event-loop runner: output written after it ran reaches a slow pipe whole."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import REPO

SCRIPT = """
import sys
from fleetd.runner import run_loop

async def answer() -> int:
    return 7

assert run_loop(answer()) == 7 and run_loop(answer()) == 7  # the same loop, reused
sys.stdout.write("x" * 2_000_000)
sys.stdout.flush()
"""


def test_stdout_after_the_loop_is_not_cut_short() -> None:
    # The reader waits before reading, so the writer blocks on a full pipe: the write
    # that a closed uvloop loop used to interrupt (only 65,536 bytes arrived).
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    time.sleep(0.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert len(out) == 2_000_000
