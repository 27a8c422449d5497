"""A pool of read-only SQLite connections, so that queries never run on the event loop.

Each worker thread owns one :class:`SafeDB` (SQLite connections are not shared
between threads). A semaphore caps concurrent queries: a request that cannot get a
slot within a short wait is refused with "busy" instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from fleetd.errors import QueryError
from fleetd.store.guard import Limits, SafeDB

log = logging.getLogger("fleetd.node.readers")
T = TypeVar("T")


class ReaderPool:
    def __init__(
        self, path: Path, limits: Limits, max_concurrent: int = 8, wait_s: float = 2.0
    ) -> None:
        self.path = path
        self.limits = limits
        self.max_concurrent = max_concurrent
        self.wait_s = wait_s
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="fleetd-reader")
        self._slots = asyncio.Semaphore(max_concurrent)
        self._local = threading.local()
        self._all: list[SafeDB] = []
        self._lock = threading.Lock()
        self.busy_refusals = 0

    def _db(self) -> SafeDB:
        db: SafeDB | None = getattr(self._local, "db", None)
        if db is None:
            db = SafeDB(self.path, self.limits)
            self._local.db = db
            with self._lock:
                self._all.append(db)
        return db

    async def run(self, fn: Callable[[SafeDB], T]) -> T:
        """Run ``fn(db)`` on a reader thread, holding one of the concurrency slots."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.wait_s)
        except TimeoutError:
            self.busy_refusals += 1
            raise QueryError(
                f"the node is busy: {self.max_concurrent} queries already running",
                "retry in a moment, or lower the fan-out concurrency",
                code="busy",
            ) from None
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, lambda: fn(self._db()))
        finally:
            self._slots.release()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for db in self._all:
                try:
                    db.close()
                except Exception:  # closing is best effort at shutdown
                    log.debug("closing a reader failed", exc_info=True)
            self._all.clear()
