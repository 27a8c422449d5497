"""Whose I/O a D-state wait was: its time charged to the requests it waited for.

A thread reading a file (a read, a page fault on a mapped file, an fsync) sleeps in D
state until its own requests complete. Those requests are its own: the wait is its own
I/O (``block_io``, culprit itself), however busy the disk is. Only the time its own
requests spent *queued* (submitted, not yet issued to the device: the tracer records
each request's owner, the task that submitted it, and its time queued before issue)
while other processes' requests were in service goes to those processes, shared in
proportion to their overlap. A wait with no request of its own in flight waited for
someone else's I/O (a page another process is reading, a journal commit): the
overlapping requests' owners share it. A wait with no request recorded at all is still
I/O when it slept where a thread waits for a page or buffer to be read
(``folio_wait_bit_common``...) or was ended by the block layer's completion (a
``kworker/N:MH`` or ``irq/`` thread, ``ksoftirqd``): its own request, unrecorded.

The kernel threads that only dispatch or complete requests are never culprits.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

from fleetd.analyze.reading.nodeview import OFF_CPU, Ev, NodeView, overlap

# Wait channels of a thread waiting for a page, buffer or request to be read or written.
IO_WCHANS = ("folio_wait", "wait_on_page", "io_schedule", "wait_for_completion_io",
             "bit_wait_io", "wait_on_buffer", "submit_bio_wait", "__folio_lock",
             "__lock_page", "filemap_fault", "blk_mq_get_tag", "wait_on_page_writeback")


def io_worker(comm: object) -> bool:
    """A kernel thread that dispatches or completes block I/O for others: the block
    layer's high-priority workers (``kworker/1:1H``), interrupt threads, softirqs."""
    c = str(comm or "")
    if c.startswith(("irq/", "ksoftirqd/", "kblockd")):
        return True
    return c.startswith("kworker/") and c.endswith("H")


def io_wchan(wchan: str | None) -> bool:
    return bool(wchan) and any(w in str(wchan) for w in IO_WCHANS)


@dataclass(slots=True)
class Charge:
    """One wait's time by owner: ``by_tid`` task -> ns (the victim's own tid for its own
    I/O), ``own`` how many of its own requests it waited for, ``others`` theirs."""

    is_io: bool = False
    by_tid: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    own: list[Ev] = field(default_factory=list)
    others: list[Ev] = field(default_factory=list)
    queued_ns: int = 0  # of the wait, the time its own requests sat behind others'


class Queues:
    """Each request's time queued before issue (``args.queued_ns``), read once per
    request id; and the file a read or fsync waited on, once per thread and fd."""

    def __init__(self, view: NodeView) -> None:
        self.view = view
        self._q: dict[int, int] = {}
        self._files: dict[tuple[int, int, int], str | None] = {}

    def file_of(self, e: Ev) -> str | None:
        """The path of the fd the wait ``e`` was in a syscall on (a read, an fsync), as
        the tracer named it on some wait of the same thread on that fd (it names each fd
        on one wait a second); None outside such a syscall or when never named."""
        if not e.ret:
            return None
        v = self.view
        fd = v.conn.execute("SELECT bytes FROM event_data WHERE id = ?", (e.rowkey,)
                            ).fetchone()  # the syscall's first argument: the fd
        key = (e.tid, e.ret, int(fd[0] or 0) if fd else -1)
        if key not in self._files:
            # The first such wait by id, found from the args' side: only events with args
            # can have the path, and a wait never named (as a fsync's fd may be) was a
            # walk of every event of the node. CROSS JOIN keeps that order of the loops.
            row = v.conn.execute(
                "SELECT json_extract(a.args, '$.fd.path') FROM event_args a CROSS JOIN "
                "event_data d ON d.id = a.id WHERE a.id BETWEEN ? AND ? AND d.tid = ? AND "
                "d.op = ? AND d.ret = ? AND d.bytes = ? AND json_extract(a.args, '$.fd.path') "
                "IS NOT NULL LIMIT 1",
                (v.node.lo, v.node.hi, *key[:1], OFF_CPU, *key[1:])).fetchone()
            self._files[key] = str(row[0]) if row and row[0] else None
        return self._files[key]

    def faulted(self, e: Ev) -> bool:
        """Whether the wait ``e`` was a page fault on a mapped file: its recorded kernel
        stack passes through filemap_fault (the file itself is not recorded)."""
        row = self.view.conn.execute("SELECT json_extract(args, '$.kstack') FROM event_args "
                                     "WHERE id = ?", (e.rowkey,)).fetchone()
        return bool(row and row[0] and "filemap_fault" in str(row[0]))

    def of(self, reqs: list[Ev]) -> dict[int, int]:
        want = [b.rowkey for b in reqs if b.rowkey not in self._q]
        for i in range(0, len(want), 500):
            part = want[i:i + 500]
            self._q.update(dict.fromkeys(part, 0))
            for key, q in self.view.conn.execute(
                    "SELECT id, json_extract(args, '$.queued_ns') FROM event_args WHERE id IN "
                    f"({','.join('?' * len(part))})", part):
                self._q[int(key)] = int(q or 0) if isinstance(q, int | float) else 0
        return {b.rowkey: self._q.get(b.rowkey, 0) for b in reqs}


_QUEUES: weakref.WeakKeyDictionary[NodeView, Queues] = weakref.WeakKeyDictionary()


def queues_for(view: NodeView) -> Queues:
    """The view's request queue times, read once per request for all its waits."""
    q = _QUEUES.get(view)
    if q is None:
        q = _QUEUES[view] = Queues(view)
    return q


def charge(view: NodeView, queues: Queues, victim_pid: int, victim_tid: int, t0: int,
           t1: int, wchan: str | None, waker: int) -> Charge:
    """Who owns the D-state wait [t0, t1) of ``victim_tid`` (see the module's text)."""
    out = Charge()
    reqs = [b for b in view.blocks_overlapping(t0, t1)
            if not io_worker(view.who(b.tid)["comm"])]
    slept = max(0, t1 - t0)
    out.own = [b for b in reqs if _pid(view, b) == victim_pid]
    out.others = [b for b in reqs if _pid(view, b) not in (victim_pid, 0)]
    if out.own:
        out.is_io = True
        behind = _behind(view, queues, out.own, t0, t1)
        taken = _share(behind, out.others, out.by_tid)
        out.queued_ns = taken
        out.by_tid[victim_tid] += max(0, slept - taken)
    elif out.others:
        out.is_io = True
        _share([(t0, t1)], out.others, out.by_tid)
    elif io_wchan(wchan) or (waker and io_worker(view.who(waker)["comm"])):
        out.is_io = True  # its own read, not recorded (a request below the threshold)
        out.by_tid[victim_tid] += slept
    return out


def _pid(view: NodeView, b: Ev) -> int:
    return int(b.pid or view.who(b.tid)["pid"] or 0)


def _behind(view: NodeView, queues: Queues, own: list[Ev], t0: int, t1: int
            ) -> list[tuple[int, int]]:
    """The parts of [t0, t1) in which some own request was queued and none of them
    was in service: the time the victim's I/O waited behind the device's other work."""
    q = queues.of(own)
    queued = _union([(max(t0, b.ts - q[b.rowkey]), min(t1, b.ts)) for b in own])
    served = _union([(max(t0, b.ts), min(t1, b.end)) for b in own])
    return _minus(queued, served)


def _share(spans: list[tuple[int, int]], others: list[Ev], into: dict[int, int]) -> int:
    """Each span's time split among the other requests in service during it, in
    proportion to their overlap; what no request overlaps stays unassigned. Returns
    the time assigned."""
    given = 0
    for a, b in spans:
        ov = {r.rowkey: overlap(a, b, r.ts, r.end) for r in others}
        total = sum(ov.values())
        if not total:
            continue
        covered = sum(hi - lo for lo, hi in _union(
            [(max(a, r.ts), min(b, r.end)) for r in others if ov[r.rowkey]]))
        for r in others:
            if ov[r.rowkey]:
                ns = covered * ov[r.rowkey] // total
                into[r.tid] += ns
                given += ns
    return given


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(spans: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in spans:
        pieces = [(a, b)]
        for c, d in cut:
            pieces = [p for lo, hi in pieces for p in ((lo, min(hi, c)), (max(lo, d), hi))
                      if p[1] > p[0]]
        out += pieces
    return out
