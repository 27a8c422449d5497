"""Nsight Systems SQLite exports (``nsys export --type sqlite``) into a node's store.

Which tables an export has depends on the nsys version and on what was traced, so every
table and every column is probed before it is read: an optional one that is missing
reads as its default (and says so in a warning), one that another version names
differently is read under that name (:data:`_COLUMNS`, :data:`META_TABLES`), tables
fleetd does not know are ignored. Only a file that is no nsys export at all, or one
without the kernels and session start a GPU timeline needs, is refused, with a hint for
what is wrong (:func:`_not_an_export`). Times are ns on the session's clock;
``TARGET_INFO_SESSION_START_TIME.utcEpochNs`` places them on the wall clock (wall = ts +
that offset). ``globalTid``/``globalPid`` pack the pid in bits 24-47 and the tid in bits
0-23.

An export is untrusted input (a file from another machine): it is read through
:mod:`fleetd.store.foreign` (its tables must be plain tables, a deadline on every
statement, Ctrl-C ends one at once, SQLite's heap capped), text that is not UTF-8 is
read with U+FFFD in its place and counted in a warning naming table and column, and
rows, strings and times are bounded and type-checked as they are taken.

What lands where: kernels, copies, sets and synchronizations in ``gpu_data``; CUDA
runtime and driver calls as CUDA events (``cudaLaunchKernel`` ... or ``cuda_api`` with
the real name in args), OS runtime calls as ``syscall`` events, scheduler switches as
``off_cpu``/``runq_wait`` intervals, NVTX ranges as annotations.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from typing import Any

from fleetd.errors import UsageError
from fleetd.ingest.session import (
    Names,
    Parsed,
    Source,
    api_op,
    check_node,
    clean_text,
    finish,
    nccl_collective,
    new_batch,
    open_sqlite,
)
from fleetd.store import foreign
from fleetd.store.catalog import BY_NAME
from fleetd.store.imports import ANNOTATION_KINDS, GPU_KINDS, GPU_PID, STATE_NOT_RECORDED
from fleetd.store.schema import APPLICATION_ID

KERNELS = "CUPTI_ACTIVITY_KIND_KERNEL"
RUNTIME = ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER")
MEMCPY = "CUPTI_ACTIVITY_KIND_MEMCPY"
MEMSET = "CUPTI_ACTIVITY_KIND_MEMSET"
SYNC = "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"
# The export's metadata (name, value) under the names nsys versions give it: newer
# versions write META_DATA_EXPORT, older ones EXPORT_META_DATA.
META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")
# Every table the reader reads: each must be a plain table when present.
READ_TABLES = (KERNELS, *RUNTIME, MEMCPY, MEMSET, SYNC, *META_TABLES, "StringIds",
               "TARGET_INFO_SESSION_START_TIME", "TARGET_INFO_SYSTEM_ENV",
               "ENUM_CUDA_MEMCPY_OPER", "ENUM_CUPTI_SYNC_TYPE", "ENUM_SAMPLING_THREAD_STATE",
               "NVTX_EVENTS", "OSRT_API", "SCHED_EVENTS", "PROCESSES", "ThreadNames")
# A column by the names nsys versions give it, first found wins; absent, the default.
# Kernel names: demangledName and shortName since 2019, mangledName since 2023 (and a
# slim export may carry only one of them).
_COLUMNS: dict[str, tuple[str, ...]] = {
    "kernel_name": ("demangledName", "shortName", "mangledName", "name"),
    "nvtx_text_id": ("textId",),
}
MAX_EVENTS = 50_000_000  # rows of one table (fleetd.ingest.session.MAX_EVENTS in all)
MAX_STRINGS = 10_000_000  # StringIds rows
_FETCH = 2048  # rows fetched at once
MAX_STRING_CHARS = 1 << 30  # their total length
_TIME_LIMIT = 1 << 61  # |ts| of a session-relative time: ~73 years of ns
_OFF_CPU = BY_NAME["off_cpu"].code
_RUNQ = BY_NAME["runq_wait"].code
_SYSCALL = BY_NAME["syscall"].code
# nsys's thread states (ENUM_SAMPLING_THREAD_STATE labels) as the Linux task-state bits
# the analyzers read from an off-CPU event's a0 (prev_state): 0 = still runnable
# (preempted: a run-queue wait), 1 = TASK_INTERRUPTIBLE (S), 2 = TASK_UNINTERRUPTIBLE (D),
# 4 = __TASK_STOPPED, 0x10 = EXIT_DEAD. A state nsys did not record ("Unknown", which is
# what Linux exports mostly write) and the Windows-only states become S, a sleep, marked
# STATE_NOT_RECORDED: reading them as 0 would call every such switch a preemption, which
# nothing in the file says.
_LINUX_STATE = {"Running": 0, "Interruptible": 1, "Uninterruptible": 2, "Stopped": 4,
                "Terminated": 0x10, "Waiting": 1}
ASSUMED_SLEEP = 1 | STATE_NOT_RECORDED  # docs/schema.md, "Imported traces"
# The ids of nsys 2021-2024, for an export without the enum table.
_STATE_IDS = {0: "Unknown", 1: "Running", 2: "Interruptible", 3: "Uninterruptible",
              4: "Stopped", 5: "Terminated", 6: "Unscheduled", 7: "Waiting"}
_NVTX_RANGES = (59, 60, 70, 71)  # push/pop and start/end ranges (domain variants too)
_ENV_RANK = re.compile(r"(?:^|;)(RANK|PMI_RANK|OMPI_COMM_WORLD_RANK|SLURM_PROCID)=(\d+)")
_ENV_SIZE = re.compile(r"(?:^|;)(WORLD_SIZE|PMI_SIZE|OMPI_COMM_WORLD_SIZE|SLURM_NTASKS)=(\d+)")
_ENV_LOCAL = re.compile(r"(?:^|;)(LOCAL_RANK|PMI_LOCAL_RANK|OMPI_COMM_WORLD_LOCAL_RANK)=(\d+)")


def _pid(gid: int) -> int:
    return (gid >> 24) & 0xFFFFFF


def _tid(gid: int) -> int:
    return gid & 0xFFFFFF


class _Export:
    """One open export: which tables and columns it has, and its strings. Its statements
    run under :attr:`watch` (see :func:`read`)."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.text = foreign.LenientText()
        self.conn = open_sqlite(src.path, self.text)
        self.watch = foreign.Watch(src.path)
        self.tables: set[str] = set()
        self.strings: dict[int, str] = {}
        self.repaired: dict[tuple[str, str], int] = {}  # (table, column) -> values
        self.missing: dict[str, list[str]] = {}  # table -> optional columns it lacks
        self._columns: dict[str, set[str]] = {}

    def load(self) -> None:
        """Check the shape (the tables read must be plain tables), list the tables, and
        read the strings."""
        if self.conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID:
            raise UsageError(f"{self.src.path}: a fleetd database, not an nsys export",
                             "merge node databases with 'fleetd merge', or read it with "
                             f"--db {self.src.path}")
        foreign.check_tables(self.conn, self.src.path, READ_TABLES)
        self.tables = {str(r[0]) for r in self.conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        if self.has("StringIds"):
            self._load_strings()

    def _load_strings(self) -> None:
        chars = 0
        strings = self.strings
        for n, (i, v) in enumerate(self.rows("StringIds", "SELECT id, value FROM StringIds")):
            if n >= MAX_STRINGS:
                raise UsageError(f"{self.src.path}: more than {MAX_STRINGS} rows in StringIds",
                                 "import a shorter profiling window")
            value = v if isinstance(v, str) else "" if v is None else str(v)
            chars += len(value)
            if chars > MAX_STRING_CHARS:
                raise UsageError(f"{self.src.path}: the strings of StringIds total more than "
                                 f"{MAX_STRING_CHARS} characters", "import a shorter "
                                 "profiling window")
            if isinstance(i, int):
                strings[i] = value

    def has(self, table: str) -> bool:
        return table in self.tables

    def first(self, *tables: str) -> str | None:
        return next((t for t in tables if t in self.tables), None)

    def columns(self, table: str) -> set[str]:
        got = self._columns.get(table)
        if got is None:
            got = {str(r[1]) for r in self.conn.execute(
                f"PRAGMA table_info({foreign.quote(table)})")}
            self._columns[table] = got
        return got

    def col(self, table: str, *names: str, default: str = "0", required: bool = False) -> str:
        """The first of ``names`` the table has (quoted), else ``default`` (an SQL
        literal), noted in :attr:`missing`; a ``required`` one missing refuses the file."""
        have = self.columns(table)
        for n in names:
            if n in have:
                return foreign.quote(n)
        if required:
            raise UsageError(f"{self.src.path}: {table} has no {names[0]} column, so its "
                             "rows cannot be read", "export the report again with 'nsys "
                             "export --type sqlite' of a current nsys")
        self.missing.setdefault(table, []).append(names[0])
        return default

    def rows(self, table: str, sql: str, limit: int | None = None
             ) -> Iterator[tuple[Any, ...]]:
        """The rows of one statement over ``table``: at most ``limit`` (MAX_EVENTS), text
        repaired and counted by column, SQLite's errors as one line."""
        limit = MAX_EVENTS if limit is None else limit
        text = self.text
        try:
            cur = self.conn.execute(sql)
            names = [d[0] for d in cur.description or ()]
            seen, n = text.repaired, 0
            # A batch at a time: the checks cost per batch, the rows pass at C speed.
            while chunk := cur.fetchmany(_FETCH):
                n += len(chunk)
                if n > limit:
                    raise UsageError(f"{self.src.path}: more than {limit} rows in {table}",
                                     "import a shorter profiling window")
                if text.repaired != seen:
                    seen = text.repaired
                    for row in chunk:
                        for c in foreign.repaired_columns(row, names):
                            self.repaired[(table, c)] = self.repaired.get((table, c), 0) + 1
                yield from chunk
        except (sqlite3.Error, MemoryError) as exc:
            raise foreign.explain(exc, self.src.path, self.watch) from None

    def text_of(self, ident: Any) -> str:
        return self.strings.get(ident, "") if isinstance(ident, int) else ""

    def scalar(self, table: str, sql: str) -> Any:
        row = next(self.rows(table, sql), None)
        return row[0] if row else None

    def warnings(self) -> list[str]:
        out = [f"{n} value(s) of {t}.{c} are not UTF-8: read with U+FFFD in place of the "
               "bad bytes" for (t, c), n in sorted(self.repaired.items())]
        out += [f"{t} has no {', '.join(cols)} column(s) (another nsys version): read as "
                "not recorded" for t, cols in sorted(self.missing.items())]
        return out


def _int(v: Any, what: str, src: Source) -> int:
    if type(v) is int:  # the common case first: bool is not int here
        return v
    if v is None:
        return 0
    raise UsageError(f"{src.path}: {what} holds {type(v).__name__} {str(v)[:40]!r}, "
                     "not an integer", "the export is damaged; export it again")


def _time(v: Any, what: str, src: Source) -> int:
    """A session-relative time in ns: an integer of a plausible size (an offset added to
    it must still fit SQLite's 64 bits)."""
    if type(v) is int and -_TIME_LIMIT < v < _TIME_LIMIT:
        return v
    t = _int(v, what, src)
    if -_TIME_LIMIT < t < _TIME_LIMIT:
        return t
    raise UsageError(f"{src.path}: {what} holds {t}, out of range for a time in ns",
                     "the export is damaged; export it again")


def read(src: Source, names: Names, node: str | None) -> Parsed:
    ex = _Export(src)
    try:
        with ex.watch.guard(ex.conn):
            ex.load()
            parsed = _read(ex, names, node)
    finally:
        ex.conn.close()
    parsed.warnings[:0] = ex.warnings()
    return parsed


def _read(ex: _Export, names: Names, node: str | None) -> Parsed:
    src = ex.src
    refusal = _not_an_export(ex)
    if refusal is not None:
        raise refusal
    if ex.scalar(KERNELS, f"SELECT count(*) FROM {KERNELS}") == 0:
        raise UsageError(f"{src.path}: the nsys export holds no GPU kernels, so there is "
                         "no GPU timeline to import",
                         "profile with CUDA tracing on: nsys profile -t cuda,nvtx,osrt ...")
    offset = _start_offset(ex)
    env = _environment(ex)
    host = env.get("Hostname")
    meta = ex.first(*META_TABLES)
    version = ex.scalar(meta, f"SELECT value FROM {meta} WHERE name = "
                        "'EXPORT_PRODUCT_VERSION'") if meta and {"name", "value"} <= \
        ex.columns(meta) else None
    batch = new_batch(src, check_node(node or host or _stem(src)), host, offset, 1)
    batch.source["nsys_version"] = (clean_text(version)[:64] if isinstance(version, str)
                                    else None)
    batch.rank, batch.world_size, batch.local_rank = _ranks(env.get("env", ""))
    parsed = Parsed(batch)
    if not ex.has("StringIds"):
        parsed.warnings.append("no StringIds table: kernels and calls are imported without "
                               "their names")
    if host is None and node is None:
        parsed.warnings.append(f"no host name in the export (TARGET_INFO_SYSTEM_ENV): the "
                               f"node is named {batch.node!r} after the file (--node names it)")
    launches = _runtime(ex, batch, offset, parsed)
    _gpu(ex, batch, names, offset, launches, parsed)
    _nvtx(ex, batch, names, offset, parsed)
    _osrt(ex, batch, offset, parsed)
    _sched(ex, batch, offset, parsed)
    _processes(ex, batch)
    finish(batch, names)
    return parsed


_NSYS_SIGNS = ("StringIds", *META_TABLES, "TARGET_INFO_SESSION_START_TIME", "OSRT_API",
               "NVTX_EVENTS", "SCHED_EVENTS", "ThreadNames", "TARGET_INFO_SYSTEM_ENV")


def _not_an_export(ex: _Export) -> UsageError | None:
    """Why the file is no nsys export with a GPU timeline, with the hint that fits; None
    when it is one."""
    path = ex.src.path
    if ex.has(KERNELS) and "StringTable" not in ex.tables:
        return None
    cupti = sorted(t for t in ex.tables if t.startswith("CUPTI_ACTIVITY_KIND_"))
    if "StringTable" in ex.tables or (cupti and "StringIds" not in ex.tables and not any(
            ex.has(t) for t in _NSYS_SIGNS)):
        return UsageError(f"{path}: an nvprof profile (its tables StringTable, "
                          f"{', '.join(cupti[:2]) or 'CUPTI_*'}), not an nsys export",
                          "profile with Nsight Systems (nsys profile -t cuda ...) and import "
                          "its 'nsys export --type sqlite'")
    if not ex.tables:
        return UsageError(f"{path}: an empty SQLite file (no tables), not an nsys export",
                          "export the report with 'nsys export --type sqlite'; an interrupted "
                          "export leaves an empty file")
    if any(ex.has(t) for t in _NSYS_SIGNS) or cupti:
        what = (f"CUDA runtime calls but no kernels ({KERNELS})" if any(ex.has(t) for t in
                RUNTIME) else f"no CUDA activity (no {KERNELS} table)")
        return UsageError(f"{path}: an nsys export with {what}, not an nsys export "
                          "with a GPU timeline",
                          "profile with CUDA tracing on: nsys profile -t cuda,nvtx,osrt ...")
    shown = ", ".join(sorted(ex.tables)[:5]) + (", ..." if len(ex.tables) > 5 else "")
    return UsageError(f"{path}: an SQLite file, but not an nsys export (its tables: "
                      f"{clean_text(shown)[:200]}; no {KERNELS} or CUPTI_ACTIVITY_KIND_RUNTIME "
                      "table)", "export the report with 'nsys export --type sqlite'")


def _stem(src: Source) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", src.path.stem)[:64] or "nsys"


def _start_offset(ex: _Export) -> int:
    table = "TARGET_INFO_SESSION_START_TIME"
    if ex.has(table) and "utcEpochNs" in ex.columns(table):
        v = ex.scalar(table, f"SELECT utcEpochNs FROM {table}")
        if isinstance(v, int) and 0 < v < _TIME_LIMIT:
            return v
    raise UsageError(f"{ex.src.path}: no session start time "
                     "(TARGET_INFO_SESSION_START_TIME.utcEpochNs), so its times cannot be "
                     "placed on the wall clock", "export the report with a newer nsys")


def _environment(ex: _Export) -> dict[str, str]:
    out: dict[str, str] = {}
    table = "TARGET_INFO_SYSTEM_ENV"
    if not ex.has(table) or not {"name", "value"} <= ex.columns(table):
        return out
    for name, value in ex.rows(table, f"SELECT name, value FROM {table}"):
        if name == "Hostname" and isinstance(value, str):
            out["Hostname"] = clean_text(value)[:253].replace(":", "_")
        elif isinstance(value, str) and "=" in value and len(value) > len(out.get("env", "")):
            out["env"] = value  # the profiled program's environment, ';'-separated
    return out


def _ranks(env: str) -> tuple[int | None, int | None, int | None]:
    def first(rx: re.Pattern[str]) -> int | None:
        m = rx.search(env)
        return int(m.group(2)[:9]) if m else None

    return first(_ENV_RANK), first(_ENV_SIZE), first(_ENV_LOCAL)


def _runtime(ex: _Export, batch: Any, offset: int, parsed: Parsed) -> dict[int, int]:
    """CUDA runtime/driver calls as events; correlation id -> the event's index."""
    launches: dict[int, int] = {}
    n = 0
    src = ex.src
    for table in RUNTIME:
        if not ex.has(table):
            continue
        cols = (ex.col(table, "start", required=True), ex.col(table, "end", required=True),
                ex.col(table, "globalTid"), ex.col(table, "correlationId"),
                ex.col(table, "nameId", default="NULL"), ex.col(table, "returnValue"))
        for start, end, gtid, corr, name_id, ret in ex.rows(
                table, f"SELECT {', '.join(cols)} FROM {table} ORDER BY 1"):
            s, e = _time(start, f"{table}.start", src), _time(end, f"{table}.end", src)
            g, c = _int(gtid, "globalTid", src), _int(corr, "correlationId", src)
            code, other = api_op(ex.text_of(name_id))
            idx = len(batch.events)
            # a0 is the correlation id only for ``cuda_api`` (catalogued ops give a0
            # another meaning); gpu_data.launch links a launch to its kernel either way.
            batch.events.append((s + offset, max(0, e - s), _pid(g), _tid(g), code,
                                 _int(ret, "returnValue", src), 0, 0,
                                 c if other is not None else 0, 0, 0))
            if other is not None:
                batch.event_args.append((idx, {"name": other, "correlation": c}))
            launches[c] = idx
            n += 1
    parsed.counts["runtime"] = n
    return launches


def _gpu(ex: _Export, batch: Any, names: Names, offset: int, launches: dict[int, int],
         parsed: Parsed) -> None:
    memcpy_kinds = _enum(ex, "ENUM_CUDA_MEMCPY_OPER")
    sync_kinds = _enum(ex, "ENUM_CUPTI_SYNC_TYPE")
    name_col = ex.col(KERNELS, *_COLUMNS["kernel_name"], default="NULL")
    dims = ", ".join(ex.col(KERNELS, d, default="0")
                     for d in ("gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ"))
    parsed.counts["kernels"] = _rows(ex, KERNELS, batch, names, offset, launches,
                                     f"{name_col}, 0, {dims}", "kernel", ex.text_of)
    if ex.has(MEMCPY):
        parsed.counts["memcpy"] = _rows(
            ex, MEMCPY, batch, names, offset, launches,
            f"{ex.col(MEMCPY, 'copyKind')}, {ex.col(MEMCPY, 'bytes')}, 0, 0, 0, 0, 0, 0",
            "memcpy", lambda v: "Memcpy " + memcpy_kinds.get(v, f"kind {v}"))
    if ex.has(MEMSET):
        parsed.counts["memset"] = _rows(
            ex, MEMSET, batch, names, offset, launches,
            f"0, {ex.col(MEMSET, 'bytes')}, 0, 0, 0, 0, 0, 0", "memset", lambda v: "Memset")
    if ex.has(SYNC):
        parsed.counts["sync"] = _rows(
            ex, SYNC, batch, names, offset, launches,
            f"{ex.col(SYNC, 'syncType')}, 0, 0, 0, 0, 0, 0, 0", "sync",
            lambda v: sync_kinds.get(v, f"sync {v}"))


def _rows(ex: _Export, table: str, batch: Any, names: Names, offset: int,
          launches: dict[int, int], tail: str, kind: str, name_of: Any) -> int:
    """One GPU activity table: start, end, pid, device, stream and correlation, then
    ``tail`` (label, bytes and the six grid/block dims)."""
    code = GPU_KINDS[kind]
    src = ex.src
    head = ", ".join((ex.col(table, "start", required=True),
                      ex.col(table, "end", required=True),
                      ex.col(table, "globalPid", default="NULL"),
                      ex.col(table, "deviceId"), ex.col(table, "streamId"),
                      ex.col(table, "correlationId")))
    n = 0
    for row in ex.rows(table, f"SELECT {head}, {tail} FROM {table} ORDER BY 1"):
        start, end, gpid, dev, stream, corr, label, nbytes, *dims = row
        s, e = _time(start, f"{kind}.start", src), _time(end, f"{kind}.end", src)
        c = _int(corr, "correlationId", src)
        name = name_of(label)
        coll = nccl_collective(name) if kind == "kernel" else None
        # A synchronization has no stream of its own (nsys writes 2^32 - 1).
        st = _int(stream, "streamId", src)
        launch = launches.get(c, -1) if c else -1
        # No globalPid (another version's layout): the launching call's process.
        pid = _pid(_int(gpid, "globalPid", src)) if gpid is not None else (
            batch.events[launch][2] if launch >= 0 else 0)
        batch.gpu.append((s + offset, max(0, e - s), _int(dev, "deviceId", src),
                          -1 if st == 0xFFFFFFFF else st, code, names(name), c,
                          _int(nbytes, "bytes", src), names(coll) if coll else 0,
                          *(_int(d, "grid/block", src) for d in dims), pid, launch))
        n += 1
    return n


def _enum(ex: _Export, table: str) -> dict[Any, str]:
    if not ex.has(table):
        return {}
    label = ex.col(table, "label", "name", default="NULL")
    return {i: str(text) for i, text in ex.rows(
        table, f"SELECT {ex.col(table, 'id', required=True)}, {label} FROM {table}",
        limit=100_000)}


def _nvtx(ex: _Export, batch: Any, names: Names, offset: int, parsed: Parsed) -> None:
    table = "NVTX_EVENTS"
    if not ex.has(table):
        return
    src = ex.src
    text = ex.col(table, "text", default="NULL")
    text_id = ex.col(table, *_COLUMNS["nvtx_text_id"], default="NULL")
    kinds = ", ".join(map(str, _NVTX_RANGES))
    event_type = ex.col(table, "eventType", required=True)
    n = 0
    for start, end, gtid, label, tid_ref in ex.rows(
            table, f"SELECT {ex.col(table, 'start', required=True)}, "
            f"{ex.col(table, 'end', required=True)}, {ex.col(table, 'globalTid')}, {text}, "
            f"{text_id} FROM {table} WHERE {event_type} IN ({kinds}) AND \"end\" IS NOT NULL "
            "ORDER BY 1"):
        s, e = _time(start, f"{table}.start", src), _time(end, f"{table}.end", src)
        g = _int(gtid, f"{table}.globalTid", src)
        shown = label if isinstance(label, str) else ex.text_of(tid_ref)
        batch.annotations.append((s + offset, max(0, e - s), _pid(g), _tid(g),
                                  ANNOTATION_KINDS["nvtx"], names(shown or "(unnamed)")))
        n += 1
    parsed.counts["nvtx"] = n


def _osrt(ex: _Export, batch: Any, offset: int, parsed: Parsed) -> None:
    table = "OSRT_API"
    if not ex.has(table):
        return
    src = ex.src
    n = 0
    for start, end, gtid, name_id, ret in ex.rows(
            table, f"SELECT {ex.col(table, 'start', required=True)}, "
            f"{ex.col(table, 'end', required=True)}, {ex.col(table, 'globalTid')}, "
            f"{ex.col(table, 'nameId', default='NULL')}, {ex.col(table, 'returnValue')} "
            f"FROM {table} ORDER BY 1"):
        s, e = _time(start, f"{table}.start", src), _time(end, f"{table}.end", src)
        g = _int(gtid, f"{table}.globalTid", src)
        batch.event_args.append((len(batch.events), {"name": clean_text(ex.text_of(name_id))}))
        batch.events.append((s + offset, max(0, e - s), _pid(g), _tid(g), _SYSCALL,
                             _int(ret, "OSRT_API.returnValue", src), 0, 0, 0, 0, 0))
        n += 1
    parsed.counts["osrt"] = n


def _thread_states(ex: _Export) -> dict[int, str]:
    """nsys's thread-state ids by label, from the export's own enum table when it has one."""
    table = "ENUM_SAMPLING_THREAD_STATE"
    found = {int(i): str(label) for i, label in ex.rows(
        table, f"SELECT {ex.col(table, 'id', required=True)}, "
        f"{ex.col(table, 'name', 'label', default='NULL')} FROM {table}", limit=100_000)
        if isinstance(i, int)} if ex.has(table) else {}
    return found or dict(_STATE_IDS)


def _sched(ex: _Export, batch: Any, offset: int, parsed: Parsed) -> None:
    """Switch-out then switch-in of one thread: an interval off the CPU (or waiting for it,
    when it left while still runnable), its nsys thread state as Linux state bits in a0.
    An export without thread states (nsys 2021's layout) reads every state as unknown."""
    table = "SCHED_EVENTS"
    if not ex.has(table):
        return
    src = ex.src
    labels = _thread_states(ex)
    out: dict[int, tuple[int, str]] = {}  # globalTid -> (switched out at, state label)
    by_label: dict[str, int] = {}
    for start, is_in, gtid, state in ex.rows(
            table, f"SELECT {ex.col(table, 'start', required=True)}, "
            f"{ex.col(table, 'isSchedIn', required=True)}, "
            f"{ex.col(table, 'globalTid', required=True)}, "
            f"{ex.col(table, 'threadState', default='0')} FROM {table} ORDER BY 1"):
        t, g = _time(start, f"{table}.start", src), _int(gtid, "globalTid", src)
        if not is_in:
            code = _int(state, "threadState", src)
            out[g] = (t, labels.get(code, f"state {code}"))
            continue
        left = out.pop(g, None)
        if left is None:
            continue
        bits = _LINUX_STATE.get(left[1], ASSUMED_SLEEP)
        batch.events.append((left[0] + offset, t - left[0], _pid(g), _tid(g),
                             _RUNQ if bits == 0 else _OFF_CPU, 0, 0, 0, bits, 0, 0))
        by_label[left[1]] = by_label.get(left[1], 0) + 1
    parsed.counts["sched"] = sum(by_label.values())
    batch.source["sched_states"] = dict(sorted(by_label.items()))
    guessed = sum(n for label, n in by_label.items() if label not in _LINUX_STATE)
    if guessed:
        parsed.warnings.append(
            f"{guessed} of {parsed.counts['sched']} scheduler switch-outs carry no Linux "
            "thread state in the export (nsys: " + ", ".join(
                sorted(clean_text(label)[:40] for label in by_label
                       if label not in _LINUX_STATE)) +
            "): imported as sleeps (S), never as preemptions")


def _processes(ex: _Export, batch: Any) -> None:
    """Names of the processes and threads the rows mention (not the whole machine)."""
    pids = {r[2] for r in batch.events} | {r[GPU_PID] for r in batch.gpu}
    procs: dict[int, str | None] = dict.fromkeys(pids)
    table = "PROCESSES"
    if ex.has(table) and {"pid", "name"} <= ex.columns(table):
        for pid, name in ex.rows(table, f"SELECT pid, name FROM {table}"):
            if pid in procs and isinstance(name, str):
                procs[pid] = clean_text(name)[:64]
    batch.processes = [{"pid": p, "comm": c, "rank": batch.rank, "local_rank": batch.local_rank,
                        "world_size": batch.world_size} for p, c in sorted(procs.items())]
    tids = {(r[3], r[2]) for r in batch.events}
    names: dict[int, str] = {}
    table = "ThreadNames"
    if ex.has(table) and {"nameId", "globalTid"} <= ex.columns(table):
        for name_id, gtid in ex.rows(table, f"SELECT nameId, globalTid FROM {table}"):
            if isinstance(gtid, int):
                names[_tid(gtid)] = clean_text(ex.text_of(name_id))[:64]
    batch.tasks = [(tid, pid, names.get(tid)) for tid, pid in sorted(tids)]
