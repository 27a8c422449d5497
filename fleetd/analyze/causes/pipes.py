"""Blocked on a peer: the GPU-feeding thread sleeping in a write to a full pipe, FIFO,
socket or terminal, whose other end drains it too slowly.

A training loop that prints each step to stdout piped to a slow log shipper, to an SSH
terminal, or to a remote collector's socket sleeps in ``write()`` once the buffer is
full (``pipe_write``, ``sock_sendmsg``, ``n_tty_write``), until the reader takes some
out and wakes it. The tracer records the syscall each sleep was in and its fd, names
what the fd was (``args.fd``: ``pipe:[INODE]``, ``socket:[INODE]`` with its remote
address, ``/dev/pts/N``) and the processes holding the other end
(:mod:`fleetd.trace.enrich.fdpeers`). ``pipe_blocked`` states the thread's time asleep in
such writes over its wall time, names the object and the reader: the holders that
read it, else the processes whose wakeups ended the waits (a pipe's reader wakes the
writer as it makes room).

Reads from an empty pipe or socket that other processes fill are ``data_starvation``'s
(fleetd.analyze.causes.contention): the producers are the culprits there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import cast

import orjson

from fleetd.analyze.causes.chains import Chain
from fleetd.analyze.causes.contention import Sleep, feeders, sleeps
from fleetd.analyze.causes.io_owner import io_worker
from fleetd.analyze.causes.rules import Context, rule_chain
from fleetd.analyze.reading.answers_chain import ChainDetail, EvidenceItem, RankedCulprit
from fleetd.analyze.reading.waits import OUTPUT_RETS  # writes: waits for room at the other end
from fleetd.store.schema import FdInfo
from fleetd.store.timeparse import format_ns

MIN_IMPACT = 0.01  # below 1 % of wall time a blocked write is noise
EXAMPLES = 3


def pipe_rule(ctx: Context) -> list[Chain]:
    """One chain per feeding thread whose blocked writes took >= 1 % of its wall time."""
    out = []
    for pid, main in feeders(ctx):
        tid, wall = int(main["tid"]), int(main["wall_ns"])
        blocked = [s for s in sleeps(ctx, tid) if s.ret in OUTPUT_RETS]
        lost = sum(s.slept for s in blocked)
        if not wall or lost / wall < MIN_IMPACT:
            continue
        out.append(_chain(ctx, pid, tid, blocked, lost, lost / wall))
    return out


def _fd_infos(ctx: Context, waits: list[Sleep]) -> dict[int, FdInfo]:
    """fd -> what the tracer named it (args.fd), from any of these waits that carries
    it (the tracer names each fd on one wait a second)."""
    keys = [s.rowkey for s in waits if s.rowkey]
    found: dict[int, FdInfo] = {}
    for i in range(0, len(keys), 500):
        part = keys[i:i + 500]
        for key, text in ctx.view.conn.execute(
                "SELECT id, json_extract(args, '$.fd') FROM event_args WHERE id IN "
                f"({','.join('?' * len(part))}) AND json_extract(args, '$.fd') IS NOT NULL",
                part):
            fd = next(s.arg for s in waits if s.rowkey == key)
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError:
                continue
            info = _checked(value)
            if info is not None:
                found.setdefault(fd, info)
    return found


def _checked(value: object) -> FdInfo | None:
    """``args.fd`` as the tracer writes it (fleetd.store.schema.FdInfo); None when the
    stored JSON is not that shape."""
    if not isinstance(value, dict):
        return None
    names = all(isinstance(value.get(k), str | None) for k in ("path", "kind", "remote"))
    peers = value.get("peers", [])
    held = isinstance(peers, list) and all(
        isinstance(h, dict) and isinstance(h.get("pid"), int) for h in peers)
    # Checked just above: every key a reader here takes has the type FdInfo gives it.
    return cast(FdInfo, value) if names and held else None


def _pid_of(ctx: Context, tid: int) -> int | None:
    pid = ctx.view.tasks.get(tid, (None, None))[0]
    return None if pid in (None, 0) else int(pid)


def _chain(ctx: Context, pid: int, tid: int, blocked: list[Sleep], lost: int,
           share: float) -> Chain:
    by_fd: dict[int, int] = defaultdict(int)
    for s in blocked:
        by_fd[s.arg] += s.slept
    fd = max(by_fd.items(), key=lambda kv: kv[1])[0]
    on_fd = [s for s in blocked if s.arg == fd]
    info = _fd_infos(ctx, on_fd).get(fd, FdInfo())
    culprits, ended = _other_end(ctx, pid, on_fd, info)
    kind = str(info.get("kind") or "unknown")
    detail: ChainDetail = {"fd": fd, "object": info.get("path"), "kind": kind,
              "remote": info.get("remote"), "waits": len(blocked),
              "blocked_ns": lost, "blocked_share": round(share, 6),
              "longest_ns": max(s.slept for s in blocked),
              "fd_share": round(by_fd[fd] / max(1, lost), 3),
              "readers": [{"pid": h["pid"], "comm": h.get("comm")}
                          for h in info.get("peers") or [] if "r" in str(h.get("mode"))]}
    ev: list[EvidenceItem] = [{
        "kind": "peer_wait", "fd": fd, "object": info.get("path"), "what": kind,
        "remote": info.get("remote"), "waits": len(on_fd), "lost_ns": by_fd[fd],
        "text": f"{len(on_fd)} write(s) to fd {fd} ({_object(info, fd)}) slept "
                f"{by_fd[fd] / 1e6:.1f} ms in all, longest "
                f"{max(s.slept for s in on_fd) / 1e6:.1f} ms: waiting for room"}]
    ev += [{"kind": "peer", "pid": c["pid"], "comm": c["comm"], "role": c["role"],
            "text": f"{c['role']} {c['comm']} (pid {c['pid']})"
                    + (f", ended {c['share']:.0%} of the waits' time" if c.get("share")
                       else "")} for c in culprits]
    ev += _examples(ctx, on_fd, fd, info)
    explained = ended / max(1, by_fd[fd]) if culprits and ended else (
        1.0 if culprits else 0.5)
    ch = rule_chain(ctx, "pipe_blocked", pid, None, explained, share, ev, detail, tid)
    ch.culprits = culprits
    return ch


def _other_end(ctx: Context, pid: int, waits: list[Sleep], info: FdInfo
               ) -> tuple[list[RankedCulprit], int]:
    """The processes at the other end: those the tracer found holding it to read (for
    a pipe or FIFO), ranked by the wait time their wakeups ended, then any other
    process whose wakeups ended the waits (a socket's or terminal's reader, unseen
    through the fd). Returns them and the wait time they ended."""
    woke: dict[int, int] = defaultdict(int)
    for s in waits:
        p = _pid_of(ctx, s.waker) if s.waker else None
        # A kernel thread that only delivered (ksoftirqd handing a loopback socket's
        # window update back, an interrupt thread) is not the other end.
        if p is not None and p != pid and not io_worker(ctx.view.who(p)["comm"]):
            woke[p] += s.slept
    readers = {int(h["pid"]): h for h in info.get("peers") or []
               if "r" in str(h.get("mode")) and int(h["pid"]) != pid}
    total = sum(s.slept for s in waits)
    out: list[RankedCulprit] = []
    for p in sorted(set(readers) | set(woke), key=lambda p: (-woke.get(p, 0), p)):
        h = readers.get(p)
        held = h.get("comm") if h is not None else None
        comm = ctx.view.names.get(p) or held or ctx.view.who(p)["comm"]
        out.append({"pid": p, "comm": comm, "self": False, "tids": [],
                    "share": round(woke.get(p, 0) / max(1, total), 3),
                    "role": "reader" if h is not None or info.get("kind") in (
                        "pipe", "fifo") else "woken by"})
    # The reader that ended most of the waits first; a reader found only through the fd
    # keeps its place among them.
    return out[:5], sum(woke.get(c["pid"], 0) for c in out[:5])


def _object(info: FdInfo, fd: int) -> str:
    path = info.get("path")
    if not path:
        return "not named: the process was gone, or not traced with syscalls"
    remote = f" to {info['remote']}" if info.get("remote") else ""
    return f"{path}{remote}"


def _examples(ctx: Context, waits: list[Sleep], fd: int, info: FdInfo
              ) -> list[EvidenceItem]:
    items: list[EvidenceItem] = []
    for s in sorted(waits, key=lambda s: -s.slept)[:EXAMPLES]:
        who = ctx.view.who(s.waker) if s.waker else None
        item: EvidenceItem = {
            "kind": "off_cpu", "ts_ns": s.ts, "time": format_ns(s.ts), "dur_ns": s.slept,
            "state": "S", "fd": fd, "id": ctx.view.node.event_id(s.rowkey), "culprit": who,
            "text": f"write to {info.get('path') or f'fd {fd}'} slept {s.slept / 1e6:.2f} ms"
                    + (f", woken by {who['comm']} (pid {who['pid']})" if who else "")}
        if not who:
            del item["culprit"]  # no wakeup recorded: the key is left out, not null
        items.append(item)
    return sorted(items, key=lambda e: e["ts_ns"])
