"""Collective numbers aligned across ranks: which call of rank b is which call of rank a.

The tracer numbers a process's collectives per communicator handle (``seq``, 1, 2, ...,
docs/schema.md "NCCL records") from the moment it began tracing that process. Ranks
whose agents attached to a running job at different moments therefore number the same
collective differently: rank b's number plus an **offset** is rank a's. Matching
collectives by the raw numbers then compares different steps, and a verdict follows the
moments tracing began instead of the job.

Where the numbers come from, best first:

* ``communicator``: every rank's communicator creation was traced (the calls carry the
  communicator's hash): each rank's numbers count from the creation, so they agree
  (confidence ``exact``).
* ``calls``: otherwise the offsets are found from the calls themselves. Every rank of a
  collective passes the same op and element count (so the same bytes), and arrives at
  it within about one step of the others. For a pair of ranks, every offset under which
  some of their calls overlap is tried: an offset under which the op/bytes sequences
  disagree is impossible; when exactly one offset agrees (sizes that change from step
  to step, a mix of ops) it is the answer (``high``, by ``signature``). When several
  agree (a sequence that repeats), the arrival times decide: the right offset pairs
  calls made at the same moment, a wrong one pairs calls a whole repeat apart; the
  nearest is taken when it is clearly nearer than the runner-up (at most a third of its
  median time difference, and apart by more than twice the clock error: ``medium``, by
  ``timing``). Otherwise it is ``ambiguous``: the numbers as recorded are kept when they
  are among the near-tied offsets, else the nearest offset is used, and the answer says
  so. With fewer than :data:`MIN_PAIRS` calls to compare (an agent that has just
  attached) there is no evidence either way: the numbers as recorded, ``unverified``.
* ``as numbered``: no call history to compare (an older agent): the numbers are taken
  as they are (``unverified``).

Each rank (or each stretch of a rank's calls whose numbers run on: the numbers restart
when its agent restarts) is aligned against one already aligned, the one it overlaps in
time most, starting from the one with the most calls; the job's numbering is then that
of the rank whose numbers are highest (traced longest), so every offset is >= 0.

Pure functions over plain values: the hang watcher (ages on each node's clock) and the
arrival analysis (timestamps in one clock) both use them.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K", bound=Hashable)

COMMUNICATOR, CALLS, AS_NUMBERED = "communicator", "calls", "as numbered"
EXACT, HIGH, MEDIUM, AMBIGUOUS, UNVERIFIED = "exact", "high", "medium", "ambiguous", "unverified"
CONFIDENCES = (EXACT, HIGH, MEDIUM, UNVERIFIED, AMBIGUOUS)  # best first

PROBES = 64  # calls of a rank compared per candidate offset
NEAREST = 16  # per probe, same-signature calls of the other rank each side in time
MAX_APART_NS = 30_000_000_000  # calls of one collective are never further apart
MIN_PAIRS = 4  # calls compared before an offset counts as agreeing
NEIGHBOURS = 8  # offsets either side of the best also tried (a repeating sequence)
TIMING_RATIO = 3  # the runner-up's median time difference at least this many times the best


class Call(NamedTuple):
    """One collective call of a rank: its number as recorded, its arrival (in a clock
    shared with the other ranks, up to their clock error), its op and bytes. (A tuple:
    a local file may hand over a million of them.)"""

    seq: int
    t_ns: int
    op: str
    bytes: int

    @property
    def sig(self) -> tuple[str, int]:
        return self.op, self.bytes


@dataclass(slots=True)
class Pair:
    """How one rank was aligned against another."""

    offset: int  # its numbers + offset = the other's
    confidence: str
    by: str  # signature | timing | numbering | none
    pairs: int = 0  # calls compared at that offset
    agreeing: int = 0  # offsets whose op/bytes sequences agree
    residual_ns: int | None = None  # median |arrival difference| at that offset
    runner_up_ns: int | None = None  # the same at the next best agreeing offset
    reason: str = ""


@dataclass(slots=True)
class Alignment(Generic[K]):
    """Per rank (or stretch of a rank's calls): the offset to the job's numbering."""

    method: str  # communicator | calls | as numbered
    offsets: dict[K, int] = field(default_factory=dict)
    pairs: dict[K, Pair] = field(default_factory=dict)  # calls: how each was aligned
    reference: K | None = None

    @property
    def confidence(self) -> str:
        """The weakest confidence over the ranks."""
        if self.method == COMMUNICATOR:
            return EXACT
        if self.method == AS_NUMBERED:
            return UNVERIFIED
        worst = [p.confidence for p in self.pairs.values()]
        return max(worst, key=CONFIDENCES.index, default=HIGH)

    def confidence_of(self, key: K) -> str:
        p = self.pairs.get(key)
        if p is not None:
            return p.confidence
        return {COMMUNICATOR: EXACT, AS_NUMBERED: UNVERIFIED}.get(self.method, HIGH)

    def sure(self, key: K) -> bool:
        """Whether the key's numbers may be compared with the others' (not ambiguous)."""
        return self.confidence_of(key) != AMBIGUOUS

    def by(self) -> str:
        """What decided: signature, timing, or both (the weakest pair's way first)."""
        ways = sorted({p.by for p in self.pairs.values() if p.by != "reference"})
        return "+".join(ways) if ways else {COMMUNICATOR: "communicator counters",
                                            AS_NUMBERED: "numbers as recorded"}.get(
                                                self.method, "reference")

    def describe(self) -> str:
        """One phrase for a verdict: how the ranks' collective numbers were matched."""
        if self.method == COMMUNICATOR:
            return "collective numbers counted from the communicator's creation (exact)"
        if self.method == AS_NUMBERED:
            return "collective numbers as each agent recorded them (not verified)"
        what = {"signature": "the ops and sizes of the calls",
                "timing": "the arrival times of the calls",
                "signature+timing": "the ops, sizes and arrival times of the calls"}
        text = f"collective numbers aligned from {what.get(self.by(), 'the calls')}"
        shifted = sum(1 for o in self.offsets.values() if o)
        if shifted:
            text += f" ({shifted} rank(s) renumbered)"
        return f"{text}, {self.confidence} confidence"


def communicator(keys: Sequence[K]) -> Alignment[K]:
    """Every rank numbered from the communicator's creation: offsets 0, exact."""
    return Alignment(COMMUNICATOR, dict.fromkeys(keys, 0))


def as_numbered(keys: Sequence[K]) -> Alignment[K]:
    return Alignment(AS_NUMBERED, dict.fromkeys(keys, 0))


def stretches(calls: Sequence[Call]) -> list[list[Call]]:
    """A rank's calls (in time order) cut where the numbers stop running on: each piece
    numbers from one start (an agent restart begins again at 1)."""
    out: list[list[Call]] = []
    for c in calls:
        if out and c.seq > out[-1][-1].seq:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def align(calls: Mapping[K, Sequence[Call]],
          error_ns: Callable[[K, K], int | None] = lambda a, b: 0) -> Alignment[K]:
    """Offsets that put every key's numbers into one numbering, from the calls.

    ``calls``: per key, its calls with strictly increasing numbers (one stretch).
    ``error_ns(a, b)``: the bound on comparing a time of ``a`` with one of ``b`` (None
    when unknown: then only the op/bytes sequence can decide).
    """
    keys = [k for k, v in calls.items() if v]
    out: Alignment[K] = Alignment(CALLS)
    if not keys:
        return out
    ref = max(keys, key=lambda k: len(calls[k]))
    out.reference = ref
    offsets: dict[K, int] = {ref: 0}
    out.pairs[ref] = Pair(0, HIGH, "reference")
    spans = {k: (calls[k][0].t_ns, calls[k][-1].t_ns) for k in keys}
    pending = [k for k in keys if k != ref]
    while pending:
        best: tuple[int, K, K] | None = None
        for k in pending:
            for a in offsets:
                ov = _overlap(spans[k], spans[a])
                if best is None or ov > best[0]:
                    best = (ov, k, a)
        assert best is not None
        _, k, a = best
        pending.remove(k)
        p = pair(calls[a], calls[k], error_ns(a, k))
        base = out.pairs[a]
        if base.confidence == AMBIGUOUS and p.confidence != AMBIGUOUS:
            p.confidence, p.reason = AMBIGUOUS, "aligned against an ambiguous rank"
        elif CONFIDENCES.index(base.confidence) > CONFIDENCES.index(p.confidence):
            p.confidence = base.confidence
        offsets[k] = offsets[a] + p.offset
        out.pairs[k] = p
    for k in keys:
        offsets.setdefault(k, 0)
    # The numbering of the rank traced longest (highest numbers): every offset >= 0.
    low = min(offsets.values())
    out.offsets = {k: o - low for k, o in offsets.items()}
    return out


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return min(a[1], b[1]) - max(a[0], b[0])


def pair(ref: Sequence[Call], other: Sequence[Call], error_ns: int | None) -> Pair:
    """The offset d with ``other``'s number + d = ``ref``'s for the same collective."""
    by_seq = {c.seq: c for c in ref}
    by_sig: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for c in sorted(ref, key=lambda c: c.t_ns):
        ts, seqs = by_sig.setdefault(c.sig, ([], []))
        ts.append(c.t_ns)
        seqs.append(c.seq)
    probes = _probes(other, ref[0].t_ns, ref[-1].t_ns)
    if not probes:
        return Pair(0, UNVERIFIED, "numbering", reason="no calls made while the other rank "
                    "was traced: numbers as recorded")
    candidates: set[int] = set()
    for c in probes:
        found = by_sig.get(c.sig)
        if found is None:
            continue
        ts, seqs = found
        i = bisect.bisect_left(ts, c.t_ns)
        for j in range(max(0, i - NEAREST), min(len(ts), i + NEAREST)):
            if abs(ts[j] - c.t_ns) <= MAX_APART_NS:
                candidates.add(seqs[j] - c.seq)
    if not candidates:
        return Pair(0, AMBIGUOUS, "none", reason="no call of the same op and size at about "
                    "the same time")
    scored = {d: _score(d, probes, by_seq) for d in candidates}
    most = max(s[0] for s in scored.values())
    if most < MIN_PAIRS:
        return Pair(0, UNVERIFIED, "numbering", most, reason=f"{most} call(s) to compare, "
                    f"fewer than {MIN_PAIRS}: numbers as recorded")
    # Neighbours of the agreeing offsets: a repeating sequence agrees at several.
    for d in [d for d, s in scored.items() if s[1]]:
        for j in range(-NEIGHBOURS, NEIGHBOURS + 1):
            if d + j not in scored:
                scored[d + j] = _score(d + j, probes, by_seq)
    agree = sorted((s[2], abs(d), d, s[0]) for d, s in scored.items() if s[1])
    if not agree:
        return Pair(0, AMBIGUOUS, "none", reason="no offset matches the op/size sequence")
    r1, _, d1, n1 = agree[0]
    if len(agree) == 1:
        return Pair(d1, HIGH, "signature", n1, 1, r1)
    r2 = agree[1][0]
    err = error_ns
    if err is not None and r2 >= TIMING_RATIO * r1 and r2 - r1 > 2 * err:
        return Pair(d1, MEDIUM, "timing", n1, len(agree), r1, r2)
    # Near-tied: keep the numbers as recorded if that is one of them, else the nearest.
    bar = max(TIMING_RATIO * r1, r1 + 2 * (err or 0))
    tied = [a for a in agree if a[0] <= bar] if err is not None else agree
    chosen = next((a for a in tied if a[2] == 0), agree[0])
    why = ("the op/size sequence repeats and the clock error is unknown" if err is None
           else f"the op/size sequence repeats and arrivals at the best offsets are "
           f"{_ms(r1)} and {_ms(r2)} apart")
    return Pair(chosen[2], AMBIGUOUS, "numbering" if chosen[2] == 0 else "timing",
                chosen[3], len(agree), chosen[0], r2 if chosen[2] == d1 else r1, why)


def _probes(calls: Sequence[Call], lo: int, hi: int) -> list[Call]:
    """Up to PROBES calls spread over those made while the other rank was traced."""
    inside = [c for c in calls if lo - MAX_APART_NS <= c.t_ns <= hi + MAX_APART_NS]
    if len(inside) <= PROBES:
        return inside
    step = len(inside) / PROBES
    return [inside[int(i * step)] for i in range(PROBES)]


def _score(d: int, probes: Sequence[Call], by_seq: Mapping[int, Call]
           ) -> tuple[int, bool, int]:
    """(calls compared, whether every op/bytes agrees, median |time difference|)."""
    diffs = []
    agree = True
    for c in probes:
        r = by_seq.get(c.seq + d)
        if r is None:
            continue
        if r.sig != c.sig:
            agree = False
        diffs.append(abs(c.t_ns - r.t_ns))
    n = len(diffs)
    return n, agree and n >= MIN_PAIRS, round(statistics.median(diffs)) if diffs else 0


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms"


def torchrun_key(job: str | None, world_size: int, ordinal: int = 1) -> str:
    """The group key of ranks matched by their torchrun identity: ``job/world_size``
    (``-`` for an unknown job), ``#n`` for a process's n-th communicator (the hang
    watcher groups the same way)."""
    return f"{job or '-'}/{world_size}" + (f"#{ordinal}" if ordinal > 1 else "")
