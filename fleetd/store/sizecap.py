"""Keeping a node database's files within ``store.max_bytes``.

The cap is on what an operator sees on disk: the main file and its write-ahead log
(``NAME.db`` + ``NAME.db-wal``). Pruning deletes the oldest rows; their pages are
reused, but the main file never shrinks, so its size is the most data it ever held,
and the WAL beside it holds the frames of the commits since its last reset. The writer
therefore keeps the data below the cap by a headroom: the most one commit added to it
and the largest the WAL has been, both measured on this file. They are maxima, never
lowered: the main file keeps a size once reached, and a flood that comes back brings
its WAL back.

The WAL itself is kept small beside a small cap: SQLite checkpoints it after
:func:`wal_pages` pages and truncates it back to that size after a reset
(``journal_size_limit``) instead of keeping the largest size it ever reached.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from fleetd.store.files import create_private

log = logging.getLogger("fleetd.store.sizecap")
DEFAULT_WAL_BYTES = 4 * 2**20  # SQLite's default checkpoint point (1,000 pages of 4 KiB)
WAL_SHARE = 16  # beside a smaller cap the WAL is checkpointed at a sixteenth of it
MIN_WAL_PAGES = 16
# However large the headroom measured, at least this share of the cap holds data: a cap
# smaller than a few commits would otherwise prune everything.
MIN_DATA_SHARE = 0.5
# Bytes a transaction writes to the WAL per event row it inserts or prunes: about 100
# bytes of data and, measured (tests/unit/test_store_writer.py), two to three times that
# in frames (the table's and the time index's pages, their parents, the free list).
WAL_BYTES_PER_ROW = 300
MIN_ROWS_PER_TXN = 1_000


def wal_bytes(db: Path) -> int:
    """The size of ``db``'s -wal file (0 where there is none)."""
    try:
        return Path(f"{db}-wal").stat().st_size
    except OSError:
        return 0


def on_disk(db: Path) -> int:
    """The database's size on disk as an operator sees it: main file and -wal."""
    try:
        main = db.stat().st_size
    except OSError:
        main = 0
    return main + wal_bytes(db)


def wal_limit_bytes(cap: int) -> int:
    """The WAL size SQLite checkpoints at and truncates back to, for a cap of ``cap``."""
    return min(DEFAULT_WAL_BYTES, cap // WAL_SHARE)


def wal_pages(cap: int, page_size: int) -> int:
    return max(MIN_WAL_PAGES, wal_limit_bytes(cap) // page_size)


def rows_per_txn(cap: int) -> int:
    """Event rows one commit (or one pruning step) may write under a cap of ``cap``: a
    transaction's frames stay in the WAL until it ends, so its size is the WAL's size
    at the least; at most a sixteenth of the cap."""
    return max(MIN_ROWS_PER_TXN, cap // WAL_SHARE // WAL_BYTES_PER_ROW)


@dataclass
class SizeCap:
    """The data size to prune to, so that the files stay within ``cap`` bytes."""

    cap: int
    txn_rows: int  # the most event rows one commit (or pruning step) writes
    commit_bytes: int = 0  # the most one commit added to the used size
    wal_bytes: int = 0  # the largest the -wal file has been
    _floor_told: bool = False

    def __post_init__(self) -> None:
        # Before anything is measured: a WAL at its checkpoint point plus one
        # transaction of the largest size, and a commit of that many rows' data.
        txn = self.txn_rows * WAL_BYTES_PER_ROW
        self.observe(txn // 3, wal_limit_bytes(self.cap) + txn)

    def observe(self, added: int, wal_bytes: int) -> None:
        self.commit_bytes = max(self.commit_bytes, added)
        self.wal_bytes = max(self.wal_bytes, wal_bytes)

    @property
    def headroom(self) -> int:
        return self.commit_bytes + self.wal_bytes

    def target(self) -> int:
        """Bytes of data to keep at most (the used size of the main file)."""
        floor = int(self.cap * MIN_DATA_SHARE)
        target = self.cap - self.headroom
        if target >= floor:
            return target
        if not self._floor_told:
            self._floor_told = True
            log.warning("the database cap of %d bytes is small for this write rate: one "
                        "commit adds up to %d bytes and the write-ahead log reached %d, so "
                        "the files may pass the cap by up to %d bytes; raise "
                        "store.max_bytes (--max-db-bytes)", self.cap, self.commit_bytes,
                        self.wal_bytes, floor - target)
        return floor


# Held beside the database (NAME.db-reserve) and given up when the disk fills.
RESERVE_SUFFIX = "-reserve"
RESERVE_BYTES = 2**20


def hold_reserve(path: Path) -> None:
    """Keep RESERVE_BYTES allocated in ``path`` (created 0600, never through a link);
    best effort: without it pruning on a full disk may fail, and is retried."""
    try:
        fd = create_private(path)
    except FileExistsError:
        return
    except OSError as exc:
        log.debug("no space reserve at %s: %s", path, exc)
        return
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
    except OSError as exc:
        log.debug("no space reserve at %s: %s", path, exc)
        with contextlib.suppress(OSError):
            path.unlink()
    finally:
        os.close(fd)
