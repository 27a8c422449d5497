"""A pool of read-only SQLite connections, so that queries never run on the event loop.

Each worker thread owns one :class:`SafeDB` (SQLite connections are not shared
between threads). A semaphore caps concurrent queries: a request that cannot get a
slot within a short wait is refused with "busy" instead of queueing without bound.

Fairness: one client (a certificate identity, or an address without one) may hold at
most ``per_client`` of the slots, so a client that sends eight slow queries cannot
make every other client's query wait and fail; its own ninth waits for its own slots.
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
LOCAL = "local"  # the caller of run() that names no client


def default_share(max_concurrent: int) -> int:
    """Half the slots (at least one): the rest stay free for everyone else."""
    return max(1, max_concurrent // 2)


class ReaderPool:
    def __init__(
        self, path: Path, limits: Limits, max_concurrent: int = 8, wait_s: float = 2.0,
        per_client: int | None = None,
    ) -> None:
        self.path = path
        self.limits = limits
        self.max_concurrent = max_concurrent
        self.per_client = min(max_concurrent, per_client or default_share(max_concurrent))
        self.wait_s = wait_s
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="fleetd-reader")
        self._slots = asyncio.Semaphore(max_concurrent)
        # Per client: its own semaphore and how many requests use it, so that an idle
        # client's entry is dropped and the table cannot grow with every address seen.
        self._shares: dict[str, tuple[asyncio.Semaphore, int]] = {}
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

    def _share(self, who: str) -> asyncio.Semaphore:
        sem, users = self._shares.get(who, (None, 0))
        if sem is None:
            sem = asyncio.Semaphore(self.per_client)
        self._shares[who] = (sem, users + 1)
        return sem

    def _unshare(self, who: str) -> None:
        sem, users = self._shares[who]
        if users <= 1:
            del self._shares[who]
        else:
            self._shares[who] = (sem, users - 1)

    async def run(self, fn: Callable[[SafeDB], T], who: str = LOCAL) -> T:
        """Run ``fn(db)`` on a reader thread, holding one slot of ``who``'s share and one
        of the pool's."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.wait_s
        share = self._share(who)
        try:
            await self._acquire(share, give_up, f"this client already runs {self.per_client} "
                                "queries (its share of the node's readers)")
            try:
                await self._acquire(self._slots, give_up,
                                    f"{self.max_concurrent} queries already running")
                try:
                    return await loop.run_in_executor(self._executor, lambda: fn(self._db()))
                finally:
                    self._slots.release()
            finally:
                share.release()
        finally:
            self._unshare(who)

    async def _acquire(self, sem: asyncio.Semaphore, give_up: float, why: str) -> None:
        left = give_up - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(sem.acquire(), max(0.0, left))
        except TimeoutError:
            self.busy_refusals += 1
            raise QueryError(f"the node is busy: {why}",
                             "retry in a moment, or lower the fan-out concurrency",
                             code="busy") from None

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for db in self._all:
                try:
                    db.close()
                except Exception:  # closing is best effort at shutdown
                    log.debug("closing a reader failed", exc_info=True)
            self._all.clear()
