"""A pool of read-only SQLite connections, so that queries never run on the event loop.

Each worker thread owns one :class:`SafeDB` (SQLite connections are not shared
between threads). A semaphore caps concurrent queries: a request that cannot get a
slot within a short wait is refused with "busy" instead of queueing without bound.

Fairness: one client (a certificate identity, or an address without one) may hold at
most ``per_client`` of the slots, so a client that sends eight slow queries cannot
make every other client's query wait and fail; its own ninth waits for its own slots.

Light work (``/metrics``' incremental read) has a lane of its own: one more thread with
its own connection, outside the slots, so a scrape never waits behind heavy queries.
Large answers stream (:meth:`ReaderPool.stream`): the reader thread hands chunks to the
loop through a queue of a few chunks, and waits while it is full, so an answer's memory
is a few chunks, however many rows it has.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fleetd.errors import QueryError
from fleetd.store.guard import Limits, SafeDB

log = logging.getLogger("fleetd.node.readers")
T = TypeVar("T")
LOCAL = "local"  # the caller of run() that names no client
STREAM_DEPTH = 4  # chunks a streaming reader may be ahead of the connection
# How often a reader blocked on a full stream queue looks whether its consumer is gone.
STREAM_POLL_S = 0.25


class _Threads(ThreadPoolExecutor):
    """A thread pool that starts a thread only when every thread it has is busy. The
    base class also starts one whenever the thread that just finished a task has not yet
    marked itself idle, a race a busy node's scheduler wins often: one query after
    another, each waiting for the last, took two threads, and a weeks-long agent gained a
    reader (a thread, its connection's two fds and page cache) every so often, up to the
    pool's limit, so its thread and fd counts never held flat."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self._busy = 0  # tasks submitted and not finished
        self._busy_lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._busy_lock:
            self._busy += 1

        def counted() -> T:
            try:
                return fn(*args, **kwargs)
            finally:
                with self._busy_lock:
                    self._busy -= 1

        try:
            return super().submit(counted)
        except BaseException:
            with self._busy_lock:
                self._busy -= 1
            raise

    def _adjust_thread_count(self) -> None:
        if self._busy <= len(self._threads):
            return  # a thread is free or about to be: the task waits for it
        while self._idle_semaphore.acquire(timeout=0):
            pass  # the base class's idle count is not to be trusted (above)
        super()._adjust_thread_count()

    @property
    def threads(self) -> int:
        return len(self._threads)


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
        self._executor = _Threads(max_concurrent, thread_name_prefix="fleetd-reader")
        self._light = _Threads(1, thread_name_prefix="fleetd-light")
        self._slots = asyncio.Semaphore(max_concurrent)
        # Per client: its own semaphore and how many requests use it, so that an idle
        # client's entry is dropped and the table cannot grow with every address seen.
        self._shares: dict[str, tuple[asyncio.Semaphore, int]] = {}
        self._local = threading.local()
        self._all: list[SafeDB] = []
        self._lock = threading.Lock()
        self.busy_refusals = 0

    @property
    def threads(self) -> int:
        """Reader threads started (each with its connection), the light lane's aside."""
        return self._executor.threads

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
        async with self._held(who):
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, lambda: fn(self._db()))

    @asynccontextmanager
    async def _held(self, who: str) -> AsyncIterator[None]:
        """One slot of ``who``'s share and one of the pool's, for the body's time."""
        give_up = asyncio.get_running_loop().time() + self.wait_s
        share = self._share(who)
        try:
            await self._acquire(share, give_up, f"this client already runs {self.per_client} "
                                "queries (its share of the node's readers)")
            try:
                await self._acquire(self._slots, give_up,
                                    f"{self.max_concurrent} queries already running")
                try:
                    yield
                finally:
                    self._slots.release()
            finally:
                share.release()
        finally:
            self._unshare(who)

    async def run_light(self, fn: Callable[[SafeDB], T]) -> T:
        """Run ``fn(db)`` on the light lane: its own thread and connection, no slot.
        Only for fleetd's own small reads (a scrape's new rows), never a client's SQL."""
        return await asyncio.get_running_loop().run_in_executor(
            self._light, lambda: fn(self._db()))

    async def stream(self, fn: Callable[[SafeDB], Generator[Any, None, Any]],
                     who: str = LOCAL) -> AsyncGenerator[tuple[bool, Any], None]:
        """Drive the generator ``fn(db)`` on a reader thread (slots held as by
        :meth:`run`) and yield ``(False, item)`` per item it yields, then
        ``(True, value)`` with what it returned. Its exception is raised here. Closing
        this iterator early stops and closes the generator on its thread."""
        loop = asyncio.get_running_loop()
        async with self._held(who):
            pipe = _Pipe(loop)
            done = loop.run_in_executor(self._executor,
                                        lambda: pipe.produce(lambda: fn(self._db())))
            try:
                while True:
                    kind, value = await pipe.get()
                    if kind == "error":
                        raise value
                    yield kind == "end", value
                    if kind == "end":
                        return
            finally:
                pipe.stop.set()
                # The thread notices within STREAM_POLL_S; its slot is free only once it
                # has closed the statement.
                await asyncio.shield(done)

    async def _acquire(self, sem: asyncio.Semaphore, give_up: float, why: str) -> None:
        if not sem.locked():
            await sem.acquire()  # a free slot: no timer, no task (the common case)
            return
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
        self._light.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for db in self._all:
                try:
                    db.close()
                except Exception:  # closing is best effort at shutdown
                    log.debug("closing a reader failed", exc_info=True)
            self._all.clear()


class _Pipe:
    """From a reader thread to the loop: at most STREAM_DEPTH items in flight. The
    thread waits for room on a semaphore the loop releases as it takes items, so an
    item costs one wake-up of the loop, not a round trip."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.room = threading.Semaphore(STREAM_DEPTH)
        self.stop = threading.Event()

    async def get(self) -> tuple[str, Any]:
        item = await self.queue.get()
        self.room.release()
        return item

    def produce(self, make: Callable[[], Generator[Any, None, Any]]) -> None:
        """On the reader thread: every item of ``make()``, then its end or its error
        (opening the reader's connection included: the loop must never wait for an
        item that cannot come)."""
        try:
            gen = make()
        except BaseException as exc:  # handed to the loop, raised there
            self._put("error", exc)
            return
        try:
            while not self.stop.is_set():
                try:
                    item = next(gen)
                except StopIteration as end:
                    self._put("end", end.value)
                    return
                if not self._put("item", item):
                    return
        except BaseException as exc:  # handed to the loop, raised there
            self._put("error", exc)
        finally:
            gen.close()  # on this thread: the statement belongs to its connection

    def _put(self, kind: str, value: Any) -> bool:
        while not self.room.acquire(timeout=STREAM_POLL_S):
            if self.stop.is_set():  # nobody reads any more
                return False
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed
            return False
        return True
