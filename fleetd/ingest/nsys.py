"""Nsight Systems SQLite exports (``nsys export --type sqlite``) into a node's store.

Which tables an export has depends on the nsys version and on what was traced, so every
table is probed before it is read, and columns too where versions differ. Times are ns
on the session's clock; ``TARGET_INFO_SESSION_START_TIME.utcEpochNs`` places them on
the wall clock (wall = ts + that offset). ``globalTid``/``globalPid`` pack the pid in
bits 24-47 and the tid in bits 0-23.

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
from fleetd.store.catalog import BY_NAME
from fleetd.store.imports import ANNOTATION_KINDS, GPU_KINDS, GPU_PID, STATE_NOT_RECORDED

KERNELS = "CUPTI_ACTIVITY_KIND_KERNEL"
RUNTIME = ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER")
MEMCPY = "CUPTI_ACTIVITY_KIND_MEMCPY"
MEMSET = "CUPTI_ACTIVITY_KIND_MEMSET"
SYNC = "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"
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
    """One open export: which tables and columns it has, and its strings."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.conn = open_sqlite(src.path)
        self.tables = {str(r[0]) for r in self.conn.execute(
            "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        self.strings: dict[int, str] = {}
        if "StringIds" in self.tables:
            self.strings = {int(i): str(v) for i, v in self.rows("SELECT id, value FROM StringIds")}

    def has(self, table: str) -> bool:
        return table in self.tables

    def columns(self, table: str) -> set[str]:
        return {str(r[1]) for r in self.conn.execute(f"PRAGMA table_info({table})")}

    def rows(self, sql: str) -> Iterator[tuple[Any, ...]]:
        try:
            yield from self.conn.execute(sql)
        except sqlite3.Error as exc:
            raise UsageError(f"{self.src.path}: cannot read the export ({exc})",
                             "export the report again with 'nsys export --type sqlite'") from exc

    def text(self, ident: Any) -> str:
        return self.strings.get(int(ident), "") if ident is not None else ""

    def scalar(self, sql: str) -> Any:
        row = next(self.rows(sql), None)
        return row[0] if row else None


def _int(v: Any, what: str, src: Source) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if v is None:
        return 0
    raise UsageError(f"{src.path}: {what} holds {type(v).__name__} {str(v)[:40]!r}, "
                     "not an integer", "the export is damaged; export it again")


def read(src: Source, names: Names, node: str | None) -> Parsed:
    ex = _Export(src)
    try:
        return _read(ex, names, node)
    finally:
        ex.conn.close()


def _read(ex: _Export, names: Names, node: str | None) -> Parsed:
    src = ex.src
    if not ex.has(KERNELS) and not any(ex.has(t) for t in RUNTIME):
        raise UsageError(f"{src.path}: an SQLite file, but not an nsys export (no "
                         f"{KERNELS} or CUPTI_ACTIVITY_KIND_RUNTIME table)",
                         "export the report with 'nsys export --type sqlite'")
    if not ex.has(KERNELS) or ex.scalar(f"SELECT count(*) FROM {KERNELS}") == 0:
        raise UsageError(f"{src.path}: the nsys export holds no GPU kernels, so there is "
                         "no GPU timeline to import",
                         "profile with CUDA tracing on: nsys profile -t cuda,nvtx,osrt ...")
    offset = _start_offset(ex)
    env = _environment(ex)
    host = env.get("Hostname")
    batch = new_batch(src, check_node(node or host or _stem(src)), host, offset, 1,
                      {"nsys_version": ex.scalar(
                          "SELECT value FROM META_DATA_EXPORT WHERE name = "
                          "'EXPORT_PRODUCT_VERSION'") if ex.has("META_DATA_EXPORT") else None})
    batch.rank, batch.world_size, batch.local_rank = _ranks(env.get("env", ""))
    parsed = Parsed(batch)
    launches = _runtime(ex, batch, offset, parsed)
    _gpu(ex, batch, names, offset, launches, parsed)
    _nvtx(ex, batch, names, offset, parsed)
    _osrt(ex, batch, offset, parsed)
    _sched(ex, batch, offset, parsed)
    _processes(ex, batch)
    finish(batch, names)
    return parsed


def _stem(src: Source) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", src.path.stem)[:64] or "nsys"


def _start_offset(ex: _Export) -> int:
    if ex.has("TARGET_INFO_SESSION_START_TIME"):
        v = ex.scalar("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME")
        if isinstance(v, int) and v > 0:
            return v
    raise UsageError(f"{ex.src.path}: no session start time "
                     "(TARGET_INFO_SESSION_START_TIME), so its times cannot be placed on "
                     "the wall clock", "export the report with a newer nsys")


def _environment(ex: _Export) -> dict[str, str]:
    out: dict[str, str] = {}
    if not ex.has("TARGET_INFO_SYSTEM_ENV"):
        return out
    for name, value in ex.rows("SELECT name, value FROM TARGET_INFO_SYSTEM_ENV"):
        if name == "Hostname" and isinstance(value, str):
            out["Hostname"] = clean_text(value)[:253].replace(":", "_")
        elif isinstance(value, str) and "=" in value and len(value) > len(out.get("env", "")):
            out["env"] = value  # the profiled program's environment, ';'-separated
    return out


def _ranks(env: str) -> tuple[int | None, int | None, int | None]:
    def first(rx: re.Pattern[str]) -> int | None:
        m = rx.search(env)
        return int(m.group(2)) if m else None

    return first(_ENV_RANK), first(_ENV_SIZE), first(_ENV_LOCAL)


def _runtime(ex: _Export, batch: Any, offset: int, parsed: Parsed) -> dict[int, int]:
    """CUDA runtime/driver calls as events; correlation id -> the event's index."""
    launches: dict[int, int] = {}
    n = 0
    for table in RUNTIME:
        if not ex.has(table):
            continue
        for start, end, gtid, corr, name_id, ret in ex.rows(
                f"SELECT start, end, globalTid, correlationId, nameId, returnValue "
                f"FROM {table} ORDER BY start"):
            s, e = _int(start, f"{table}.start", ex.src), _int(end, f"{table}.end", ex.src)
            g, c = _int(gtid, "globalTid", ex.src), _int(corr, "correlationId", ex.src)
            code, other = api_op(ex.text(name_id))
            idx = len(batch.events)
            # a0 is the correlation id only for ``cuda_api`` (catalogued ops give a0
            # another meaning); gpu_data.launch links a launch to its kernel either way.
            batch.events.append((s + offset, max(0, e - s), _pid(g), _tid(g), code,
                                 _int(ret, "returnValue", ex.src), 0, 0,
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
    kcols = ex.columns(KERNELS)
    name_col = "demangledName" if "demangledName" in kcols else "shortName"
    parsed.counts["kernels"] = _rows(ex, batch, names, offset, launches, (
        f"SELECT start, end, globalPid, deviceId, streamId, correlationId, {name_col}, 0, "
        f"gridX, gridY, gridZ, blockX, blockY, blockZ FROM {KERNELS}"), "kernel",
        lambda v: ex.text(v))
    if ex.has(MEMCPY):
        parsed.counts["memcpy"] = _rows(ex, batch, names, offset, launches, (
            f"SELECT start, end, globalPid, deviceId, streamId, correlationId, copyKind, "
            f"bytes, 0, 0, 0, 0, 0, 0 FROM {MEMCPY}"), "memcpy",
            lambda v: "Memcpy " + memcpy_kinds.get(v, f"kind {v}"))
    if ex.has(MEMSET):
        parsed.counts["memset"] = _rows(ex, batch, names, offset, launches, (
            f"SELECT start, end, globalPid, deviceId, streamId, correlationId, 0, bytes, "
            f"0, 0, 0, 0, 0, 0 FROM {MEMSET}"), "memset", lambda v: "Memset")
    if ex.has(SYNC):
        parsed.counts["sync"] = _rows(ex, batch, names, offset, launches, (
            f"SELECT start, end, globalPid, deviceId, streamId, correlationId, syncType, 0, "
            f"0, 0, 0, 0, 0, 0 FROM {SYNC}"), "sync",
            lambda v: sync_kinds.get(v, f"sync {v}"))


def _rows(ex: _Export, batch: Any, names: Names, offset: int, launches: dict[int, int],
          sql: str, kind: str, name_of: Any) -> int:
    code = GPU_KINDS[kind]
    n = 0
    for row in ex.rows(sql + " ORDER BY start"):
        start, end, gpid, dev, stream, corr, label, nbytes, *dims = row
        s, e = _int(start, f"{kind}.start", ex.src), _int(end, f"{kind}.end", ex.src)
        c = _int(corr, "correlationId", ex.src)
        name = name_of(label)
        coll = nccl_collective(name) if kind == "kernel" else None
        # A synchronization has no stream of its own (nsys writes 2^32 - 1).
        st = _int(stream, "streamId", ex.src)
        batch.gpu.append((s + offset, max(0, e - s), _int(dev, "deviceId", ex.src),
                          -1 if st == 0xFFFFFFFF else st, code, names(name), c,
                          _int(nbytes, "bytes", ex.src), names(coll) if coll else 0,
                          *(_int(d, "grid/block", ex.src) for d in dims),
                          _pid(_int(gpid, "globalPid", ex.src)),
                          launches.get(c, -1) if c else -1))
        n += 1
    return n


def _enum(ex: _Export, table: str) -> dict[Any, str]:
    if not ex.has(table):
        return {}
    return {i: str(label) for i, _, label in ex.rows(f"SELECT id, name, label FROM {table}")}


def _nvtx(ex: _Export, batch: Any, names: Names, offset: int, parsed: Parsed) -> None:
    if not ex.has("NVTX_EVENTS"):
        return
    cols = ex.columns("NVTX_EVENTS")
    text_id = "textId" if "textId" in cols else "NULL"
    kinds = ", ".join(map(str, _NVTX_RANGES))
    n = 0
    for start, end, gtid, text, tid_ref in ex.rows(
            f"SELECT start, end, globalTid, text, {text_id} FROM NVTX_EVENTS "
            f"WHERE eventType IN ({kinds}) AND end IS NOT NULL ORDER BY start"):
        s, e, g = (_int(v, "NVTX_EVENTS", ex.src) for v in (start, end, gtid))
        label = text if isinstance(text, str) else ex.text(tid_ref)
        batch.annotations.append((s + offset, max(0, e - s), _pid(g), _tid(g),
                                  ANNOTATION_KINDS["nvtx"], names(label or "(unnamed)")))
        n += 1
    parsed.counts["nvtx"] = n


def _osrt(ex: _Export, batch: Any, offset: int, parsed: Parsed) -> None:
    if not ex.has("OSRT_API"):
        return
    n = 0
    for start, end, gtid, name_id, ret in ex.rows(
            "SELECT start, end, globalTid, nameId, returnValue FROM OSRT_API ORDER BY start"):
        s, e, g = (_int(v, "OSRT_API", ex.src) for v in (start, end, gtid))
        batch.event_args.append((len(batch.events), {"name": clean_text(ex.text(name_id))}))
        batch.events.append((s + offset, max(0, e - s), _pid(g), _tid(g), _SYSCALL,
                             _int(ret, "OSRT_API.returnValue", ex.src), 0, 0, 0, 0, 0))
        n += 1
    parsed.counts["osrt"] = n


def _thread_states(ex: _Export) -> dict[int, str]:
    """nsys's thread-state ids by label, from the export's own enum table when it has one."""
    found = {int(i): str(label) for i, label in ex.rows(
        "SELECT id, name FROM ENUM_SAMPLING_THREAD_STATE")} if ex.has(
        "ENUM_SAMPLING_THREAD_STATE") else {}
    return found or dict(_STATE_IDS)


def _sched(ex: _Export, batch: Any, offset: int, parsed: Parsed) -> None:
    """Switch-out then switch-in of one thread: an interval off the CPU (or waiting for it,
    when it left while still runnable), its nsys thread state as Linux state bits in a0."""
    if not ex.has("SCHED_EVENTS"):
        return
    labels = _thread_states(ex)
    out: dict[int, tuple[int, str]] = {}  # globalTid -> (switched out at, state label)
    by_label: dict[str, int] = {}
    for start, is_in, gtid, state in ex.rows(
            "SELECT start, isSchedIn, globalTid, threadState FROM SCHED_EVENTS "
            "ORDER BY start"):
        t, g = _int(start, "SCHED_EVENTS.start", ex.src), _int(gtid, "globalTid", ex.src)
        if not is_in:
            code = _int(state, "threadState", ex.src)
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
                sorted(label for label in by_label if label not in _LINUX_STATE)) +
            "): imported as sleeps (S), never as preemptions")


def _processes(ex: _Export, batch: Any) -> None:
    """Names of the processes and threads the rows mention (not the whole machine)."""
    pids = {r[2] for r in batch.events} | {r[GPU_PID] for r in batch.gpu}
    procs: dict[int, str | None] = dict.fromkeys(pids)
    if ex.has("PROCESSES"):
        for pid, name in ex.rows("SELECT pid, name FROM PROCESSES"):
            if pid in procs and isinstance(name, str):
                procs[pid] = clean_text(name)[:64]
    batch.processes = [{"pid": p, "comm": c, "rank": batch.rank, "local_rank": batch.local_rank,
                        "world_size": batch.world_size} for p, c in sorted(procs.items())]
    tids = {(r[3], r[2]) for r in batch.events}
    names: dict[int, str] = {}
    if ex.has("ThreadNames"):
        for name_id, gtid in ex.rows("SELECT nameId, globalTid FROM ThreadNames"):
            if isinstance(gtid, int):
                names[_tid(gtid)] = clean_text(ex.text(name_id))[:64]
    batch.tasks = [(tid, pid, names.get(tid)) for tid, pid in sorted(tids)]
