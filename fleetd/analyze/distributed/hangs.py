"""Hangs of distributed jobs, judged from each rank's last NCCL calls (pure functions).

Input: one :class:`RankView` per traced process that made NCCL calls, as node agents
report them (``GET /api/v1/ranks``): its rank identity, its last collective per
communicator, its last point-to-point call per peer and its process state. Every time
in it is an *age*, measured by the reporting node's own clock (its now minus the
call's entry), so clock skew between nodes never enters a verdict.

Ranks are matched into groups as the NCCL record contract says: by communicator (the
hash of NCCL's unique id, with the rank from the communicator's creation) where the
records carry one, else by the torchrun job (job id and world size, with the process's
RANK). Each agent numbers a rank's collectives from when it began tracing it, so before
numbers are compared they are aligned (:mod:`fleetd.analyze.distributed.align`): counted from the
communicator's creation where the agents saw it (exact), else from each rank's last
collectives (op, bytes and age) that the agent keeps; a rank whose offset cannot be
decided is ``ambiguous``, and no verdict rests on its number. A group of ranks is judged
three ways:

* **stuck**: a rank is stopped, in D state or dead (exited, not cleanly) while another
  one is alive and waiting, and the group has waited longer than the limit: the stuck
  ranks are the culprits, whatever the numbers say, and every other rank is a waiter
  (a rank blocked inside a collective, sleeping or spinning there, waits for the
  others; it is never the cause). The hang is a **collective** one when the aligned
  numbers show live ranks past the stuck one's last collective (they entered one it did
  not: the wait counts from the first of them), else **stalled** (no rank has entered a
  collective for longer than the limit; they wait after it, e.g. in their barrier).
* **collective** without a stuck rank: some live ranks have entered collective N and
  one of them has been in it longer than the limit, while other live ranks are still
  before N (aligned numbers, none of them ambiguous): those never arrived (busy
  elsewhere, or blocked outside NCCL); the ranks at N wait for them, stuck at the first
  collective a culprit has not entered (N itself unless the leaders queued more).
* **exited**: every rank of the group is dead, not all of them cleanly (exit status 0),
  the first of them recently: the rank that died first (the others followed it).
* **p2p**: the k-th ``ncclSend`` from a to b has no k-th ``ncclRecv`` at b (or the k-th
  receive no k-th send) for longer than the limit.

The node agent runs the same assessment over its local ranks for its ``/metrics``
gauge; the fleet client (:mod:`fleetd.fleet.hang`) over every node's ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from fleetd.analyze.distributed import align
from fleetd.analyze.distributed.align import Alignment, torchrun_key
from fleetd.store.catalog import NCCL_P2P_MATCH

STATES = ("running", "sleeping", "stopped", "d_state", "exited", "unknown")
STUCK = frozenset({"stopped", "d_state", "exited"})


# ---- a rank as its agent reports it (GET /api/v1/ranks, docs/api.md) ----------------------
# The agent (fleetd.node.ranks) writes these; fleetd.wire.ranks checks a node's answer
# and :meth:`RankView.of` reads one into the view below that the hang verdicts judge.


class RankCall(TypedDict):
    """A rank's last CUDA or NCCL call that returned (``GET /api/v1/ranks``)."""

    op: str
    ts_ns: int
    age_ns: int  # the agent's now_ns minus ts_ns, on its own clock
    dur_ns: int
    ret: int


class CommCall(RankCall):
    """A rank's last call on one communicator (to one peer, for a send or receive)."""

    communicator: str  # the communicator pointer, 0x...
    comm_hash: str | None
    seq: int
    calls: int


class RankCollective(CommCall):
    """A rank's last collective on one communicator."""

    rank: int | None
    nranks: int | None
    recent: list[list[Any]]  # [seq, age_ns, op, bytes], oldest first


class RankP2P(CommCall):
    """A rank's last send or receive to one peer on one communicator."""

    peer: int


class RankEntry(TypedDict):
    """One traced NCCL rank: its identity, last calls and process state now."""

    pid: int
    comm: str | None
    rank: int | None
    local_rank: int | None
    world_size: int | None
    job: str | None
    state: str  # running | sleeping | stopped | d_state | exited | unknown
    state_code: str | None
    wchan: str | None
    exit_code: int | None
    exited_age_ns: int | None
    collectives: list[RankCollective]
    last_call: RankCall | None
    p2p: list[RankP2P]


# ---- a rank as the verdicts read it ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Recent:
    """One of a rank's last collectives on a communicator, as its agent numbered it."""

    seq: int
    age_ns: int
    op: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Collective:
    """A rank's last collective on one communicator (or its creation, at seq 0)."""

    communicator: str  # the communicator pointer, as the process saw it ("0x...")
    comm_hash: str | None  # hash of the ncclUniqueId, when the creation was traced
    rank: int | None  # rank in the communicator, from its creation
    nranks: int | None
    op: str
    seq: int  # per (process, communicator) collective number, from 1
    age_ns: int  # the node's now minus the call's entry
    ret: int = 0
    recent: tuple[Recent, ...] = ()  # its last collectives before, oldest first


@dataclass(frozen=True, slots=True)
class PointToPoint:
    """A rank's last ``ncclSend``/``ncclRecv`` to/from one peer on one communicator."""

    communicator: str
    comm_hash: str | None
    op: str  # ncclSend | ncclRecv
    peer: int  # the peer's rank in the communicator
    seq: int  # per (process, communicator, op, peer), from 1
    age_ns: int
    ret: int = 0


@dataclass(frozen=True, slots=True)
class LastCall:
    op: str
    age_ns: int
    ret: int = 0


@dataclass(slots=True)
class RankView:
    node: str
    pid: int
    comm: str | None = None  # the process name
    rank: int | None = None  # RANK of the process (torchrun)
    world_size: int | None = None
    job: str | None = None  # torchrun job id (TORCHELASTIC_RUN_ID, else MASTER_ADDR:PORT)
    state: str = "unknown"  # one of STATES
    wchan: str | None = None  # the kernel function it waits in, when not running
    exit_code: int | None = None  # status passed to exit(), when it exited that way
    exited_age_ns: int | None = None  # how long ago it exited, when the tracer saw it
    collectives: list[Collective] = field(default_factory=list)
    last_call: LastCall | None = None  # its last CUDA or NCCL call that returned
    p2p: list[PointToPoint] = field(default_factory=list)

    @classmethod
    def of(cls, node: str, r: RankEntry) -> RankView:
        """One rank of an agent's answer (its own, or one checked by fleetd.wire.ranks)."""
        last = r["last_call"]
        return cls(
            node=node, pid=r["pid"], comm=r["comm"], rank=r["rank"],
            world_size=r["world_size"], job=r["job"], state=r["state"], wchan=r["wchan"],
            exit_code=r["exit_code"], exited_age_ns=r["exited_age_ns"],
            collectives=[Collective(c["communicator"], c["comm_hash"], c["rank"], c["nranks"],
                                    c["op"], c["seq"], c["age_ns"], c["ret"],
                                    tuple(Recent(*x) for x in c.get("recent", ())))
                         for c in r["collectives"]],
            last_call=LastCall(last["op"], last["age_ns"], last["ret"]) if last else None,
            p2p=[PointToPoint(e["communicator"], e["comm_hash"], e["op"], e["peer"], e["seq"],
                              e["age_ns"], e["ret"]) for e in r["p2p"]])

    @property
    def dead(self) -> bool:
        return self.state == "exited"

    @property
    def stuck(self) -> bool:
        """Cannot make progress by itself: stopped, in D state, or dead (not cleanly)."""
        if self.state == "exited":
            return self.exit_code != 0  # exit(0): a rank that finished its part
        return self.state in STUCK


@dataclass(slots=True)
class Member:
    """A rank in a group, at its last collective there (seq 0: created, none yet).
    ``seq`` is in the group's numbering once aligned; ``recorded`` as its agent has it."""

    view: RankView
    rank: int
    seq: int
    op: str
    age_ns: int
    communicator: str | None = None
    recent: tuple[Recent, ...] = ()
    recorded: int = -1  # the number as recorded (-1: the same as seq)
    sure: bool = True  # its alignment is not ambiguous

    def __post_init__(self) -> None:
        if self.recorded < 0:
            self.recorded = self.seq


@dataclass(slots=True)
class Group:
    matching: str  # communicator | torchrun
    key: str  # the comm_hash, or "JOB/WORLD_SIZE"
    size: int | None  # nranks / world_size, when known
    members: dict[int, Member] = field(default_factory=dict)  # by rank
    alignment: Alignment[int] | None = None  # how the members' numbers were aligned

    @property
    def label(self) -> str:
        if self.matching == "communicator":
            return f"communicator {self.key}"
        job, _, _ = self.key.rpartition("/")
        return f"job {job}"

    @property
    def max_seq(self) -> int:
        return max((m.seq for m in self.members.values()), default=0)

    @property
    def progress_age_ns(self) -> int:
        """How long ago the group's latest collective entry was."""
        return min((m.age_ns for m in self.members.values()), default=0)

    def missing(self) -> list[int]:
        """Ranks the group should have and nobody reported."""
        if not self.size or self.size > 1 << 16:
            return []
        return [r for r in range(self.size) if r not in self.members]

    def unsure(self) -> list[int]:
        """Ranks whose collective numbers could not be aligned with the others'."""
        return sorted(r for r, m in self.members.items() if not m.sure)


@dataclass(slots=True)
class Party:
    """One side of a hang: a rank that never arrived, or one that waits."""

    view: RankView
    rank: int
    seq: int | None  # its last collective (or p2p call) number in the group
    op: str | None
    age_ns: int | None  # how long ago it entered that call
    recorded: int | None = None  # that collective's number as its agent recorded it


@dataclass(slots=True)
class Hang:
    kind: str  # collective | stalled | exited | p2p
    group: Group
    seq: int  # the collective (or k-th send/recv) the waiting ranks wait for
    op: str | None  # what they wait in
    waited_ns: int
    culprits: list[Party]
    waiting: list[Party]
    peer_op: str | None = None  # p2p: the call the culprit has not made (its side)


# ---- groups -----------------------------------------------------------------------------


def _better(new: Member, old: Member) -> bool:
    """Two processes claim one rank (a restarted job): the live, most recent one wins."""
    if new.view.dead != old.view.dead:
        return old.view.dead
    return new.age_ns < old.age_ns


def _add(groups: dict[tuple[str, str], Group], matching: str, key: str, size: int | None,
         m: Member) -> None:
    g = groups.get((matching, key))
    if g is None:
        g = groups[(matching, key)] = Group(matching, key, size)
    elif g.size is None:
        g.size = size
    old = g.members.get(m.rank)
    if old is None or _better(m, old):
        g.members[m.rank] = m


def build_groups(views: Iterable[RankView], age_error_ns: int | None = 0) -> list[Group]:
    """Ranks matched by communicator hash, else by torchrun job, a group needs 2 ranks;
    each group's collective numbers aligned (``age_error_ns``: the bound on comparing
    ages reported by different nodes, None when unknown)."""
    groups: dict[tuple[str, str], Group] = {}
    for v in views:
        plain: list[Collective] = []
        for c in v.collectives:
            if c.comm_hash:
                rank = c.rank if c.rank is not None else v.rank
                if rank is not None:
                    _add(groups, "communicator", c.comm_hash, c.nranks,
                         Member(v, rank, c.seq, c.op, c.age_ns, c.communicator, c.recent))
            else:
                plain.append(c)
        if v.job and v.rank is not None and v.world_size:
            key = torchrun_key(v.job, v.world_size)
            if plain:
                # Without a communicator hash, a process's collectives are numbered per
                # communicator pointer: the one it used last stands for the rank.
                c = min(plain, key=lambda x: x.age_ns)
                _add(groups, "torchrun", key, v.world_size,
                     Member(v, v.rank, c.seq, c.op, c.age_ns, c.communicator, c.recent))
            elif not v.collectives and v.last_call is not None:
                # An NCCL caller of the job with no collective yet: before collective 1.
                _add(groups, "torchrun", key, v.world_size,
                     Member(v, v.rank, 0, v.last_call.op, v.last_call.age_ns))
    out = [g for g in groups.values() if len(g.members) >= 2]
    for g in out:
        _align(g, age_error_ns)
    return out


def _align(g: Group, age_error_ns: int | None) -> None:
    """Put the members' numbers into one numbering: as counted from the communicator's
    creation (communicator matching), else aligned from their recent collectives (times
    as minus their ages); without those (an older agent) as recorded."""
    ranks = list(g.members)
    if g.matching == "communicator":
        g.alignment = align.communicator(ranks)
        return
    before = [r for r, m in g.members.items() if m.seq == 0 and not m.recent]
    calls = {r: [align.Call(x.seq, -x.age_ns, x.op, x.bytes) for x in m.recent]
             for r, m in g.members.items() if r not in before}
    if not calls or not all(calls.values()):
        g.alignment = align.as_numbered(ranks)
        return
    al = align.align(calls, lambda a, b: age_error_ns)
    g.alignment = al
    for r, m in g.members.items():
        if r in before:  # created, no collective yet: before everyone's first
            al.offsets[r] = 0
            continue
        m.seq = m.recorded + al.offsets.get(r, 0)
        m.sure = al.sure(r)


# ---- judging ----------------------------------------------------------------------------


def _party(m: Member) -> Party:
    return Party(m.view, m.rank, m.seq, m.op, m.age_ns, m.recorded)


def assess(g: Group) -> Hang | None:
    """What the group's ranks wait for right now, however short the wait; None when
    nobody waits (or when who waits for whom rests on numbers that could not be
    aligned)."""
    members = list(g.members.values())
    stuck = sorted((m for m in members if m.view.stuck), key=lambda m: m.rank)
    alive = sorted((m for m in members
                    if not m.view.dead and m.view.state not in ("stopped", "d_state")),
                   key=lambda m: m.rank)
    if stuck and alive:
        return _stuck(g, stuck, alive)
    top = g.max_seq
    low = min(m.seq for m in members)
    leaders = [m for m in members if m.seq == top and not m.view.dead]
    if low < top and leaders and top > 0:
        behind = sorted((m for m in members if m.seq == low), key=lambda m: m.rank)
        waiting = sorted((m for m in members if m.seq > low and not m.view.dead),
                         key=lambda m: m.rank)
        if not all(m.sure for m in (*behind, *waiting)):
            return None  # who is behind rests on an ambiguous alignment
        first = max(leaders, key=lambda m: m.age_ns)  # the earliest arrival at the top
        # The job is stuck at the first collective the furthest-behind ranks have not
        # entered; every rank past it waits there (ranks may have queued later ones
        # already, as asynchronous NCCL calls allow).
        return Hang("collective", g, low + 1, first.op if low + 1 == top else None,
                    first.age_ns, [_party(m) for m in behind], [_party(m) for m in waiting])
    return None


def _stuck(g: Group, stuck: list[Member], alive: list[Member]) -> Hang:
    """A stopped, D-state or dead rank holds the job: it is the culprit and every live
    rank waits, whatever their numbers (one blocked inside a collective included). When
    the aligned numbers show live ranks past the stuck ranks' last collective, they wait
    in the next one (since the first of them entered it); else after it, since the
    group's last progress."""
    low = min(m.seq for m in stuck)
    top = max(m.seq for m in alive)
    sure = all(m.sure for m in (*stuck, *alive))
    if sure and top > low:
        leaders = [m for m in alive if m.seq == top]
        first = max(leaders, key=lambda m: m.age_ns)
        return Hang("collective", g, low + 1, first.op if low + 1 == top else None,
                    first.age_ns, [_party(m) for m in stuck], [_party(m) for m in alive])
    return Hang("stalled", g, max(low, top) + 1 if sure else g.max_seq + 1, None,
                g.progress_age_ns, [_party(m) for m in stuck], [_party(m) for m in alive])


def p2p_waits(g: Group) -> list[Hang]:
    """Sends without their receive and receives without their send, per peer pair."""
    hashed = g.matching == "communicator"

    def last(m: Member, op: str, peer: int) -> PointToPoint | None:
        found = [p for p in m.view.p2p if p.op == op and p.peer == peer
                 and (p.comm_hash == g.key if hashed else not p.comm_hash)]
        return max(found, key=lambda p: p.seq, default=None)

    out: list[Hang] = []
    for a in g.members.values():
        mine = [p for p in a.view.p2p if (p.comm_hash == g.key if hashed else not p.comm_hash)]
        for peer in sorted({p.peer for p in mine}):
            b = g.members.get(peer)
            if b is None or b is a:
                continue  # the peer is not visible: nothing to compare with
            for op, other in NCCL_P2P_MATCH.items():
                own = last(a, op, peer)
                theirs = last(b, other, a.rank)
                done = theirs.seq if theirs is not None else 0
                if own is None or own.seq <= done or a.view.dead:
                    continue
                out.append(Hang(
                    "p2p", g, done + 1, op, own.age_ns,
                    [Party(b.view, b.rank, done or None, other if theirs else None,
                           theirs.age_ns if theirs else None)],
                    [Party(a.view, a.rank, own.seq, op, own.age_ns)], peer_op=other))
    return out


def died(g: Group, within_ns: int) -> Hang | None:
    """Every rank of the group is dead, not all cleanly, and the first death was at most
    ``within_ns`` ago: the rank that died first, at its last collective."""
    members = list(g.members.values())
    if not all(m.view.dead for m in members) or all(m.view.exit_code == 0 for m in members):
        return None
    known = [m for m in members if m.view.exit_code != 0 and m.view.exited_age_ns is not None]
    if not known:
        return None
    # The first to die; on a tie, one killed by a signal (no exit code), then the one behind.
    first = max(known, key=lambda m: (m.view.exited_age_ns or 0, m.view.exit_code is None,
                                      -m.seq))
    age = first.view.exited_age_ns or 0
    if age > within_ns:
        return None
    rest = sorted((m for m in members if m is not first), key=lambda m: m.rank)
    return Hang("exited", g, g.max_seq, first.op, age, [_party(first)],
                [_party(m) for m in rest])


def judge(views: Sequence[RankView], hang_after_ns: int, deaths_within_ns: int | None = None,
          age_error_ns: int | None = 0) -> tuple[list[Hang], list[Group]]:
    """Every hang that has lasted at least ``hang_after_ns``, worst first, and the groups.

    A group whose ranks are all dead (not all cleanly) is reported too when its first
    death is at most ``deaths_within_ns`` old (default: ``hang_after_ns``): a job that
    died while it was being watched, not one that died long before.
    """
    groups = build_groups(views, age_error_ns)
    within = hang_after_ns if deaths_within_ns is None else deaths_within_ns
    found: list[Hang] = []
    for g in groups:
        h = assess(g)
        pairs = [p for p in p2p_waits(g) if p.waited_ns >= hang_after_ns]
        if h is not None and h.waited_ns >= hang_after_ns:
            if not (pairs and h.kind == "stalled"):  # an unmatched pair says it better
                found.append(h)
        elif h is None and (d := died(g, within)) is not None:
            found.append(d)
        found += pairs
    order = {"collective": 0, "stalled": 1, "exited": 2, "p2p": 3}
    found.sort(key=lambda h: (order[h.kind], -h.waited_ns))
    return found, groups


def waits(views: Sequence[RankView]) -> list[tuple[Group, int]]:
    """Per group, how long its ranks have been waiting (0 when nobody waits): what the
    agent's gauge shows for the ranks of its own node."""
    out = []
    for g in build_groups(views):
        h = assess(g)
        longest = h.waited_ns if h is not None else 0
        for p in p2p_waits(g):
            longest = max(longest, p.waited_ns)
        out.append((g, longest))
    return out
