"""A node's ``GET /api/v1/ranks`` answer, checked before a hang is judged, and the top
chain of a culprit's ``GET /api/v1/chains`` answer.

Untrusted like every answer: each rank is rebuilt from checked values into the
analyzer's :class:`~fleetd.analyze.distributed.hangs.RankView` (types, ranges, states and ops from
the documented sets, strings printable and cut, lists capped); one bad value rejects
the node's answer (:class:`~fleetd.wire.failure.BadReply`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

from fleetd.analyze.distributed.hangs import (
    STATES,
    Collective,
    LastCall,
    PointToPoint,
    RankView,
    Recent,
)
from fleetd.store.catalog import NCCL_P2P
from fleetd.wire.failure import BadReply
from fleetd.wire.limits import INT64_MAX
from fleetd.wire.values import need_dict, need_int, need_list, need_text, printable, shown

MAX_RANKS = 4096  # per node
MAX_COMMS = 256  # communicators per rank
MAX_P2P = 4096  # send/receive entries per rank
MAX_RECENT = 256  # recent collectives per communicator of a rank
MAX_TEXT = 256  # a job id, a process name
MAX_NAME = 64  # an op, a communicator pointer or hash, a wait channel
INT32 = 2**31
SEVERITIES = ("HIGH", "MEDIUM", "LOW")


# ---- checking one node's answer -----------------------------------------------------------


def check_ranks_reply(node: str, reply: Mapping[str, Any]) -> list[RankView]:
    """The node's ranks, rebuilt from checked values; raises :class:`BadReply`."""
    ranks = need_list(reply.get("ranks"), "ranks", MAX_RANKS)
    out = [_rank(node, r, f"ranks[{i}]") for i, r in enumerate(ranks)]
    if len({v.pid for v in out}) != len(out):
        raise BadReply("ranks: a pid is listed twice")
    return out


def _rank(node: str, r: Any, where: str) -> RankView:
    d = need_dict(r, where)
    state = d.get("state")
    if state not in STATES:
        raise BadReply(f"{where}.state: expected one of {', '.join(STATES)}, got {shown(state)}")
    last = d.get("last_call")
    colls = need_list(d.get("collectives", []), f"{where}.collectives", MAX_COMMS)
    p2p = need_list(d.get("p2p", []), f"{where}.p2p", MAX_P2P)
    return RankView(
        node=node, pid=need_int(d.get("pid"), f"{where}.pid", 1, INT32 - 1),
        comm=_opt_text(d.get("comm"), f"{where}.comm", MAX_TEXT),
        rank=_opt_int(d.get("rank"), f"{where}.rank", 0, INT32 - 1),
        world_size=_opt_int(d.get("world_size"), f"{where}.world_size", 1, INT32 - 1),
        job=_opt_text(d.get("job"), f"{where}.job", MAX_TEXT),
        state=str(state), wchan=_opt_text(d.get("wchan"), f"{where}.wchan", MAX_NAME),
        exit_code=_opt_int(d.get("exit_code"), f"{where}.exit_code", -INT32, INT32 - 1),
        exited_age_ns=_opt_int(d.get("exited_age_ns"), f"{where}.exited_age_ns", 0),
        collectives=[_coll(c, f"{where}.collectives[{i}]") for i, c in enumerate(colls)],
        last_call=None if last is None else _last(last, f"{where}.last_call"),
        p2p=[_p2p(p, f"{where}.p2p[{i}]") for i, p in enumerate(p2p)])


def _coll(c: Any, where: str) -> Collective:
    d = need_dict(c, where)
    recent = need_list(d.get("recent", []), f"{where}.recent", MAX_RECENT)
    return Collective(
        communicator=need_text(d.get("communicator"), f"{where}.communicator", MAX_NAME),
        comm_hash=_opt_text(d.get("comm_hash"), f"{where}.comm_hash", MAX_NAME),
        rank=_opt_int(d.get("rank"), f"{where}.rank", 0, INT32 - 1),
        nranks=_opt_int(d.get("nranks"), f"{where}.nranks", 1, INT32 - 1),
        op=need_text(d.get("op"), f"{where}.op", MAX_NAME),
        seq=need_int(d.get("seq"), f"{where}.seq", 0),
        age_ns=need_int(d.get("age_ns"), f"{where}.age_ns", 0),
        ret=need_int(d.get("ret", 0), f"{where}.ret", -INT32, 2 * INT32 - 1),
        recent=tuple(_recent(x, f"{where}.recent[{i}]") for i, x in enumerate(recent)))


def _recent(v: Any, where: str) -> Recent:
    if not isinstance(v, list) or len(v) != 4:
        raise BadReply(f"{where}: expected [seq, age_ns, op, bytes]")
    seq, age, op, nbytes = v
    return Recent(need_int(seq, f"{where}.seq", 1), need_int(age, f"{where}.age_ns", 0),
                  need_text(op, f"{where}.op", MAX_NAME), need_int(nbytes, f"{where}.bytes", 0))


def _p2p(p: Any, where: str) -> PointToPoint:
    d = need_dict(p, where)
    op = d.get("op")
    if op not in NCCL_P2P.name_set:
        raise BadReply(f"{where}.op: expected one of {', '.join(NCCL_P2P.names)}, got "
                       f"{shown(op)}")
    return PointToPoint(
        communicator=need_text(d.get("communicator"), f"{where}.communicator", MAX_NAME),
        comm_hash=_opt_text(d.get("comm_hash"), f"{where}.comm_hash", MAX_NAME),
        op=str(op), peer=need_int(d.get("peer"), f"{where}.peer", -1, INT32 - 1),
        seq=need_int(d.get("seq"), f"{where}.seq", 1),
        age_ns=need_int(d.get("age_ns"), f"{where}.age_ns", 0),
        ret=need_int(d.get("ret", 0), f"{where}.ret", -INT32, 2 * INT32 - 1))


def _last(v: Any, where: str) -> LastCall:
    d = need_dict(v, where)
    return LastCall(op=need_text(d.get("op"), f"{where}.op", MAX_NAME),
                    age_ns=need_int(d.get("age_ns"), f"{where}.age_ns", 0),
                    ret=need_int(d.get("ret", 0), f"{where}.ret", -INT32, 2 * INT32 - 1))


def _opt_int(v: Any, where: str, lo: int, hi: int = INT64_MAX) -> int | None:
    return None if v is None else need_int(v, where, lo, hi)


def _opt_text(v: Any, where: str, limit: int) -> str | None:
    return None if v is None else need_text(v, where, limit)


class TopCulprit(TypedDict):
    pid: int | None
    comm: str | None


class TopChain(TypedDict):
    """A node's first chain for a process, as ``watch`` shows it beside a culprit: its
    checked fields only (each None when the node's was not valid)."""

    severity: str | None
    root_cause: str | None
    summary: str | None
    culprit: NotRequired[TopCulprit]


def top_chain(reply: Mapping[str, Any]) -> TopChain | None:
    """The first chain of a node's ``/api/v1/chains`` answer, reduced to checked fields."""
    chains = reply.get("chains")
    if not isinstance(chains, list) or not chains or not isinstance(chains[0], dict):
        return None
    c = chains[0]
    severity = c.get("severity")
    out: TopChain = {
        "severity": severity if severity in SEVERITIES else None,
        "root_cause": printable(c["root_cause"], MAX_NAME)
        if isinstance(c.get("root_cause"), str) else None,
        "summary": printable(c["summary"], 1000) if isinstance(c.get("summary"), str)
        else None,
    }
    culprit = c.get("culprit")
    if isinstance(culprit, dict):
        pid = culprit.get("pid")
        comm = culprit.get("comm")
        out["culprit"] = {
            "pid": pid if isinstance(pid, int) and not isinstance(pid, bool)
            and 0 < pid < INT32 else None,
            "comm": printable(comm, MAX_TEXT) if isinstance(comm, str) else None}
    return out
