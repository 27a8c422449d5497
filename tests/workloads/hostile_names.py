"""The reference workload (train_loop.py) with every name it controls made hostile.

A traced process chooses its comm, its threads' names, its argv, its environment and
the names of its Python functions and files; a terminal obeys escape sequences and a
reader trusts line starts. This one picks names that would repaint the terminal's
title (OSC 0), colour text (CSI), ring the bell, move the cursor back (CR) and start a
forged line that reads like one of fleetd's own findings (``[HIGH] cpu_contention``):

* its comm (``prctl(PR_SET_NAME)``, what ``/proc/self/comm`` shows): :data:`COMM`;
* a helper thread named :data:`THREAD` that spins a little every 10 ms;
* the spin before each launch (``--cpu-us``) runs in a function named :data:`FUNC`,
  compiled from a file named :data:`FILE` (so on-CPU samples carry both), and each
  launch is made through another function of that name and file (so the stacks of
  CUDA calls carry them);
* its argv and HOSTNAME are what the caller passes (tests/integration/
  test_hostile_names.py passes :data:`ARG` and :data:`HOSTNAME`).

Every other option is train_loop's. Prints train_loop's JSON summary.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_loop import Workload, parse_args  # noqa: E402

FORGED = "\n[HIGH] cpu_contention"  # a line that reads like one of fleetd's findings
# A comm is at most 15 bytes: an OSC 0 title sequence ended by BEL, then a forged line.
COMM = b"\x1b]0;X\x07\n[HIGH] x"
THREAD = b"\x1b[31mT\r\n[HIGH]"  # a colour, a carriage return, a forged line
FUNC = "spin\x1b[31m\x07\r" + FORGED + " forged\x1b]0;owned\x07\u009b2J"  # C1 CSI too
FILE = "/tmp/evil\x1b[2J" + FORGED + ";x.py"  # a ';' would split a folded frame
ARG = "--label=\x1b]0;argv\x07" + FORGED + " argv"
HOSTNAME = "pod\x1b[5m\x07" + FORGED + " host"

_SPIN = (
    "def spin(us):\n"
    "    end = perf_counter_ns() + int(us * 1000)\n"
    "    x = 0\n"
    "    while perf_counter_ns() < end:\n"
    "        x += 1\n"
    "\n"
    "def through(fn):\n"
    "    return fn()\n"
)


def hostile_functions() -> tuple[Callable[[float], None], Callable[[Callable[[], int]], int]]:
    """The train loop's spin and a plain call-through, both named :data:`FUNC` in a
    file named :data:`FILE`."""
    scope: dict[str, Any] = {"perf_counter_ns": time.perf_counter_ns}
    exec(compile(_SPIN, FILE, "exec"), scope)  # noqa: S102 (our own source)
    for name in ("spin", "through"):
        fn = scope[name]
        fn.__code__ = fn.__code__.replace(co_name=FUNC, co_qualname=FUNC)
    return scope["spin"], scope["through"]


def _name_this_thread(name: bytes) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME: this thread's comm


def _helper(spin: Callable[[float], None], stop: threading.Event) -> None:
    _name_this_thread(THREAD)
    while not stop.wait(0.01):
        spin(1000)


def main(argv: list[str] | None = None) -> int:
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--label")]
    _name_this_thread(COMM)  # the main thread's name is the process's comm
    spin, through = hostile_functions()
    work = Workload(parse_args(args))
    work._cpu = spin  # type: ignore[method-assign,assignment]
    work.launch = functools.partial(through, work.launch)  # type: ignore[method-assign]
    stop = threading.Event()
    helper = threading.Thread(target=_helper, args=(spin, stop), daemon=True)
    helper.start()
    try:
        summary = work.run()
    finally:
        stop.set()
        helper.join()
    print(json.dumps({**asdict(summary), "helper_tid": helper.native_id}, sort_keys=True),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
