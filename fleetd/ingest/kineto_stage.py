"""The scratch file of a Kineto import: the rows of one trace file in a private SQLite
file, put in time order there, each GPU row linked to the CUDA call that launched it.

:class:`fleetd.ingest.kineto_events.Converter` hands it flat row tuples every
FLUSH_ROWS rows. When the whole file is read, :meth:`Stage.finish` has SQLite sort the
rows (its sorter spills to disk beyond its cache) and link each kernel, copy and set to
the last launch call of its correlation id, whose pid is the process the GPU work belongs
to. :class:`Rows` and :class:`EventArgs` then read the rows back one at a time for the
writer, so the rows of a large trace never sit in memory at once. The file lives in
SQLite's temp directory (``$SQLITE_TMPDIR`` or ``$TMPDIR``) and is gone when closed.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from itertools import chain, islice
from operator import itemgetter
from typing import Any

from fleetd.errors import UsageError
from fleetd.ingest.session import MAX_EVENTS, Source
from fleetd.store.db import connect
from fleetd.store.imports import GPU_KINDS, ImportArgs

MAX_RSS_BYTES = 2 << 30  # the memory ceiling of an import (resident set)
_STAGE_CACHE_KIB = 32 << 10  # the scratch file's page cache (its sorter's memory too)


_STAGE_TABLES = {
    "api": "ts, ts_rel, dur, pid, tid, op, corrf, corr, other",
    "gpu": "ts, ts_rel, dur, dev, stream, kind, name, corr, bytes, coll, gx, gy, gz, bx, "
           "by, bz",
    "rng": "ts, ts_rel, dur, pid, tid, kind, name",
}
_ROWS_PER_INSERT = 64
_PID, _TID = itemgetter(3), itemgetter(4)  # in the api and range rows
# The GPU rows with the pid and the index of their launch call (0 and -1: none).
GPU_ROWS = ("SELECT g.rowid AS rowid, g.ts AS ts, g.ts_rel AS ts_rel, g.dur AS dur, g.dev AS dev, "
             "g.stream AS stream, g.kind AS kind, g.name AS name, g.corr AS corr, "
             "g.bytes AS bytes, g.coll AS coll, g.gx AS gx, g.gy AS gy, g.gz AS gz, g.bx AS bx, "
             "g.by AS by, g.bz AS bz, coalesce(l.pid, 0) AS pid, coalesce(l.idx - 1, -1) AS "
             "launch FROM gpu g LEFT JOIN link l ON l.corr = g.corr")


class Facts:
    """What the sorted rows say, for the batch and the report."""

    def __init__(self) -> None:
        self.events = self.gpu = self.annotations = 0
        self.started = self.ended = 0
        self.first_ts: int | None = None
        self.pids: list[int] = []
        self.tasks: list[tuple[int, int]] = []
        self.kinds: dict[int, int] = {}
        self.gpu_pid = False  # a GPU row has a launching call with a pid
        self.ends: dict[str, tuple[int, int]] = {}  # table -> rowids of its first, last row


class Stage:
    """The rows of one file in a private SQLite file (deleted when closed), in tables
    without type affinity (times keep the type they were written with: their order is
    the order of the numbers, as in Python, int or float)."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.rows = 0
        self.pids: set[int] = set()  # of the CUDA calls and ranges (GPU rows: their launch's)
        self.tasks: set[tuple[int, int]] = set()  # (tid, pid)
        self.db = connect("", isolation_level=None)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "temp_store=FILE",
                       f"cache_size=-{_STAGE_CACHE_KIB}"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.execute("BEGIN")
        self._sql: dict[str, tuple[str, str, int]] = {}
        for table, cols in _STAGE_TABLES.items():
            self.db.execute(f"CREATE TABLE {table} ({cols})")
            width = cols.count(",") + 1
            one = "(" + ", ".join("?" * width) + ")"
            self._sql[table] = (f"INSERT INTO {table} VALUES {one}",
                                f"INSERT INTO {table} VALUES " + ", ".join(
                                    [one] * _ROWS_PER_INSERT), width)

    def close(self) -> None:
        self.db.close()

    def add(self, api: list[tuple[Any, ...]], gpu: list[tuple[Any, ...]],
            ranges: list[tuple[Any, ...]]) -> None:
        self.rows += len(api) + len(gpu) + len(ranges)
        if self.rows > MAX_EVENTS:
            raise UsageError(f"{self.src.path}: more than {MAX_EVENTS} events, above the "
                             "limit", "import a shorter profiling window")
        try:
            for table, rows in (("api", api), ("gpu", gpu), ("rng", ranges)):
                if rows:
                    self._insert(table, rows)
        except OverflowError as exc:  # sqlite3: "Python int too large to convert to SQLite"
            raise _beyond(self.src) from exc
        # the processes and threads, in C-level passes (pid, tid at 3, 4)
        for rows in (api, ranges):
            if rows:
                self.pids.update(map(_PID, rows))
                self.tasks.update(zip(map(_TID, rows), map(_PID, rows), strict=True))

    def _insert(self, table: str, rows: list[tuple[Any, ...]]) -> None:
        one, many, width = self._sql[table]
        whole = len(rows) // _ROWS_PER_INSERT * _ROWS_PER_INSERT
        if whole:
            values = chain.from_iterable(islice(rows, whole))
            size = width * _ROWS_PER_INSERT
            self.db.executemany(many, iter(lambda: tuple(islice(values, size)), ()))
        if whole < len(rows):
            self.db.executemany(one, islice(rows, whole, None))

    def check_memory(self, names: int) -> None:
        rss = _rss()
        if rss > MAX_RSS_BYTES:
            raise UsageError(f"{self.src.path}: reading it would take more than "
                             f"{MAX_RSS_BYTES >> 20} MiB of memory ({rss >> 20} MiB so far, "
                             f"{names} distinct names)", "import a shorter profiling window")

    def finish(self, src: Source, base: int) -> Facts:
        """The rows in time order (a stable sort on the times as written), kernels linked
        to the last launch call of their correlation id; the session's span."""
        db = self.db
        db.execute("CREATE TABLE api_s (idx INTEGER PRIMARY KEY, ts_rel, dur, pid, tid, op, "
                   "corrf, corr, other)")
        db.execute("INSERT INTO api_s (ts_rel, dur, pid, tid, op, corrf, corr, other) SELECT "
                   "ts_rel, dur, pid, tid, op, corrf, corr, other FROM api ORDER BY ts, rowid")
        db.execute("CREATE TABLE link (corr INTEGER PRIMARY KEY, idx, pid)")
        # in call order, so that the last call of a correlation id is the one kept (ids
        # mostly grow with time: the rows go to the end of the table, no sort)
        db.execute("INSERT OR REPLACE INTO link SELECT corr, idx, pid FROM api_s "
                   "WHERE corr IS NOT NULL AND corr != 0 ORDER BY idx")
        facts = Facts()
        kinds = (GPU_KINDS["kernel"], GPU_KINDS["memcpy"], GPU_KINDS["memset"])
        spans = {t: db.execute(f"SELECT count(*), min(ts_rel), max(ts_rel + dur){more} FROM {t}"
                               ).fetchone() for t, more in (
            ("api_s", ""), ("rng", ""),
            ("gpu", "".join(f", total(kind = {k})" for k in kinds)))}
        facts.events, facts.annotations, facts.gpu = (spans[t][0] for t in ("api_s", "rng", "gpu"))
        facts.kinds = {k: int(n) for k, n in zip(kinds, spans["gpu"][3:], strict=True)}
        lo = [first for n, first, *_ in spans.values() if n]
        hi = [last for n, _, last, *_ in spans.values() if n]
        if any(type(last) is not int for last in hi):  # the sum left 64-bit integers
            raise _beyond(src)
        if lo:
            facts.started, facts.ended = base + min(lo), base + max(hi)
            if facts.started < -(1 << 63) or facts.ended >= 1 << 63:
                raise _beyond(src)
        if facts.events:
            facts.first_ts = base + db.execute(
                "SELECT ts_rel FROM api_s WHERE idx = 1").fetchone()[0]
        # a GPU row's pid is its launch call's (one of self.pids), or 0 without one
        linked, nonzero = db.execute(
            "SELECT count(*), total(l.pid != 0) FROM gpu g JOIN link l ON l.corr = g.corr"
            ).fetchone()
        facts.gpu_pid = nonzero > 0
        facts.pids = sorted(self.pids | ({0} if linked < facts.gpu else set()))
        facts.tasks = sorted(self.tasks)
        for table in ("gpu", "rng"):  # the rowids of their first and last rows in time order
            facts.ends[table] = tuple(db.execute(
                f"SELECT (SELECT rowid FROM {table} ORDER BY ts, rowid LIMIT 1), "
                f"(SELECT rowid FROM {table} ORDER BY ts DESC, rowid DESC LIMIT 1)").fetchone())
        db.execute("PRAGMA shrink_memory")  # the cache is read again only by the writer
        return facts


def _beyond(src: Source) -> UsageError:
    return UsageError(f"{src.path}: holds a value (a time, an id or a size) beyond the "
                      "64-bit integers fleetd stores, so the file is damaged or not a trace; "
                      "nothing was imported", "profile again, or export the report again")


def _rss() -> int:
    """The resident set of this process, in bytes (its peak where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Rows:
    """One table of the scratch file as the writer's rows, in time order: its length,
    its first and last row, and one pass over all of them, read as they are written
    (SQLite sorts them then, spilling to its temp files beyond its cache)."""

    def __init__(self, stage: Stage, source: str, cols: str, order: str, base: int,
                 count: int, ends: tuple[int, int] | None = None) -> None:
        self._db = stage.db
        self._stage = stage  # kept open while the rows are
        self._sql = f"SELECT {cols} FROM ({source})"
        self._order = order
        self._base = base
        self._count = count
        self._ends = ends  # rowids of the first and the last row (else idx order)

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._db.execute(f"{self._sql} ORDER BY {self._order}", (self._base,)))

    def __getitem__(self, i: int) -> tuple[int, ...]:
        """The first and the last row (what the writer asks for), read without a sort."""
        if i < 0:
            i += self._count
        if i not in (0, self._count - 1):
            raise IndexError(i)
        key = ("idx", i + 1) if self._ends is None else ("rowid", self._ends[i > 0])
        return tuple(self._db.execute(f"{self._sql} WHERE {key[0]} = ?2",
                                      (self._base, key[1])).fetchone())


class EventArgs:
    """(index of the event, its args) for the CUDA calls whose name is kept in args."""

    def __init__(self, stage: Stage) -> None:
        self._stage = stage

    def __iter__(self) -> Iterator[tuple[int, ImportArgs]]:
        for i, other, corr in self._stage.db.execute(
                "SELECT idx - 1, other, corr FROM api_s WHERE other IS NOT NULL ORDER BY idx"):
            yield i, {"name": other, "correlation": corr}
