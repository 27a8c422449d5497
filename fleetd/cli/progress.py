"""Progress for long work, on stderr: a live line on a terminal, plain lines elsewhere.

On a terminal (stderr is a tty) a task shows ``fleetd: <what>: <step>... 3 s`` rewritten
in place each second and erased when the task ends, so the result below it stays clean.
In a pipe, a file or a service log, a task that has run :data:`FIRST_S_DEFAULT` seconds
prints ``fleetd: <what>: <step>... 3 s`` as a plain line, then one every
:data:`EVERY_S` seconds and one at each new step, never carriage returns: nothing long
is silent for more than a few seconds, and a quick command prints nothing. ``--quiet``
(or :func:`set_quiet`) silences both. Never on stdout, which holds the answer.

FLEETD_PROGRESS_FIRST_S replaces :data:`FIRST_S_DEFAULT` (0: a plain line at once; the
tests use it to see the lines of a command that is quick on their small files).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from fleetd.printable import printable

TICK_S = 1.0  # a terminal's live line is redrawn this often
EVERY_S = 5.0  # a plain line this often, in a pipe or a log
FIRST_S_DEFAULT = 2.0  # quicker tasks print no plain line at all

_quiet = False


def set_quiet(quiet: bool) -> None:
    """``--quiet``: no progress at all, on a terminal or elsewhere."""
    global _quiet
    _quiet = quiet


def quiet() -> bool:
    return _quiet


def first_s() -> float:
    """How long a task runs before its first plain line (FLEETD_PROGRESS_FIRST_S)."""
    text = os.environ.get("FLEETD_PROGRESS_FIRST_S", "")
    try:
        return max(0.0, float(text)) if text else FIRST_S_DEFAULT
    except ValueError:
        return FIRST_S_DEFAULT


Count = Callable[[], str]


class Progress:
    """One task's line; :meth:`step` names the part now running (``reading``, a check's
    name) and, with ``count``, a running figure read at each redraw (``120,000 events``).
    Both may quote a file or a process's name: shown printable (fleetd.printable), so
    only the line's own ``\\r`` and erase reach the terminal."""

    def __init__(self, what: str, stream: TextIO, live: bool, first: float | None = None
                 ) -> None:
        self.what = printable(what)
        self.first = first_s() if first is None else first
        self.stream = stream
        self.live = live
        self.started = time.monotonic()
        self.current = ""
        self.count: Count | None = None
        self.printed_at: float | None = None  # plain mode: when the last line went out
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.silent = _quiet

    def step(self, what: str, count: Count | None = None) -> None:
        with self.lock:
            self.current = printable(what)
            self.count = count
            # A new step is a line of its own once the task has shown itself.
            self._draw(force=self.live or self.printed_at is not None or self.first == 0)

    def line(self) -> str:
        elapsed = int(time.monotonic() - self.started)
        head = f"fleetd: {self.what}: {self.current}" if self.current else f"fleetd: {self.what}"
        figure = f", {printable(self.count())}" if self.count is not None else ""
        return f"{head}... {elapsed} s{figure}" if elapsed or figure else f"{head}..."

    def _draw(self, force: bool = False) -> None:
        if self.silent:
            return
        now = time.monotonic()
        if self.live:
            self.stream.write(f"\r\x1b[K{self.line()}")
        elif force or (self.printed_at is None and now - self.started >= self.first) or (
                self.printed_at is not None and now - self.printed_at >= EVERY_S):
            self.stream.write(self.line() + "\n")
            self.printed_at = now
        else:
            return
        self.stream.flush()

    def run(self) -> None:
        """The ticker thread: redraw (terminal) or maybe print (elsewhere) each tick."""
        tick = TICK_S if self.live else min(TICK_S, max(0.05, self.first))
        if not self.live and self.first == 0:
            with self.lock:
                self._draw(force=self.printed_at is None)
        while not self.done.wait(tick):
            with self.lock:
                self._draw()

    def erase(self) -> None:
        """The live line goes when the task ends (after the ticker stopped)."""
        if self.live and not self.silent:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


@contextmanager
def task(what: str, out: TextIO | None = None, first_s: float | None = None
         ) -> Iterator[Progress]:
    """Show ``what`` (and the step the body names with :meth:`Progress.step`) while the
    body runs; nothing with ``--quiet``. ``first_s``: seconds before the first plain
    line (default :func:`first_s`; 0 for a task that is always long, like trace's
    start-up)."""
    stream = out if out is not None else sys.stderr
    shown = Progress(what, stream, _tty(stream), first_s)
    if shown.silent:
        yield shown  # steps are taken, never drawn: no ticker started
        return
    if shown.live:
        shown.step("")
    ticker = threading.Thread(target=shown.run, name="fleetd-progress", daemon=True)
    ticker.start()
    try:
        yield shown
    finally:
        shown.done.set()
        ticker.join()
        shown.erase()


@contextmanager
def stage(what: str, out: TextIO | None = None, count: Count | None = None) -> Iterator[None]:
    """A task of one step: ``what`` while the body runs, ``count`` its running figure."""
    with task(what, out) as shown:
        shown.count = count
        yield


def _tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
