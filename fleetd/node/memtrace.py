"""The agent's memory: where it grows (``FLEETD_MEMTRACE=SECONDS`` in its environment)
and the C heap's free pages given back every minute (:func:`trim_forever`).

For a soak (bench/soak.py) or a node whose ``process_resident_memory_bytes`` climbs:
the agent then traces Python's allocations (tracemalloc, which slows it down, so only
on demand) and every SECONDS logs the source lines whose allocations grew most since
the first look, and the object types whose counts grew. SQLite's and BCC's own memory
is not Python's: a climb that does not show here is theirs (RssAnon against what this
logs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading
import tracemalloc
from collections import Counter
from collections.abc import Callable

from fleetd.errors import ConfigError

log = logging.getLogger("fleetd.node.memtrace")
ENV = "FLEETD_MEMTRACE"
FRAMES = 6  # per allocation: enough to see who called the container that grew
TOP = 10


def start_from_env() -> threading.Thread | None:
    """Start the tracing thread when ``$FLEETD_MEMTRACE`` names a period in seconds."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        every = float(text)
    except ValueError:
        every = 0.0
    if not every > 0:
        raise ConfigError(f"{ENV}={text!r} is not a number of seconds",
                          f"set {ENV} to how often to log memory growth, e.g. 300, or unset it")
    tracemalloc.start(FRAMES)
    thread = threading.Thread(target=_watch, args=(every,), name="fleetd-memtrace",
                              daemon=True)
    thread.start()
    log.warning("%s=%g: tracing Python allocations (slower); growth is logged every %g s",
                ENV, every, every)
    return thread


def _sqlite_bytes() -> Callable[[], int] | None:
    """SQLite's own heap (page caches, statements) of this process, through the library
    the sqlite3 module loaded: outside what tracemalloc sees."""
    name = ctypes.util.find_library("sqlite3")
    try:
        used = ctypes.CDLL(name or "libsqlite3.so.0").sqlite3_memory_used
    except (OSError, AttributeError):
        return None
    used.restype = ctypes.c_int64
    return lambda: int(used())


def _types() -> Counter[str]:
    return Counter(type(o).__name__ for o in gc.get_objects())


def _watch(every: float) -> None:
    first = tracemalloc.take_snapshot()
    types0 = _types()
    sqlite = _sqlite_bytes()
    stop = threading.Event()
    while not stop.wait(every):
        snap = tracemalloc.take_snapshot()
        stats = snap.compare_to(first, "traceback")
        grown = [s for s in stats if s.size_diff > 0][:TOP]
        log.warning("memtrace: %.1f MB traced (%+.1f MB since the first look); SQLite's heap "
                    "%s MB", sum(s.size for s in stats) / 2**20,
                    sum(s.size_diff for s in stats) / 2**20,
                    "?" if sqlite is None else f"{sqlite() / 2**20:.1f}")
        for s in grown:
            where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                                for f in s.traceback)
            log.warning("memtrace: %+9.1f kB %+7d blocks at %s", s.size_diff / 1024,
                        s.count_diff, where)
        more = _types() - types0
        log.warning("memtrace: objects grown by type: %s", more.most_common(TOP))


TRIM_EVERY_S = 60.0


def trim_forever(every: float = TRIM_EVERY_S) -> threading.Thread | None:
    """Every ``every`` seconds, give the C heap's free pages back to the kernel (glibc's
    ``malloc_trim``). Batches are built on one thread and freed on another, and glibc
    keeps what is freed below the top of each heap: without this the agent's resident
    memory rose in steps of about a megabyte every few minutes (bench/soak.py) that no
    Python or SQLite object held. None where the C library has no malloc_trim."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def loop() -> None:
        pause = threading.Event()
        while not pause.wait(every):
            trim(0)

    thread = threading.Thread(target=loop, name="fleetd-trim", daemon=True)
    thread.start()
    return thread
