"""Waits of the job's own making: a lock another thread holds, data that comes too slowly.

A GPU-feeding thread that sleeps is not idle by choice. Two rules read its sleeps by
reason (:mod:`fleetd.analyze.reading.waits`) together with who woke each one:

- ``lock_contention``: futex waits on a lock *another thread of the same process*
  holds. The thread that wakes the victim is the one that released the lock: the
  holder. For a CPython process whose waits all sit on one futex word and whose holder
  keeps running, the lock is most likely the interpreter lock (the GIL). Its waits time
  out every switch interval, and a wait that times out is woken by whichever task the
  timer interrupted: such wakers are bystanders, never holders. Traced with stacks, some
  wakeups carry the waker's stack, taken as it released the lock: the holder's most
  frequent Python line among them says where it was (``culprit.where``).
- ``data_starvation``: waits for input (a pipe, a socket, poll/epoll: a DataLoader
  queue) woken by *other processes*: the producers. A producer near 100 % of a CPU is
  the bottleneck; an idle one points elsewhere (its own input, the queue size).

Both state as the time lost the victim thread's whole time in that wait reason, the
``lock`` or ``data`` column of the per-thread breakdown (every recorded sleep, the
run-queue tail after the wakeup excluded: that is CPU time), so ``impact`` is a share of
its wall time, the breakdown and the chain say the same, and one severity function
ranks them with every other chain. The wakeups say who held the lock or produced the
data; ``explained`` is how much of the wait those account for. DataLoader
over-subscription (the workers take the CPU from the feeder) is the opposite case and
is a separate rule.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from fleetd.analyze.causes.chains import OFF_CPU, Chain
from fleetd.analyze.causes.rules import Context, rule_chain
from fleetd.analyze.reading.answers_chain import ChainDetail, EvidenceItem, RankedCulprit
from fleetd.analyze.reading.data import code, in_list, job_peers
from fleetd.analyze.reading.frames import top_python_frame
from fleetd.analyze.reading.rows import ThreadRow
from fleetd.analyze.reading.spanreads import SLEEP_RETS, SpanRow
from fleetd.analyze.reading.waits import reason
from fleetd.store.timeparse import format_ns

WAKEUP, RUNQ = code("wakeup"), code("runq_wait")
MIN_IMPACT = 0.01  # below 1 % of wall time a wait is noise, not a cause
GIL_ADDR_SHARE = 0.8  # the waits sit on one lock object...
GIL_HOLDER_BUSY = 0.5  # ...released by a thread that runs at least half the time
PRODUCER_BUSY = 0.8  # a producer wanting the CPU this much of the time is the bottleneck
# Futex words this close together belong to one lock object: a condition variable waits
# on alternating words of its own (glibc's two signal groups), a mutex beside it.
LOCK_OBJECT_BYTES = 64
EXAMPLES = 3
READ_RETS = SLEEP_RETS  # the sleeps the wait and pipe rules read (NodeView.sleep_rows)
PY_RUNTIME = "_PyRuntime+"  # CPython's runtime state, where the interpreter lock lives


@dataclass(frozen=True, slots=True)
class Sleep:
    """One sleep of the victim: when, how long (run-queue tail excluded), why, on what
    (the futex word or fd), who woke it (0: unknown) and the waker's stack at the
    wakeup (its hash in ``stacks``; 0: none taken)."""

    ts: int
    slept: int
    why: str
    arg: int
    waker: int
    stack: int = 0
    ret: int = 0  # the syscall it slept in, + 1 (waits.reason's input)
    rowkey: int = 0  # the off-CPU record, for its args (the fd it slept on)


@dataclass(frozen=True, slots=True)
class Where:
    """Where a waker was as it woke the victim: its most frequent top Python frame over
    the wakeups that carry its stack (``stacked``; ``hits`` of them at that frame) and
    that frame's most frequent whole stack, innermost first."""

    frame: str
    stack: list[str]
    hits: int
    stacked: int


def sleeps(ctx: Context, tid: int) -> list[Sleep]:
    """The thread's sleeps (S state) in the span that the rules read (for a lock, for
    input, in a write: :data:`READ_RETS`), each with its waker; read once per explain
    (the wait and the pipe rules both ask), for every feeding thread at once."""
    key = ("sleeps", tid)
    if key not in ctx.memo:
        tids = {tid} | {int(main["tid"]) for _, main in feeders(ctx)}
        for t, found in _read_sleeps(ctx, sorted(tids)).items():
            ctx.memo.setdefault(("sleeps", t), found)
    return list(ctx.memo[key])


def _read_sleeps(ctx: Context, tids: list[int]) -> dict[int, list[Sleep]]:
    """Per thread of ``tids``: its sleeps. One pass over the span's rows for all of
    them (three queries per thread scanned the span 3 x threads times), made with the
    rules' calls where they read them (NodeView.sleep_rows)."""
    rows = ctx.view.sleep_rows(tids, ctx.span[0], ctx.span[1] + 1)
    return {t: _matched(*rows[t]) for t in tids}


def _matched(offs: list[SpanRow], wakes: list[SpanRow], tails: list[SpanRow]) -> list[Sleep]:
    """Each off-CPU sleep with the first wakeup and run-queue tail inside it (all three
    in time order: one pass over each). Rows of spanreads.SPAN_COLS: id, ts_ns, dur_ns,
    pid, tid, op, a0, bytes, peer, stack, ret."""
    out = []
    w = q = 0
    nw, nq = len(wakes), len(tails)
    whys: dict[int, str] = {}  # reason() of each syscall seen: a few, for many sleeps
    for key, ts, dur, _, _, _, _, arg, _, _, ret in offs:
        end = ts + dur
        # The first wakeup at or after the sleep's start (the sleeps come in time
        # order, so the one of the last sleep is where to look on from).
        while w < nw and wakes[w][1] < ts:
            w += 1
        while q < nq and tails[q][1] < ts:
            q += 1
        wake = wakes[w] if w < nw and wakes[w][1] <= end else None
        tail = tails[q] if q < nq and tails[q][1] <= end + 1 else None
        why = whys.get(ret)
        if why is None:
            why = whys[ret] = reason(ret)
        out.append(Sleep(ts, max(0, dur - (int(tail[2]) if tail else 0)), why,
                         int(arg or 0), int(wake[8]) if wake else 0,
                         int(wake[9] or 0) if wake else 0, int(ret or 0), int(key)))
    return out


def waker_where(ctx: Context, hashes: list[int]) -> Where | None:
    """Where a waker was, from the stacks of its wakeups (hashes, one per wakeup; 0 for
    a wakeup without one); None when none carries a Python frame."""
    hashes = [h for h in hashes if h]
    if not hashes:
        return None
    frames: dict[int, list[str]] = {}
    for h, text in ctx.view.conn.execute(
            f"SELECT hash, frames FROM stacks WHERE hash IN {in_list(set(hashes))}"):
        try:
            value = orjson.loads(text)
        except (orjson.JSONDecodeError, TypeError):
            value = [text]
        frames[int(h)] = [str(f) for f in value] if isinstance(value, list) else [str(value)]
    tops: Counter[str] = Counter()
    stacks: dict[str, Counter[int]] = defaultdict(Counter)
    for h in hashes:
        top = top_python_frame(frames.get(h, []))
        if top is not None:
            tops[top] += 1
            stacks[top][h] += 1
    if not tops:
        return None
    # Most hits first; a tie goes to the frame that sorts first, so the answer is stable.
    top, hits = min(tops.items(), key=lambda kv: (-kv[1], kv[0]))
    best = min(stacks[top].items(), key=lambda kv: (-kv[1], kv[0]))[0]
    return Where(top, frames[best], hits, len(hashes))


def feeders(ctx: Context) -> list[tuple[int, ThreadRow]]:
    """(pid, feeding thread) of every process with CUDA calls."""
    return ctx.feeders()


def _thread_row(ctx: Context, tid: int) -> ThreadRow | None:
    return next((t for t in ctx.threads if int(t["tid"]) == tid), None)


def _busy(ctx: Context, tid: int) -> float | None:
    """The share of its wall time a traced thread wanted the CPU (running, or runnable
    and queued); None when it was not traced."""
    t = _thread_row(ctx, tid)
    if t is None or not int(t["wall_ns"]):
        return None
    return _demand(t)


def _demand(t: ThreadRow) -> float:
    return (int(t["running_ns"]) + int(t["runq_ns"])) / int(t["wall_ns"])


def _examples(ctx: Context, mine: list[Sleep], text: str,
              ended: list[Sleep] | None = None) -> list[EvidenceItem]:
    """The longest sleeps, those the culprit ended (``ended``; default: all of
    ``mine``) first; any other one says it ended without the culprit."""
    ended = mine if ended is None else ended
    pick = sorted(ended, key=lambda s: -s.slept)[:EXAMPLES]
    if len(pick) < EXAMPLES:
        chosen = set(pick)
        pick += sorted((s for s in mine if s not in chosen),
                       key=lambda s: -s.slept)[:EXAMPLES - len(pick)]
    by = set(ended)
    items: list[EvidenceItem] = []
    for s in pick:
        who = ctx.view.who(s.waker) if s.waker else None
        name = f"{who['thread'] or who['comm']} (tid {s.waker})" if who else ""
        item: EvidenceItem = {"kind": "off_cpu", "ts_ns": s.ts, "time": format_ns(s.ts),
                              "dur_ns": s.slept, "reason": s.why, "addr": f"{s.arg:#x}",
                              "culprit": who, "text": ""}  # culprit and text: below
        if who is None or s not in by:
            del item["culprit"]  # only a waker that ended the sleep is named
        if who is not None and s in by:
            item["text"] = f"{text} for {s.slept / 1e6:.2f} ms, woken by {name}"
        elif who is not None:
            item["text"] = (f"{text} for {s.slept / 1e6:.2f} ms, ended while {name} was on the "
                            "CPU (a timeout: a bystander)")
        else:
            item["text"] = f"{text} for {s.slept / 1e6:.2f} ms, no wakeup recorded (a timeout)"
        items.append(item)
    return sorted(items, key=lambda e: int(e["ts_ns"]))


# ---- lock contention inside the process ---------------------------------------------


def wait_rules(ctx: Context) -> list[Chain]:
    """Both rules over each feeding thread's sleeps, read once per thread."""
    fed = feeders(ctx)
    # Another rank of the job is never a producer: that wait is the collective's.
    peers = job_peers(ctx.view.conn, ctx.view.node, ctx.view.win) if fed else {}
    return [ch for pid, main in fed for ch in _feeder_chains(
        ctx, pid, int(main["tid"]), peers.get(pid, frozenset()))]


def _feeder_chains(ctx: Context, pid: int, tid: int, peers: frozenset[int]) -> list[Chain]:
    mine = sleeps(ctx, tid)
    out = []
    # A lock released by another thread of the same process; input from another process.
    lock = _lock_chain(ctx, pid, tid, [s for s in mine if s.why == "lock"])
    if lock is not None:
        out.append(lock)
    data = _attributed(ctx, tid, mine, "data",
                       lambda w: _pid_of(ctx, w) not in (None, pid, *peers))
    if data is not None:
        out.append(_data_chain(ctx, pid, tid, *data))
    return out


def _attributed(ctx: Context, tid: int, mine: list[Sleep], why: str,
                by: Callable[[int], bool]) -> tuple[list[Sleep], int, int, float] | None:
    """The sleeps of reason ``why`` whose waker ``by`` accepts, their time, the reason's
    whole recorded time and its share of the thread's wall time (the breakdown's
    column); None when that share is below :data:`MIN_IMPACT` or no waker qualifies."""
    share = ctx.share(tid, why)
    waits = [s for s in mine if s.why == why]
    kept = [s for s in waits if s.waker and by(s.waker)]
    if not kept or share < MIN_IMPACT:
        return None
    return kept, sum(s.slept for s in kept), sum(s.slept for s in waits), share


def _lock_chain(ctx: Context, pid: int, tid: int, waits: list[Sleep]) -> Chain | None:
    """The thread's futex waits, the lock object most of them sit on, and the thread
    of the same process that holds it.

    The lost share is the thread's whole time waiting for locks (the breakdown's
    ``lock`` column); ``explained``, how much of that the lock object accounts for. The
    holder is the thread that released the lock when a release ended a wait. Many
    waits end otherwise: CPython's interpreter lock is waited for with a 5 ms timeout,
    and a wait that times out is woken by whatever task was on the CPU when the timer
    fired, a bystander. When no release by a thread of the same process was recorded
    at all and the lock is the interpreter lock, the holder is the thread of the
    process that was awake (running or runnable, so holding it) for most of the waits.
    """
    share = ctx.share(tid, "lock")
    if not waits or share < MIN_IMPACT:
        return None
    total = sum(s.slept for s in waits)
    by_addr: Counter[int] = Counter()
    for s in waits:
        by_addr[s.arg] += s.slept
    addr, addr_ns = _lock_object(by_addr)
    words = [a for a in by_addr if 0 <= a - addr < LOCK_OBJECT_BYTES]
    on = [s for s in waits if 0 <= s.arg - addr < LOCK_OBJECT_BYTES]
    symbol = _lock_name(ctx, tid, words)
    python = str(ctx.view.names.get(pid) or "").startswith("python")
    gil_like = (symbol or "").startswith(PY_RUNTIME) or (
        not symbol and python and addr_ns >= GIL_ADDR_SHARE * max(1, total))
    released = [s for s in on if s.waker and s.waker != tid and _pid_of(ctx, s.waker) == pid]
    by_holder: Counter[int] = Counter()
    for s in released:
        by_holder[s.waker] += s.slept
    inferred = False
    if not by_holder:
        # Unnamed, the lock could be one shared with another process that ends the waits.
        named = (symbol or "").startswith(PY_RUNTIME)
        if not gil_like or (not named and _foreign_holder(ctx, pid, on)):
            return None
        awake = _awake_during(ctx, pid, tid, on)
        if not awake:
            return None
        by_holder, inferred = awake, True
    holder, held_ns = by_holder.most_common(1)[0]
    busy = _busy(ctx, holder)
    # The interpreter lock lives in CPython's _PyRuntime: a named lock there is it. Without
    # a name, a python process whose waits sit on one lock held by a busy thread.
    gil = (symbol or "").startswith(PY_RUNTIME) or (gil_like and (busy or 0) >= GIL_HOLDER_BUSY)
    lost = sum(s.slept for s in released)
    base = addr_ns if inferred else lost
    culprits = [_thread_culprit(ctx, t, ns, base, pid) for t, ns in by_holder.most_common(5)]
    if inferred:
        culprits[0]["inferred"] = True
    # Where the holder was as it released the lock: its stacks at those wakeups.
    at = waker_where(ctx, [s.stack for s in released if s.waker == holder])
    if at is not None:
        culprits[0]["where"], culprits[0]["stack"] = at.frame, at.stack
    explained = addr_ns / max(1, total)
    detail: ChainDetail = {"lock_addr": f"{addr:#x}", "lock_symbol": symbol,
              "lock_share": round(share, 6), "share": round(share, 6), "share_of": "lock",
              "estimate": round(lost / ctx.span_ns, 4),
              "waits": len(on), "released": len(released), "holder_tid": holder,
              "holder_thread": culprits[0]["thread"], "holder_inferred": inferred,
              "holder_busy": None if busy is None else round(busy, 3), "gil": gil,
              "addresses": len(by_addr),
              "holder_where": at.frame if at else None,
              "holder_stacks": at.stacked if at else 0,
              "holder_where_share": round(at.hits / at.stacked, 3) if at else None}
    ended = (f"{len(released)} of them ({lost / 1e6:.1f} ms) ended when another thread of "
             "the same process released it" if released else
             "none ended by a release the tracer saw (waits that time out are woken by "
             "whatever ran when the timer fired)")
    ev: list[EvidenceItem] = [
        {"kind": "lock_wait", "addr": f"{addr:#x}", "waits": len(on), "lost_ns": addr_ns,
           "released_ns": lost,
           "text": f"{len(on)} futex waits on the lock at {addr:#x} ({addr_ns / 1e6:.1f} ms, "
                   f"{explained:.0%} of the {total / 1e6:.1f} ms the thread waited for "
                   f"locks; {share:.1%} of wall in all); {ended}"},
          {"kind": "holder", "tid": holder, "thread": culprits[0]["thread"],
           "running_share": detail["holder_busy"],
           "text": _holder_text(culprits[0], busy, held_ns, base, at, inferred)}]
    if at is not None:
        ev[-1]["where"], ev[-1]["stack"] = at.frame, at.stack
    ev += _examples(ctx, on, "futex wait", released)
    ch = rule_chain(ctx, "lock_contention", pid, None, explained, share, ev, detail, tid)
    ch.culprits = culprits
    return ch


def _foreign_holder(ctx: Context, pid: int, waits: list[Sleep]) -> bool:
    """True when one other process ended most of ``waits`` whose waker is known: a lock
    shared with that process (a multiprocessing lock or semaphore), not the interpreter
    lock, whose timed-out waits are ended by whichever task was on the CPU."""
    by_pid: Counter[int] = Counter()
    known = 0
    for s in waits:
        if s.waker:
            known += s.slept
            p = _pid_of(ctx, s.waker)
            if p not in (None, pid):
                by_pid[p] += s.slept
    return bool(by_pid) and by_pid.most_common(1)[0][1] > 0.5 * known


def _awake_during(ctx: Context, pid: int, tid: int, waits: list[Sleep]) -> Counter[int]:
    """Per other traced thread of process ``pid``: how long it was awake (running, or
    runnable: not asleep in a recorded sleep) during ``waits``. A Python thread awake
    in the interpreter holds its lock."""
    v, t0, t1 = ctx.view, ctx.span[0], ctx.span[1] + 1
    spans = sorted((s.ts, s.ts + s.slept) for s in waits)
    out: Counter[int] = Counter()
    whole = sum(b - a for a, b in spans)
    for t in ctx.threads:
        other = int(t["tid"])
        if int(t["pid"]) != pid or other == tid:
            continue
        asleep = v.conn.execute(
            "SELECT ts_ns, ts_ns + dur_ns FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND "
            "id BETWEEN ? AND ? AND tid = ? AND op = ? AND a0 & 255 != 0 ORDER BY ts_ns",
            (t0 - 10**9, t1, v.node.lo, v.node.hi, other, OFF_CPU)).fetchall()
        awake = whole - sum(_covered(asleep, a, b) for a, b in spans)
        if awake > 0:
            out[other] = awake
    return out


def _covered(spans: list[tuple[int, int]], t0: int, t1: int) -> int:
    """How much of [t0, t1) the sorted, disjoint ``spans`` cover."""
    i = max(0, bisect.bisect_right(spans, (t0, 1 << 62)) - 1)
    total = 0
    for s0, s1 in spans[i:]:
        if s0 >= t1:
            break
        total += max(0, min(s1, t1) - max(s0, t0))
    return total


def _lock_name(ctx: Context, tid: int, addrs: list[int]) -> str | None:
    """The symbol the tracer found for one of the lock object's futex words, if any."""
    v = ctx.view
    row = v.conn.execute(
        "SELECT json_extract(x.args, '$.lock') FROM (SELECT id FROM event_data WHERE "
        "ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND tid = ? AND op = ? AND bytes "
        f"IN {in_list(addrs)}) e JOIN event_args x ON x.id = e.id LIMIT 1",
        (ctx.span[0], ctx.span[1] + 1, v.node.lo, v.node.hi, tid, OFF_CPU)).fetchone()
    return str(row[0]) if row and row[0] else None


def _lock_object(by_addr: Counter[int]) -> tuple[int, int]:
    """The lock object most of the wait time sits on: the lowest address of the group of
    futex words within :data:`LOCK_OBJECT_BYTES` of each other with the most time."""
    best = (0, 0)
    addrs = sorted(by_addr)
    i = 0
    while i < len(addrs):
        j = i
        while j + 1 < len(addrs) and addrs[j + 1] - addrs[i] < LOCK_OBJECT_BYTES:
            j += 1
        ns = sum(by_addr[a] for a in addrs[i:j + 1])
        if ns > best[1]:
            best = (addrs[i], ns)
        i = j + 1
    return best


def _thread_culprit(ctx: Context, tid: int, ns: int, lost: int, pid: int) -> RankedCulprit:
    who = ctx.view.who(tid)
    return {"pid": who["pid"], "tid": tid, "comm": who["comm"], "thread": who["thread"],
            "ns": ns, "share": round(ns / max(1, lost), 3), "self": who["pid"] == pid}


def _holder_text(c: RankedCulprit, busy: float | None, held: int, lost: int,
                 at: Where | None, inferred: bool = False) -> str:
    name = c["thread"] or c["comm"]
    ran = f", on or waiting for a CPU {busy:.0%} of the time" if busy is not None else ""
    where = (f"; it was in {at.frame} at {at.hits} of the {at.stacked} wakeups whose "
             "stack was taken" if at is not None else "")
    if inferred:
        return (f"thread {name} (tid {c['tid']}) was awake for {held / max(1, lost):.0%} of "
                f"the waits: running Python, it holds the interpreter lock{ran}")
    return (f"thread {name} (tid {c['tid']}) released the lock {held / max(1, lost):.0%} "
            f"of the times{ran}{where}")


# ---- data starvation ------------------------------------------------------------------


def _pid_of(ctx: Context, tid: int) -> int | None:
    pid = ctx.view.tasks.get(tid, (None, None))[0]
    return None if pid in (None, 0) else int(pid)


def _data_chain(ctx: Context, pid: int, tid: int, fed: list[Sleep], lost: int,
                total: int, share: float) -> Chain:
    by_pid: dict[int, int] = defaultdict(int)
    for s in fed:
        by_pid[_pid_of(ctx, s.waker) or 0] += s.slept
    producers: list[RankedCulprit] = []
    for p, ns in sorted(by_pid.items(), key=lambda kv: -kv[1])[:5]:
        busy = _process_busy(ctx, p)
        producers.append({"pid": p, "comm": ctx.view.names.get(p) or ctx.view.who(p)["comm"],
                          "ns": ns, "share": round(ns / max(1, lost), 3), "self": False,
                          "busy": None if busy is None else round(busy, 3)})
    top_busy = producers[0].get("busy")
    bound = top_busy is not None and top_busy >= PRODUCER_BUSY
    detail: ChainDetail = {
              "data_share": round(share, 6), "share": round(share, 6), "share_of": "data",
              "estimate": round(lost / ctx.span_ns, 4), "waits": len(fed),
              "producers": len(by_pid), "producer_busy": top_busy, "producer_bound": bound}
    ev: list[EvidenceItem] = [{
        "kind": "data_wait", "waits": len(fed), "lost_ns": lost,
        "text": f"{len(fed)} waits for input ({lost / 1e6:.1f} ms, {lost / max(1, total):.0%} "
                f"of the thread's {total / 1e6:.1f} ms waiting for input; {share:.1%} of wall "
                f"in all) ended by {len(by_pid)} other process(es)"}]
    ev += [{"kind": "producer", "pid": p["pid"], "running_share": p["busy"],
            "text": f"producer {p['comm']} (pid {p['pid']}) "
                    + (f"was on or waiting for a CPU {p['busy']:.0%} of the time"
                       if p["busy"] is not None
                       else "was not traced")} for p in producers]
    ev += _examples(ctx, fed, "waited for data")
    ch = rule_chain(ctx, "data_starvation", pid, None, lost / max(1, total), share, ev,
                    detail, tid)
    ch.culprits = producers
    return ch


def _process_busy(ctx: Context, pid: int) -> float | None:
    """The CPU demand of a process's busiest traced thread (None: not traced)."""
    shares = [_demand(t) for t in ctx.threads if int(t["pid"]) == pid and int(t["wall_ns"])]
    return max(shares, default=None)
