"""A node's ``GET /api/v1/chains`` and ``GET /api/v1/profile`` answers (what ``explain
--nodes`` compares), checked before its chains and features join the fleet's.

The answer is untrusted (see :mod:`fleetd.wire.gpu`). The fleet client sorts the chains,
ranks the nodes by them, names a straggler's top chain and renders every field, so each
chain is held to :class:`~fleetd.analyze.reading.answers.ChainJson` here: every key a
chain always has, each of its type, the victim and culprits with theirs, lists capped.
The values are kept as the node sent them (names are made printable where they are
shown, as a local report's are), so a fleet report reads as each node's own; one bad
value rejects the node's whole answer (:class:`~fleetd.wire.failure.BadReply`). A
profile's features are numbers, names or null (the straggler ranking scores the numbers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from fleetd.analyze.reading.answers import ChainJson, NodeProfile, NoProfile
from fleetd.wire.failure import BadReply
from fleetd.wire.shapes import ChainsReply
from fleetd.wire.values import need_bool, need_choice, need_dict, need_int, need_list, need_number

MAX_FEATURES = 256  # straggler features per profile
MAX_CHAINS = 10_000  # per node answer
MAX_ITEMS = 10_000  # culprits, evidence items, fixes per chain; processes per answer
SEVERITIES = ("HIGH", "MEDIUM", "LOW")
_TEXTS = ("id", "key", "node", "root_cause", "summary")
_NUMBERS = ("explained", "impact")
_PLACEMENT = ("pod", "namespace", "pod_uid", "container")


def check_chains_reply(reply: Mapping[str, Any]) -> ChainsReply:
    """The node's answer, every chain checked; raises :class:`BadReply`."""
    need_dict(reply.get("window"), "window")
    _text(reply.get("verdict"), "verdict")
    chains = need_list(reply.get("chains"), "chains", MAX_CHAINS)
    for i, c in enumerate(chains):
        read_chain(c, f"chains[{i}]")
    for i, p in enumerate(need_list(reply.get("processes"), "processes", MAX_ITEMS)):
        need_dict(p, f"processes[{i}]")
    for i, w in enumerate(need_list(reply.get("warnings"), "warnings", MAX_ITEMS)):
        _text(w, f"warnings[{i}]")
    # Checked key by key above; the node's own key order and extra keys are kept.
    return cast(ChainsReply, reply)


def read_chain(value: Any, where: str) -> ChainJson:
    """``value`` as a chain, once every key it must have holds its type."""
    c = need_dict(value, where)
    for k in _TEXTS:
        _text(c.get(k), f"{where}.{k}")
    need_choice(c.get("severity"), SEVERITIES, f"{where}.severity")
    _maybe_text(c.get("op"), f"{where}.op")
    _maybe_text(c.get("time"), f"{where}.time")
    for k in _NUMBERS:
        need_number(c.get(k), f"{where}.{k}")
    for k in ("ts_ns", "dur_ns"):
        need_int(c.get(k), f"{where}.{k}")
    _party(c.get("victim"), f"{where}.victim", ("tid",))
    if c.get("culprit") is not None:
        _party(c["culprit"], f"{where}.culprit", ())
        culprit = need_dict(c["culprit"], f"{where}.culprit")
        need_bool(culprit.get("self"), f"{where}.culprit.self")
    for i, x in enumerate(need_list(c.get("culprits"), f"{where}.culprits", MAX_ITEMS)):
        _party(x, f"{where}.culprits[{i}]", ("ns",))
        need_number(x.get("share"), f"{where}.culprits[{i}].share")
    need_dict(c.get("detail"), f"{where}.detail")
    for i, e in enumerate(need_list(c.get("evidence"), f"{where}.evidence", MAX_ITEMS)):
        _text(need_dict(e, f"{where}.evidence[{i}]").get("kind"), f"{where}.evidence[{i}].kind")
    for i, f in enumerate(need_list(c.get("fixes"), f"{where}.fixes", MAX_ITEMS)):
        _text(f, f"{where}.fixes[{i}]")
    return cast(ChainJson, c)


def check_profile_reply(reply: Mapping[str, Any]) -> NodeProfile | NoProfile:
    """The node's straggler features, each checked; raises :class:`BadReply`."""
    _text(reply.get("node"), "node")
    if "error" in reply:  # a node whose database holds nothing of it yet
        _text(reply["error"], "error")
        return cast(NoProfile, reply)
    need_dict(reply.get("window"), "window")
    if reply.get("main_pid") is not None:
        need_int(reply["main_pid"], "main_pid")
    features = need_dict(reply.get("features"), "features")
    if len(features) > MAX_FEATURES:
        raise BadReply(f"features: {len(features)} entries, above the limit of {MAX_FEATURES}")
    for k, v in features.items():
        if v is not None and not isinstance(v, str):
            need_number(v, f"features.{k}")
    return cast(NodeProfile, reply)


def _party(value: Any, where: str, ints: tuple[str, ...]) -> None:
    """A victim or culprit: its pid (and ``ints``), its name, where it runs."""
    d = need_dict(value, where)
    for k in ("pid", *ints):
        need_int(d.get(k), f"{where}.{k}")
    _maybe_text(d.get("comm"), f"{where}.comm")
    for k in _PLACEMENT:
        if k in d:
            _text(d[k], f"{where}.{k}")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadReply(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _maybe_text(value: Any, where: str) -> None:
    if value is not None:
        _text(value, where)
