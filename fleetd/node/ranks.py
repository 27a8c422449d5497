"""Each traced NCCL rank's last calls, kept in memory: ``GET /api/v1/ranks`` and the hang
gauge of ``/metrics``.

The tracer hands its decoded batches to the agent's writer; :class:`ObservedWriter` (the
writer the agent gives the tracer) shows every batch to a :class:`RankBook` on the
way. The book keeps, per process that made NCCL calls, its last collective per
communicator (with its :data:`RECENT` collectives before it: number, time, op and bytes,
what the fleet client aligns the ranks' numbers by, :mod:`fleetd.analyze.distributed.align`), its
last send/receive per peer and its last CUDA or NCCL call, plus the rank identity and
exit facts of the process rows. A poll then costs a copy of that
state and two small ``/proc`` reads per rank, never a database query, and it does not
wait for a reader slot (like ``health``), so heavy queries cannot delay it.

What the book holds is what the tracer saw since the agent started; it is bounded
(:data:`MAX_RANKS` processes, :data:`MAX_COMMS` communicators and :data:`MAX_PEERS`
send/receive entries per process; the least recently active process goes first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from fleetd.analyze.distributed.hangs import RankEntry, RankView, waits
from fleetd.analyze.distributed.lateness import lateness
from fleetd.node.api import STATE, json_response
from fleetd.security.procfs import ENVIRON_MAX, STAT_MAX, read_bounded
from fleetd.store.catalog import (
    BY_CODE,
    BY_NAME,
    CUDA_CALLS,
    NCCL,
    NCCL_COLLECTIVES,
    NCCL_INITS,
    NCCL_P2P,
)
from fleetd.store.schema import EventArgs, EventRow, ProcessFields
from fleetd.store.torchrun import job_of, ranks_of
from fleetd.store.writer import BatchWriter
from fleetd.wire import paths
from fleetd.wire.shapes import RanksReply

log = logging.getLogger("fleetd.node.ranks")

MAX_RANKS = 512  # processes with NCCL calls
MAX_COMMS = 64  # communicators per process
MAX_PEERS = 256  # (communicator, op, peer) send/receive entries per process
MAX_IDENTITIES = 4096  # process rows remembered for ranks not seen yet
# Collectives kept per communicator of a process (number, entry, op, bytes): enough for
# the fleet client to align ranks whose agents attached at different moments (a few
# steps of a job's op/size sequence), about 2.5 KB per communicator in an answer.
RECENT = 64

THROTTLE_CODE = BY_NAME["cpu_throttle"].code  # a cgroup's CPU-quota sample (side rows)
THROTTLE_STALE_NS = 10_000_000_000  # a sample older than this: the process left a quota
MAX_THROTTLED = 1024  # processes whose last throttling sample is kept
_NCCL = NCCL.code_set
_CUDA = CUDA_CALLS.code_set  # CUDA runtime, graph and driver calls
_COLLECTIVES = NCCL_COLLECTIVES.code_set
_P2P_OPS = NCCL_P2P.code_set
_INITS = NCCL_INITS.code_set
_STATES = {"R": "running", "S": "sleeping", "I": "sleeping", "D": "d_state", "T": "stopped",
           "t": "stopped", "Z": "exited", "X": "exited", "x": "exited"}
_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
        "MASTER_PORT")


def op_name(code: int) -> str:
    op = BY_CODE.get(code)
    return op.name if op is not None else f"op{code}"


@dataclass(slots=True)
class _Comm:
    communicator: str
    comm_hash: str | None = None
    rank: int | None = None
    nranks: int | None = None
    op: int = 0
    seq: int = 0
    ts_ns: int = 0
    dur_ns: int = 0
    ret: int = 0
    calls: int = 0
    # (seq, ts_ns, op, bytes) of its last collectives, oldest first
    recent: deque[tuple[int, int, int, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT))


@dataclass(slots=True)
class _P2P:
    communicator: str
    comm_hash: str | None
    op: int
    peer: int
    seq: int
    ts_ns: int
    dur_ns: int
    ret: int
    calls: int = 1


@dataclass(slots=True)
class _Proc:
    pid: int
    start_ticks: int | None
    tid: int = 0  # the thread of its last NCCL call: its state is the rank's
    comms: dict[str, _Comm] = field(default_factory=dict)
    p2p: dict[tuple[str, int, int], _P2P] = field(default_factory=dict)
    last: tuple[int, int, int, int] | None = None  # ts_ns, dur_ns, op, ret
    active_ns: int = 0


@dataclass(slots=True)
class _Identity:
    comm: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    job: str | None = None
    exit_ns: int | None = None
    exit_code: int | None = None


class RankBook:
    """The ranks' last calls, fed by the tracer's thread, read by the agent's loop."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self._lock = threading.Lock()
        self._procs: dict[int, _Proc] = {}
        self._idents: dict[int, _Identity] = {}
        # pid -> (sample's end, throttled periods / periods) of its cgroup's last sample
        self._throttled: dict[int, tuple[int, float]] = {}
        self.dropped = 0  # processes forgotten to stay under MAX_RANKS
        self.failures = 0  # batches the book could not read (never the writer's loss)

    # ---- the tracer's side ------------------------------------------------------------

    def observe(self, rows: Sequence[EventRow],
                args: Sequence[tuple[int, EventArgs]] = ()) -> None:
        """Take note of a batch on its way to the writer; never raises."""
        try:
            self._observe(rows, args)
        except Exception:  # the book must never cost the database a batch
            self.failures += 1
            if self.failures == 1:
                log.exception("NCCL rank book: a batch could not be read")

    def _observe(self, rows: Sequence[EventRow],
                 args: Sequence[tuple[int, EventArgs]]) -> None:
        # NCCL args always come as mappings; only repeated launches come as text.
        nccl = [(rows[i], a) for i, a in args
                if rows[i][4] in _NCCL and not isinstance(a, str)]
        quota = [(rows[i], a) for i, a in args
                 if rows[i][4] == THROTTLE_CODE and not isinstance(a, str)]
        if quota:
            self._throttling(quota)
        procs = self._procs
        if not nccl and not procs:
            return
        new = {r[2] for r, _ in nccl if r[2] not in procs}
        found = {pid: self._first_sight(pid) for pid in new}  # /proc reads, unlocked
        with self._lock:
            for pid, (ticks, ident) in found.items():
                self._admit(pid, ticks, ident)
            for row, a in nccl:
                p = self._procs.get(row[2])
                if p is not None:
                    self._nccl(p, row, a)
        if procs:
            self._last_calls(rows)

    def _throttling(self, samples: Sequence[tuple[EventRow, Mapping[str, Any]]]) -> None:
        """Each sampled cgroup's share of throttled CFS periods, for every process in it
        (the sample row names one; its args list the cgroup's members)."""
        with self._lock:
            for row, a in samples:
                ratio = row[8] / row[9] if row[9] > 0 else 0.0
                pids = a.get("pids")
                members = [p for p in pids[:64] if isinstance(p, int)] \
                    if isinstance(pids, list) else []
                for pid in {row[2], *members}:
                    self._throttled[pid] = (row[0] + row[1], ratio)
            while len(self._throttled) > MAX_THROTTLED:
                del self._throttled[min(self._throttled, key=lambda k: self._throttled[k][0])]

    def throttled(self, now_ns: int | None = None) -> list[tuple[int, str, float]]:
        """(pid, comm, throttled share of CFS periods) of each traced process whose cgroup
        was sampled under a CPU quota within THROTTLE_STALE_NS."""
        now = time.time_ns() if now_ns is None else now_ns
        with self._lock:
            fresh = [(pid, r) for pid, (ts, r) in self._throttled.items()
                     if now - ts <= THROTTLE_STALE_NS]
        out = []
        for pid, ratio in sorted(fresh):
            comm = _read(self.proc_root / str(pid) / "comm")
            if comm is not None:  # gone: no series
                out.append((pid, comm.strip(), round(ratio, 4)))
        return out

    def _last_calls(self, rows: Sequence[EventRow]) -> None:
        procs = self._procs
        # The one pass over every row, kept to a comprehension with two tests: each
        # rank's last CUDA runtime/driver row in the batch (rings are drained one after
        # the other, so "last" is exact per ring and within one poll across them).
        last = {r[2]: r for r in rows if r[4] in _CUDA and r[2] in procs}
        if not last:
            return
        with self._lock:
            for pid, r in last.items():
                p = procs.get(pid)
                if p is not None and (p.last is None or r[0] >= p.last[0]):
                    p.last = (r[0], r[1], r[4], r[5])
                    p.active_ns = max(p.active_ns, r[0])

    def _nccl(self, p: _Proc, row: EventRow, a: Mapping[str, Any]) -> None:
        ts, dur, _pid, tid, op, ret = row[:6]
        ptr = _text(a.get("comm")) or "0x0"
        hashed = _text(a.get("comm_hash"))
        p.tid = tid
        p.active_ns = max(p.active_ns, ts)
        if p.last is None or ts >= p.last[0]:
            p.last = (ts, dur, op, ret)
        if op in _COLLECTIVES:
            c = self._comm(p, ptr)
            if c is None:
                return
            seq = a.get("seq")
            c.calls += 1
            # Numbered by the tracer (in the kernel) per (process, communicator); an older
            # tracer without it: counted here.
            seq = seq if isinstance(seq, int) and seq > 0 else c.seq + 1
            if seq >= c.seq:
                c.op, c.seq, c.ts_ns, c.dur_ns, c.ret = op, seq, ts, dur, ret
            if not c.recent or seq > c.recent[-1][0]:
                c.recent.append((seq, ts, op, row[6]))
            elif seq < c.recent[0][0] and c.recent[-1][1] < ts:
                c.recent.clear()  # numbered afresh (a new tracer): the old numbers go
                c.recent.append((seq, ts, op, row[6]))
            if hashed:
                c.comm_hash = hashed
                c.rank, c.nranks = _int(a.get("rank")), _int(a.get("nranks"))
        elif op in _P2P_OPS:
            peer = row[9]
            key = (ptr, op, peer)
            e = p.p2p.get(key)
            seq = a.get("seq")
            if e is None:
                if len(p.p2p) >= MAX_PEERS:
                    return
                n = seq if isinstance(seq, int) and seq > 0 else 1
                p.p2p[key] = _P2P(ptr, hashed, op, peer, n, ts, dur, ret)
                return
            e.calls += 1
            n = seq if isinstance(seq, int) and seq > 0 else e.seq + 1
            if n >= e.seq:
                e.seq, e.ts_ns, e.dur_ns, e.ret = n, ts, dur, ret
                e.comm_hash = hashed or e.comm_hash
        elif op in _INITS and ret == 0 and hashed and ptr != "0x0":
            # A communicator created: the rank sits before its collective 1 until then.
            c = self._comm(p, ptr)
            if c is not None and c.seq == 0:
                c.op, c.ts_ns, c.dur_ns, c.ret = op, ts, dur, ret
                c.comm_hash, c.rank, c.nranks = hashed, row[9], row[8]

    def _comm(self, p: _Proc, ptr: str) -> _Comm | None:
        c = p.comms.get(ptr)
        if c is None:
            if len(p.comms) >= MAX_COMMS:
                return None
            c = p.comms[ptr] = _Comm(ptr)
        return c

    def _first_sight(self, pid: int) -> tuple[int | None, _Identity]:
        """The process's start time (to notice a reused pid) and its torchrun identity,
        read once, when its first NCCL call is seen."""
        fields = _stat(self.proc_root / str(pid) / "stat")
        ticks = _int_text(fields[19]) if fields and len(fields) > 19 else None
        env = _environ(self.proc_root / str(pid) / "environ")
        # The same reading of torchrun's environment as the tracer's process rows.
        r = ranks_of(env)
        return ticks, _Identity(rank=r["rank"], local_rank=r["local_rank"],
                                world_size=r["world_size"], job=job_of(env))

    def _admit(self, pid: int, ticks: int | None, env: _Identity) -> None:
        if pid in self._procs:
            return
        if len(self._procs) >= MAX_RANKS:
            oldest = min(self._procs.values(), key=lambda x: x.active_ns)
            del self._procs[oldest.pid]
            self.dropped += 1
        self._procs[pid] = _Proc(pid, ticks)
        known = self._idents.setdefault(pid, _Identity())
        for k in ("rank", "local_rank", "world_size", "job"):
            if getattr(known, k) is None:
                setattr(known, k, getattr(env, k))

    def observe_processes(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Process rows (rank identity from the environment, exits); never raises."""
        try:
            with self._lock:
                for r in rows:
                    pid = r.get("pid")
                    if not isinstance(pid, int):
                        continue
                    ident = self._idents.get(pid)
                    if ident is None:
                        if len(self._idents) >= MAX_IDENTITIES:
                            self._forget_identity()
                        ident = self._idents[pid] = _Identity()
                    for k in ("comm", "rank", "local_rank", "world_size", "job"):
                        if r.get(k) is not None:
                            setattr(ident, k, r[k])
                    if r.get("exit_ns") is not None:
                        ident.exit_ns, ident.exit_code = r["exit_ns"], r.get("exit_code")
        except Exception:
            self.failures += 1
            log.exception("NCCL rank book: process rows could not be read")

    def _forget_identity(self) -> None:
        for pid in self._idents:
            if pid not in self._procs:
                del self._idents[pid]
                return

    # ---- the loop's side --------------------------------------------------------------

    def snapshot(self, node: str, now_ns: int | None = None) -> list[RankEntry]:
        """Every rank as ``GET /api/v1/ranks`` lists it (docs/api.md), most recently
        active first, with its process state read now."""
        with self._lock:
            procs = [(_copy(p), self._idents.get(p.pid) or _Identity())
                     for p in self._procs.values()]
        now = time.time_ns() if now_ns is None else now_ns
        procs.sort(key=lambda x: -x[0].active_ns)
        return [self._rank_json(p, ident, now) for p, ident in procs]

    def _rank_json(self, p: _Proc, ident: _Identity, now: int) -> RankEntry:
        state, code, wchan = self.proc_state(p)
        exited = state == "exited"
        out: RankEntry = {
            "pid": p.pid, "comm": ident.comm, "rank": ident.rank,
            "local_rank": ident.local_rank, "world_size": ident.world_size, "job": ident.job,
            "state": state, "state_code": code, "wchan": wchan,
            "exit_code": ident.exit_code if exited else None,
            "exited_age_ns": max(0, now - ident.exit_ns) if exited and ident.exit_ns
            else None,
            "collectives": [],
            "last_call": None,
            "p2p": [],
        }
        # The recent calls of the communicator a torchrun-matched rank is judged by (its
        # latest one without a hash); one with a hash counts from its creation and needs
        # none. So an answer carries at most RECENT of them per rank.
        plain = max((c for c in p.comms.values() if not c.comm_hash),
                    key=lambda c: c.ts_ns, default=None)
        for c in sorted(p.comms.values(), key=lambda c: -c.ts_ns):
            out["collectives"].append({
                "communicator": c.communicator, "comm_hash": c.comm_hash, "rank": c.rank,
                "nranks": c.nranks, "op": op_name(c.op), "seq": c.seq, "ts_ns": c.ts_ns,
                "age_ns": max(0, now - c.ts_ns), "dur_ns": c.dur_ns, "ret": c.ret,
                "calls": c.calls,
                "recent": [[n, max(0, now - ts), op_name(o), b] for n, ts, o, b in c.recent]
                if c is plain else []})
        if p.last is not None:
            ts, dur, op, ret = p.last
            out["last_call"] = {"op": op_name(op), "ts_ns": ts, "age_ns": max(0, now - ts),
                                "dur_ns": dur, "ret": ret}
        for e in sorted(p.p2p.values(), key=lambda e: -e.ts_ns):
            out["p2p"].append({
                "communicator": e.communicator, "comm_hash": e.comm_hash, "op": op_name(e.op),
                "peer": e.peer, "seq": e.seq, "ts_ns": e.ts_ns, "age_ns": max(0, now - e.ts_ns),
                "dur_ns": e.dur_ns, "ret": e.ret, "calls": e.calls})
        return out

    def proc_state(self, p: _Proc) -> tuple[str, str | None, str | None]:
        """(state, the letter of /proc/PID/stat, wait channel) of the thread that made the
        rank's last NCCL call (its process when that thread is gone). A pid that now
        belongs to another process (a different start time) has exited."""
        base = self.proc_root / str(p.pid)
        fields = _stat(base / "stat")
        if not fields or len(fields) < 20:
            return "exited", None, None
        if p.start_ticks is not None and _int_text(fields[19]) != p.start_ticks:
            return "exited", None, None
        task = base / "task" / str(p.tid) if p.tid and p.tid != p.pid else base
        tfields = _stat(task / "stat") if task is not base else fields
        if not tfields:
            task, tfields = base, fields
        code = tfields[0]
        if fields[0] in ("Z", "X", "x"):
            code = fields[0]  # the process is dead, whatever its thread's record says
        state = _STATES.get(code, "unknown")
        wchan = None
        if state not in ("running", "exited"):
            text = _read(task / "wchan")
            wchan = text.strip() if text and text.strip() not in ("", "0") else None
        return state, code, wchan

    def views(self, node: str) -> list[RankView]:
        """The ranks as :mod:`fleetd.analyze.distributed.hangs` judges them (the agent's gauge)."""
        return [RankView.of(node, r) for r in self.snapshot(node)]

    def count(self) -> int:
        return len(self._procs)


def _copy(p: _Proc) -> _Proc:
    return _Proc(p.pid, p.start_ticks, p.tid,
                 {k: _Comm(c.communicator, c.comm_hash, c.rank, c.nranks, c.op, c.seq,
                           c.ts_ns, c.dur_ns, c.ret, c.calls, deque(c.recent, RECENT))
                  for k, c in p.comms.items()},
                 {k: _P2P(e.communicator, e.comm_hash, e.op, e.peer, e.seq, e.ts_ns,
                          e.dur_ns, e.ret, e.calls) for k, e in p.p2p.items()},
                 p.last, p.active_ns)


# ---- /proc ------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    raw = read_bounded(str(path), STAT_MAX)
    return None if raw is None else raw.decode(errors="replace")


def _stat(path: Path) -> list[str] | None:
    """The fields of a /proc stat file after the command name (which may hold spaces)."""
    text = _read(path)
    if not text or ")" not in text:
        return None
    return text.rsplit(")", 1)[1].split()


def _environ(path: Path) -> dict[str, str]:
    raw = read_bounded(str(path), ENVIRON_MAX)
    if raw is None:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        name = key.decode(errors="replace")
        if sep and name in _ENV:
            out[name] = value.decode(errors="replace")[:256]
    return out


def _int_text(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _text(v: Any) -> str | None:
    return v[:64] if isinstance(v, str) and v else None


# ---- wiring -----------------------------------------------------------------------------


class ObservedWriter(BatchWriter):
    """The agent's batch writer, showing every batch of events and process rows to the
    rank book before queueing it."""

    def __init__(self, path: Path, node: str, book: RankBook, **kw: Any) -> None:
        super().__init__(path, node, **kw)
        self.book = book

    def add_events(self, rows: Sequence[EventRow],
                   args: Sequence[tuple[int, EventArgs]] = ()) -> bool:
        self.book.observe(rows, args)
        return super().add_events(rows, args)

    def add_processes(self, rows: Iterable[ProcessFields]) -> None:
        listed = list(rows)
        self.book.observe_processes(listed)
        super().add_processes(listed)


RANKBOOK = web.AppKey("rankbook", RankBook)


async def ranks(request: web.Request) -> web.StreamResponse:
    """``GET /api/v1/ranks``: every traced NCCL rank's last calls and process state."""
    st = request.app[STATE]
    book = request.app[RANKBOOK]
    now = time.time_ns()
    answer: RanksReply = {"node": st.node, "now_ns": now, "tracing": st.tracing,
                          "ranks": book.snapshot(st.node, now), "dropped": book.dropped}
    return json_response(answer)


def local_waits(book: RankBook, node: str) -> Callable[[], list[tuple[str, str, int]]]:
    """For /metrics: per group of this node's ranks (matching, key), how long its ranks
    have waited (ns; 0 when nobody waits)."""
    def measure() -> list[tuple[str, str, int]]:
        if not book.count():
            return []
        return [(g.matching, g.key, ns) for g, ns in waits(book.views(node))]

    return measure


def local_late(book: RankBook, node: str) -> list[tuple[str, str, int, float]]:
    """For /metrics: (matching, group key, rank, share of the last seconds' collectives
    it entered last) of each rank of a group with two or more ranks on this node (what
    one node can judge without the others: fleetd.analyze.distributed.lateness)."""
    if book.count() < 2:
        return []
    return [(x.matching, x.key, x.rank, round(x.ratio, 4))
            for x in lateness(book.views(node))]


ROUTES = [web.get(paths.RANKS, ranks)]
