"""The agent's reader pool keeps as many threads (each with its own connection: two
fds and a page cache) as queries it ran at once, not more: ThreadPoolExecutor starts
another thread when the one that just finished has not yet marked itself idle, so
queries one after another grew it on a busy node (the soak's thread and fd counts)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from fleetd.node.readers import ReaderPool
from fleetd.store.guard import Limits

from conftest import build_db


def test_queries_one_after_another_keep_one_reader_thread(tmp_path: Path) -> None:
    pool = ReaderPool(build_db(tmp_path / "n.db"), Limits(), max_concurrent=8)

    async def one_by_one() -> None:
        for _ in range(3000):
            await pool.run(lambda db: None)

    try:
        asyncio.run(one_by_one())
        assert pool.threads == 1
    finally:
        pool.close()


def test_queries_at_once_still_get_a_thread_each(tmp_path: Path) -> None:
    pool = ReaderPool(build_db(tmp_path / "n.db"), Limits(), max_concurrent=8, per_client=8)
    together = threading.Barrier(8, timeout=20)  # breaks unless 8 threads run at once

    async def eight_at_once() -> list[int]:
        return await asyncio.gather(*(pool.run(lambda db: together.wait())
                                      for _ in range(8)))

    try:
        assert sorted(asyncio.run(eight_at_once())) == list(range(8))
        assert pool.threads == 8
    finally:
        pool.close()
