"""Hang verdicts over the fleet: every node's NCCL ranks (``GET /api/v1/ranks``), checked,
matched across nodes, their collective numbers aligned, and judged by
:mod:`fleetd.analyze.distributed.hangs`.

:func:`verdict` is pure: the per-node answers in, the verdict object out (the JSON of
``fleetd watch --format json`` and of the MCP tool ``check_hang``; docs/json.md). It
trusts nothing in an answer: every rank is rebuilt from checked values by the wire's
reader (:mod:`fleetd.wire.ranks`), and a node whose answer breaks the shape is left
out with a warning, never half-used. Only ages enter the judgement (each measured by
the node's own clock), so clock skew between nodes cannot fake or hide a hang; ages of
different nodes are compared (to align the ranks' numbers) within the time one poll
took, the most their "now"s can differ.

:func:`poll` asks the fleet once over an open client (``fleetd watch`` keeps one for all
its polls) and, when there is a hang, adds the top causal chain of each culprit from its
node (``GET /api/v1/chains``), best effort.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict

from fleetd.analyze.distributed.hangs import (
    Group,
    Hang,
    Party,
    RankView,
    judge,
)
from fleetd.fleet.chains import CHAIN_TIMEOUT_S, chains_of
from fleetd.fleet.client import FleetClient
from fleetd.fleet.dispatch import fan_out
from fleetd.fleet.fanout import FleetAnswer, FleetOptions, Request
from fleetd.fleet.straggle import StragglerJson, StraggleWatch
from fleetd.wire import paths
from fleetd.wire.failure import BadReply, NodeFailed
from fleetd.wire.ranks import TopChain, check_ranks_reply

log = logging.getLogger("fleetd.fleet.hang")

CHAIN_CULPRITS = 4  # culprits whose top chain is fetched
# fleetd watch asks the nodes of the ranks a group waits for, once it has waited this
# long (or half the hang threshold, if shorter), to trace launches whole for DETAIL_S
# (POST /api/v1/detail: agents in --mode always-on trace them 1 s in 10 otherwise).
# Those ranks are not waiting themselves, so their own agent's wait rule does not fire.
DETAIL_AFTER_S = 1.0
DETAIL_S = 30


# ---- the verdict's shape (docs/json.md, fleetd watch) -------------------------------------


class LastCallJson(TypedDict):
    op: str
    age_s: float | None
    ret: int


class PartyJson(TypedDict):
    """A rank in a hang: one the others wait for (a culprit) or one waiting; ``top_chain``
    (culprits, when asked) its node's top chain for the process."""

    node: str
    pid: int
    comm: str | None
    rank: int
    job: str | None
    state: str
    wchan: str | None
    seq: int | None
    recorded_seq: int | None
    op: str | None
    age_s: float | None
    last_call: LastCallJson | None
    exit_code: NotRequired[int | None]
    exited_s_ago: NotRequired[float | None]
    top_chain: NotRequired[TopChain | None]


class AlignmentJson(TypedDict):
    """How a group's collective numbers were matched."""

    method: str
    confidence: str
    by: str
    text: str
    offsets: dict[str, int]  # rank -> offset added to its numbers
    ambiguous_ranks: list[int]


class GroupJson(TypedDict):
    group: str
    matching: str  # communicator | torchrun
    key: str
    size: int | None
    ranks: list[int]
    seq: int
    progress_s: float | None
    missing_ranks: list[int]
    alignment: AlignmentJson | None


class HangJson(TypedDict):
    kind: str  # collective | stalled | exited | p2p
    matching: str
    group: str
    key: str
    seq: int
    op: str | None
    waited_s: float
    summary: str
    culprits: list[PartyJson]
    waiting: list[PartyJson]
    alignment: AlignmentJson | None
    peer_op: NotRequired[str | None]
    missing_ranks: NotRequired[list[int]]


class HangVerdict(TypedDict):
    """One poll's verdict (``fleetd watch --format json``); ``stragglers``: the late ranks
    ``fleetd watch`` flags (with a :class:`~fleetd.fleet.straggle.StraggleWatch`)."""

    status: str  # hang | ok
    hang_after_s: float
    verdict: str
    hangs: list[HangJson]
    groups: list[GroupJson]
    ranks: int
    nodes: list[str]
    warnings: list[str]
    stragglers: NotRequired[list[StragglerJson]]


# ---- the verdict --------------------------------------------------------------------------


def verdict(replies: Sequence[tuple[str, Mapping[str, Any]]], hang_after_s: float, *,
            deaths_within_s: float | None = None, age_error_s: float | None = 0.0
            ) -> HangVerdict:
    """The verdict over the nodes' ``GET /api/v1/ranks`` answers, as (node, answer).

    ``status`` is ``hang`` when some group of ranks has waited ``hang_after_s`` or longer
    (or died while watched: ``deaths_within_s``, default ``hang_after_s``), else ``ok``.
    ``age_error_s``: how far apart the nodes' "now"s may be (the poll's duration; None
    when unknown), the error of comparing their ages when ranks are aligned.
    """
    return judged(checked(replies), hang_after_s, deaths_within_s=deaths_within_s,
                  age_error_s=age_error_s)


@dataclasses.dataclass(frozen=True, slots=True)
class Checked:
    """The nodes' ranks answers read once: every rank rebuilt from checked values, the
    nodes whose answers held, and a warning for each that did not."""

    views: list[RankView]
    nodes: list[str]
    warnings: list[str]


def checked(replies: Sequence[tuple[str, Mapping[str, Any]]]) -> Checked:
    out = Checked([], [], [])
    for node, reply in replies:
        try:
            out.views.extend(check_ranks_reply(node, reply))
            out.nodes.append(node)
        except BadReply as exc:
            out.warnings.append(f"node {node}: malformed ranks answer, left out ({exc})")
    return out


def judged(ranks: Checked, hang_after_s: float, *, deaths_within_s: float | None = None,
           age_error_s: float | None = 0.0) -> HangVerdict:
    """:func:`verdict` over answers already read (:func:`checked`)."""
    if not (math.isfinite(hang_after_s) and hang_after_s > 0):
        raise ValueError(f"hang_after_s must be a positive number, not {hang_after_s!r}")
    views, nodes, warnings = ranks.views, ranks.nodes, list(ranks.warnings)
    within = None if deaths_within_s is None else int(deaths_within_s * 1e9)
    err = None if age_error_s is None else int(age_error_s * 1e9)
    hangs, groups = judge(views, int(hang_after_s * 1e9), within, err)
    found = [_hang_json(h) for h in hangs]
    for g in groups:
        if g.missing() and len(g.missing()) <= 64:
            warnings.append(f"{g.label}: rank(s) {_ranks(g.missing())} of {g.size} not seen "
                            "(their node did not answer, or they are not traced)")
        if g.unsure():
            warnings.append(f"{g.label}: the collective numbers of rank(s) "
                            f"{_ranks(g.unsure()[:64])} could not be aligned with the others' "
                            f"({_why_unsure(g)}): no rank is named from its number (a "
                            "stopped, D-state or dead rank still is)")
    return {
        "status": "hang" if found else "ok",
        "hang_after_s": hang_after_s,
        "verdict": found[0]["summary"] if found else _quiet(views, groups),
        "hangs": found,
        "groups": [_group_json(g) for g in groups],
        "ranks": len(views),
        "nodes": nodes,
        "warnings": warnings,
    }


def _why_unsure(g: Group) -> str:
    al = g.alignment
    if al is None:
        return "ambiguous"
    why = sorted({p.reason for r, p in al.pairs.items() if r in g.unsure() and p.reason})
    return "; ".join(why) or "ambiguous"


def alignment_json(g: Group) -> AlignmentJson | None:
    """How the group's collective numbers were matched (docs/json.md, ``watch``)."""
    al = g.alignment
    if al is None:
        return None
    return {"method": al.method, "confidence": al.confidence, "by": al.by(),
            "text": al.describe(),
            "offsets": {str(r): al.offsets.get(r, 0) for r in sorted(g.members)},
            "ambiguous_ranks": g.unsure()}


def _quiet(views: Sequence[RankView], groups: Sequence[Group]) -> str:
    if not views:
        return "no hang: no traced process has made NCCL calls"
    if not groups:
        return (f"no hang: {len(views)} NCCL rank(s), none matched with another "
                "(no shared communicator or torchrun job)")
    parts = [f"{g.label} at collective {g.max_seq}" for g in groups[:3]]
    more = f" and {len(groups) - 3} more" if len(groups) > 3 else ""
    return f"no hang: {'; '.join(parts)}{more}"


def _s(ns: int | None) -> float | None:
    return None if ns is None else round(ns / 1e9, 3)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _group_json(g: Group) -> GroupJson:
    return {"group": g.label, "matching": g.matching, "key": g.key, "size": g.size,
            "ranks": sorted(g.members), "seq": g.max_seq,
            "progress_s": _s(g.progress_age_ns), "missing_ranks": g.missing()[:64],
            "alignment": alignment_json(g)}


def _party_json(p: Party) -> PartyJson:
    v = p.view
    lc = v.last_call
    out: PartyJson = {
        "node": v.node, "pid": v.pid, "comm": v.comm, "rank": p.rank, "job": v.job,
        "state": v.state, "wchan": v.wchan, "seq": p.seq, "recorded_seq": p.recorded,
        "op": p.op, "age_s": _s(p.age_ns),
        "last_call": None if lc is None else {"op": lc.op, "age_s": _s(lc.age_ns),
                                              "ret": lc.ret},
    }
    if v.state == "exited":
        out["exit_code"] = v.exit_code
        out["exited_s_ago"] = _s(v.exited_age_ns)
    return out


def _who(p: Party) -> str:
    v = p.view
    state = v.state
    if v.wchan and v.state in ("sleeping", "d_state", "stopped"):
        state += f" in {v.wchan}"
    if v.state == "exited":
        state = ("exited, killed by a signal" if v.exit_code is None
                 else f"exited with status {v.exit_code}")
    return f"rank {p.rank} ({v.node} pid {v.pid}, {state})"


def _where(p: Party) -> str:
    lc = p.view.last_call
    at = f"its last collective is {p.seq}" if p.seq else "it has entered no collective"
    if lc is not None:
        at += f", its last call {lc.op} {lc.age_ns / 1e9:.1f} s ago"
    return at


def _hang_json(h: Hang) -> HangJson:
    g = h.group
    waited = h.waited_ns / 1e9
    culprits, waiting = h.culprits, h.waiting
    n = len(waiting)
    if h.kind == "collective":
        who = "; ".join(_who(c) for c in culprits)
        what = f" ({h.op})" if h.op else ""
        ahead = max((w.seq or 0) for w in waiting)
        beyond = f", the furthest at collective {ahead}" if ahead != h.seq else ""
        summary = (f"{who} never arrived at collective {h.seq}{what} of {g.label}: "
                   f"{n} rank(s) have waited {waited:.1f} s{beyond}; "
                   + "; ".join(_where(c) for c in culprits))
    elif h.kind == "stalled":
        who = "; ".join(_who(c) for c in culprits)
        summary = (f"{who}: no rank of {g.label} has entered a collective for "
                   f"{waited:.1f} s; {n} rank(s) wait after collective {h.seq - 1}; "
                   + "; ".join(_where(c) for c in culprits))
    elif h.kind == "exited":
        c = culprits[0]
        summary = (f"{_who(c)} died {waited:.1f} s ago at collective {c.seq} of {g.label}, "
                   f"and the other {n} rank(s) exited after it")
    else:
        c, w = culprits[0], waiting[0]
        way = "to" if h.op == "ncclSend" else "from"
        summary = (f"{_who(c)} has not made {h.peer_op} #{h.seq} matching rank {w.rank}'s: "
                   f"rank {w.rank} ({w.view.node} pid {w.view.pid}) has waited {waited:.1f} s "
                   f"since its {h.op} #{w.seq} {way} rank {c.rank} of {g.label}")
    if h.kind != "p2p" and g.alignment is not None:
        summary += f" ({g.alignment.describe()})"
    out: HangJson = {
        "kind": h.kind, "matching": g.matching, "group": g.label, "key": g.key,
        "seq": h.seq, "op": h.op, "waited_s": round(waited, 3), "summary": summary,
        "culprits": [_party_json(c) for c in culprits],
        "waiting": [_party_json(w) for w in waiting],
        "alignment": alignment_json(g),
    }
    if h.kind == "p2p":
        out["peer_op"] = h.peer_op
    if g.missing():
        out["missing_ranks"] = g.missing()[:64]
    return out


# ---- asking the fleet ---------------------------------------------------------------------


READ_AT = "_read_at_s"  # not the node's: when the watch read its answer (monotonic s)


def _check(reply: dict[str, object]) -> dict[str, object]:
    """The ranks answer as it came, once every rank in it reads (:func:`checked` reads
    it again into RankViews with the node's name), with the time it was read: a node
    counts its ranks' ages from its own "now", somewhere in the poll, and the straggler
    rule compares them across nodes (:meth:`StraggleWatch.update`)."""
    check_ranks_reply("?", reply)
    return {**reply, READ_AT: time.monotonic()}


async def poll(opts: FleetOptions, client: FleetClient, hang_after_s: float, *,
               deaths_within_s: float | None = None, chains: bool = True,
               detail: DetailAsks | None = None, straggle: StraggleWatch | None = None
               ) -> tuple[FleetAnswer, HangVerdict]:
    """Ask every node once for its ranks and judge them; with a hang, fetch the top chain
    of each culprit's process from its node (``chains``); with ``detail`` (fleetd watch),
    ask the nodes of the ranks that others wait for to trace launches whole; with
    ``straggle`` (fleetd watch), judge the late ranks too (its ``changes`` say what turned,
    the result's ``stragglers`` lists those flagged). Clock offsets are not sampled: the
    verdict uses ages only."""
    quick = dataclasses.replace(opts, skew_samples=0)
    request = Request("GET", paths.RANKS, expect=("ranks",), check=_check)
    started = time.monotonic()
    answer = await fan_out(quick, lambda _off: [request], client=client)
    # Every node's "now" falls inside the poll: their ages compare within its length.
    spread = time.monotonic() - started
    # No offsets are sampled, so "clock offset unknown" says nothing here.
    answer.warnings = [w for w in answer.warnings if w.kind != "skew"]
    ranks = checked([(o.name, o.replies[0]) for o in answer.answered if o.replies])
    result = judged(ranks, hang_after_s, deaths_within_s=deaths_within_s, age_error_s=spread)
    if detail is not None:
        await detail.ask(answer, client, laggard_nodes(ranks.views, hang_after_s))
    if chains and result["hangs"]:
        await add_chains(answer, client, result, hang_after_s)
    if straggle is not None:
        read_at = {o.name: o.replies[0].get(READ_AT) for o in answer.answered if o.replies}
        await straggle.poll(answer, client, ranks.views, spread,
                            {n: t for n, t in read_at.items() if isinstance(t, float)})
        result["stragglers"] = straggle.current()
    result["warnings"] = [f"node {w.node}: {w.error}" for w in answer.warnings] + \
        result["warnings"]
    return answer, result


def laggard_nodes(views: Sequence[RankView], hang_after_s: float) -> set[str]:
    """The nodes of the ranks a group has waited for at least DETAIL_AFTER_S (or half
    the hang threshold): a hang or a straggler in the making."""
    early = min(DETAIL_AFTER_S, hang_after_s / 2)
    hangs, _ = judge(views, int(early * 1e9))
    return {c.view.node for h in hangs for c in h.culprits}


@dataclasses.dataclass
class DetailAsks:
    """Which nodes were asked for launch detail, and until when (monotonic s): a node
    is asked again only when its window is about to close."""

    until: dict[str, float] = dataclasses.field(default_factory=dict)
    refused: set[str] = dataclasses.field(default_factory=set)  # warned of once each

    async def ask(self, answer: FleetAnswer, client: FleetClient, nodes: set[str]) -> None:
        now = time.monotonic()
        targets = {o.name: o.target for o in answer.answered}
        due = [n for n in sorted(nodes) if n in targets and self.until.get(n, 0.0) < now + 2]
        if due:
            client.restart_deadline()
            await asyncio.gather(*(self._one(client, targets[n], n) for n in due))

    async def _one(self, client: FleetClient, target: Any, node: str) -> None:
        self.until[node] = time.monotonic() + DETAIL_S  # asked, answered or not
        try:
            async with asyncio.timeout(CHAIN_TIMEOUT_S):
                reply = await client.post(target, f"{paths.DETAIL}?seconds={DETAIL_S}", {})
        except NodeFailed as exc:
            if exc.failure.status != 403:
                log.info("node %s: launch detail not asked (%s)", node, exc)
            elif node not in self.refused:  # not permitted, or its hourly budget spent
                self.refused.add(node)
                log.warning("node %s refused launch detail (watching on without it): %s",
                            node, exc.failure.text())
            return
        except TimeoutError as exc:
            log.info("node %s: launch detail not asked (%s)", node, exc)
            return
        if reply.get("opened") is True:
            log.info("node %s: launch detail on for %d s (a group waits for its ranks)",
                     node, DETAIL_S)
        else:
            log.debug("node %s: no launch detail window: %s", node, reply.get("why"))


async def add_chains(answer: FleetAnswer, client: FleetClient, result: HangVerdict,
                     hang_after_s: float) -> None:
    """Each culprit's top causal chain over the last minutes, from its node (best effort:
    a node that cannot say in time leaves ``top_chain`` null)."""
    culprits = [c for h in result["hangs"] for c in h["culprits"]]
    wanted = list(dict.fromkeys((c["node"], c["pid"]) for c in culprits))[:CHAIN_CULPRITS]
    found = await chains_of(answer, client, wanted, f"{max(60, int(hang_after_s * 3))}s")
    for c in culprits:
        c["top_chain"] = found.get((c["node"], c["pid"]))
