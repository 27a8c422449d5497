"""The agent's Parquet lake: a segment closed every interval, old ones retired.

Every ``every_s`` seconds a thread reads what the node's database gained since the
last segment (events, GPU activity and annotations by row key; sessions, chains and the
snapshot tables whole: they are small and change in place) and writes it into the lake
through :mod:`fleetd.store.lake`: each file under a temporary name, fsynced, renamed.
A crash loses at most the open segment; a reader never sees half a file.

Where the last segment ended is kept in ``_state/`` and also read back from the closed
files themselves (the row-key statistics of their footers), so a state file lost in a
crash costs nothing: the segment after it is rewritten under the same name, replacing
it, never duplicating its rows. The node's SQLite keeps its own size limit; the lake's
retention (by age of the date partition, then by total size, oldest first) is separate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetd.errors import FleetdError
from fleetd.security.private_dir import UnsafePathError, open_regular
from fleetd.store.db import open_reader
from fleetd.store.lake import (
    KEYED,
    SEQ_MASK,
    TABLES,
    Retention,
    apply_retention,
    chunks,
    clean_temporaries,
    escape_value,
    init_lake,
    key_span,
    lake_files,
    read_node,
    write_bytes,
    write_node,
)
from fleetd.store.lakefs import read_small

log = logging.getLogger("fleetd.node.lake")

STATE_DIR = "_state"
STATE_MAX_BYTES = 64 * 1024  # a few keys of JSON

@dataclass(slots=True)
class LakeSettings:
    root: Path
    every_s: float = 600.0
    retention: Retention = field(default_factory=Retention)


@dataclass(slots=True)
class LakeStats:
    segments: int = 0
    rows: int = 0
    removed_files: int = 0
    last_error: str | None = None
    last_closed_ns: int | None = None


class SegmentCloser:
    """Closes one node's segments into the lake. Runs on a worker thread."""

    def __init__(self, settings: LakeSettings, db: Path, node: str) -> None:
        self.s = settings
        self.db = db
        self.node = node
        self.stats = LakeStats()
        init_lake(settings.root)
        # A temporary file of this node is a segment a killed agent never closed.
        clean_temporaries(settings.root, node, older_than_s=0)
        self._state_name = f"agent-{escape_value(node)}.json"
        self.after = self._recover()

    def _recover(self) -> dict[str, int]:
        """Where the last closed segment ended: the larger of the state file and the
        closed files' own row keys, per table. The state file is read only when it is a
        small regular file in the lake's own ``_state`` directory (a link or a FIFO
        there is ignored: the closed files still say where to go on)."""
        after = dict.fromkeys(KEYED, 0)
        try:
            raw = read_small(self.s.root, (STATE_DIR,), self._state_name, STATE_MAX_BYTES)
            saved = json.loads(raw)
            for k in KEYED:
                after[k] = max(after[k], int(saved.get(k, 0)))
        except (OSError, ValueError, TypeError, AttributeError, RecursionError,
                FleetdError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("lake: state file %s/%s unusable (%s); resuming from the closed "
                            "files", STATE_DIR, self._state_name, type(exc).__name__)
        for k, v in _max_keys(self.s.root, self.node).items():
            after[k] = max(after[k], v)
        return after

    def close_segment(self) -> int:
        """Write what the database gained since the last segment; rows written."""
        conn = open_reader(self.db)
        try:
            if not conn.execute("SELECT 1 FROM nodes WHERE name = ?", (self.node,)).fetchone():
                return 0
            rows = read_node(conn, self.node, only=[t for t in TABLES if t not in KEYED])
            write_node(self.s.root, rows)
            written = 0
            for name in KEYED:
                # A large segment goes a chunk at a time (bounded memory), each chunk a
                # file named by its first row: written again after a crash, it replaces
                # itself.
                span = key_span(conn, self.node, name)
                if span is None:
                    continue
                for lo, hi, _ in chunks(max(self.after.get(name, 0), span[0]), span[1]):
                    part = read_node(conn, self.node, after={name: lo}, upto={name: hi},
                                     only=[name])
                    tag = f"-{(lo + 1) & SEQ_MASK:012d}"
                    written += write_node(self.s.root, part, {name: tag}).get(name, 0)
                    self.after[name] = hi
                    self._save()
        finally:
            conn.close()
        self.stats.segments += 1
        self.stats.rows += written
        self.stats.last_closed_ns = time.time_ns()
        for w in rows.warnings:
            log.warning("lake: %s", w)
        return written

    def _save(self) -> None:
        write_bytes(self.s.root, (STATE_DIR,), self._state_name,
                    json.dumps(self.after).encode())

    def retire(self) -> int:
        removed = apply_retention(self.s.root, self.s.retention)
        self.stats.removed_files += len(removed)
        return len(removed)

    def tick(self) -> None:
        try:
            n = self.close_segment()
            r = self.retire()
            log.info("lake: segment closed (%d rows), %d old file(s) removed", n, r)
            self.stats.last_error = None
        except Exception as exc:  # keep serving; say why the lake stopped growing
            self.stats.last_error = str(exc)
            log.warning("lake: closing a segment failed: %s", exc)


def _max_keys(root: Path, node: str) -> dict[str, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out: dict[str, int] = {}
    for f in lake_files(root, KEYED):
        if f.node != node:
            continue
        try:
            fd, _ = open_regular(f.path)  # never through a link swapped in since listing
            with open(fd, "rb") as fh:
                meta = pq.ParquetFile(fh).metadata
            col = meta.schema.names.index("rowkey")
            for i in range(meta.num_row_groups):
                st = meta.row_group(i).column(col).statistics
                if st is not None and st.has_min_max:
                    out[f.table] = max(out.get(f.table, 0), int(st.max))
        except (OSError, ValueError, pa.ArrowException, UnsafePathError):
            log.warning("lake: %s is unreadable; its rows will be written again", f.path)
    return out


def lake_ctx(settings: LakeSettings, db: Path, node: str
             ) -> Callable[[Any], AsyncIterator[None]]:
    """An aiohttp cleanup context: a segment every interval, one more at shutdown."""

    async def ctx(app: Any) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        closer = await loop.run_in_executor(None, SegmentCloser, settings, db, node)

        async def every() -> None:
            while True:
                await asyncio.sleep(settings.every_s)
                await loop.run_in_executor(None, closer.tick)

        task = asyncio.create_task(every())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The open segment too: a clean stop loses nothing.
        await loop.run_in_executor(None, closer.tick)

    return ctx
