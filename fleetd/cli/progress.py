"""Progress for long work: a live line on a terminal, a log line elsewhere.

On a terminal (stderr is a tty) a stage shows ``fleetd: <what>... 3 s`` rewritten in
place each second and erased when the stage ends, so the result below it stays clean.
In a pipe, a file or a service log, each stage is one INFO log line (``-v`` shows it),
never carriage returns.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from fleetd.printable import printable

log = logging.getLogger("fleetd.progress")
TICK_S = 1.0


@contextmanager
def stage(what: str, out: TextIO | None = None,
          count: Callable[[], str] | None = None) -> Iterator[None]:
    """Show ``what`` while the body runs; ``count`` adds a running figure to the line
    (``120,000 events``), read each tick. Both may quote a file or a process's name:
    shown printable (fleetd.printable), so only this line's own ``\\r`` and erase
    reach the terminal."""
    what = printable(what)
    stream = out if out is not None else sys.stderr
    if not _tty(stream):
        log.info("%s...", what)
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while True:
            elapsed = int(time.monotonic() - started)
            figure = f", {printable(count())}" if count is not None else ""
            stream.write(f"\r\x1b[Kfleetd: {what}... {elapsed} s{figure}" if elapsed
                         else f"\r\x1b[Kfleetd: {what}...")
            stream.flush()
            if done.wait(TICK_S):
                return

    ticker = threading.Thread(target=tick, name="fleetd-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        stream.write("\r\x1b[K")
        stream.flush()


def _tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
