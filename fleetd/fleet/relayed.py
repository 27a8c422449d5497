"""Fan-out through peer relays: the client asks a few agents inside the cluster, each of
which asks its share of the nodes and answers with one merged, per-node-tagged document.

Routes. ``--relay-via A,B`` splits the other targets into as many contiguous, even
shares as there are relays; ``--fanout-degree K`` cuts the target list into groups of K
whose first node relays for the other K-1 (a two-level tree: a relayed request is never
relayed again, so there is no deeper one). A relay that is itself a target answers for
itself directly, on the same connection as its relay request.

Trust. A relay's answer is untrusted like any node's, and more so: it speaks for nodes
we never reached. Only the nodes we sent it are taken from it (others are ignored, a
missing one is a failure named for that node), every node's replies pass the same
checks as a direct answer, failures and names are made printable, clock figures are
bounded integers.

A relay that fails (refused, down, timed out) fails every node of its share, each named
with the relay's reason. We do not fall back to asking those nodes directly: relays are
for clients that cannot reach the nodes (a laptop on a VPN) or should not open a
thousand connections, and a fallback would spend a second timeout to learn the same.

Clocks. The relay measures each peer's offset against its own clock (peer minus relay,
error e_p); we measure the relay's (relay minus us, error e_r). The peer's offset against
us is their sum, and its error bound is e_p + e_r: each bound holds whatever the path's
asymmetry, so the sum bounds the composed error (docs/fleet.md "Relays").
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from fleetd.errors import UsageError
from fleetd.fleet.client import FleetClient
from fleetd.fleet.fanout import (
    FleetAnswer,
    FleetOptions,
    NodeOutcome,
    Plan,
    Request,
    bad_value,
    checked,
    fan_out_work,
    send_all,
    session,
    settle,
)
from fleetd.fleet.skew import Skew
from fleetd.fleet.targets import RelayRoute, Target, parse_nodes
from fleetd.wire import paths
from fleetd.wire.failure import FAILURE_KINDS, Failure, NodeFailed
from fleetd.wire.limits import INT64_MAX, INT64_MIN
from fleetd.wire.shapes import RelayBody, RelayedRequest, SkewJson
from fleetd.wire.values import printable, valid_int

MAX_SHIFTS = 16  # time fields the relay moves into each peer's clock
SHIFT_PROBE = 1_000_003  # ns: plan(o + PROBE) - plan(o) finds the fields that are times
# The relay gets this share of the time we have left, so that it answers (with its slow
# peers named) before our own deadline ends the whole share.
RELAY_TIME_SHARE = 0.85


def plan_routes(targets: Sequence[Target], via: str | None, degree: int | None
                ) -> tuple[RelayRoute, ...]:
    """The routes for ``--relay-via`` or ``--fanout-degree`` (none when neither is given)."""
    if via and degree:
        raise UsageError("--relay-via and --fanout-degree choose relays in two ways",
                         "pass one: named relays, or groups of K nodes with one relay each")
    if degree is not None and not via:
        if degree < 2:
            raise UsageError(f"--fanout-degree {degree} must be at least 2",
                             "each relay asks K-1 nodes beside itself, e.g. 32")
        groups = [tuple(targets[i:i + degree]) for i in range(0, len(targets), degree)]
        return tuple(RelayRoute(g[0], g[1:]) for g in groups if len(g) > 1)
    if not via:
        return ()
    relays = [_relay_target(targets, item) for item in via.split(",") if item.strip()]
    if not relays:
        raise UsageError(f"--relay-via {via!r} names no relay",
                         "name nodes of --nodes (NAME or HOST:PORT), e.g. --relay-via gpu-01")
    if len({r.address for r in relays}) != len(relays):
        raise UsageError(f"--relay-via {via!r} names a relay twice", "name each relay once")
    chosen = {r.address for r in relays}
    rest = [t for t in targets if t.address not in chosen]
    share, extra = divmod(len(rest), len(relays))
    routes, start = [], 0
    for i, relay in enumerate(relays):
        end = start + share + (1 if i < extra else 0)
        routes.append(RelayRoute(relay, tuple(rest[start:end])))
        start = end
    return tuple(r for r in routes if r.members)


def _relay_target(targets: Sequence[Target], item: str) -> Target:
    """A target by name or address, else a relay outside the list (HOST:PORT)."""
    item = item.strip()
    for t in targets:
        if item in (t.name, t.address):
            return t
    if ":" not in item:
        raise UsageError(f"--relay-via names {item!r}, which is not a node of --nodes",
                         "name a listed node (NAME or HOST:PORT), or give HOST:PORT")
    return parse_nodes(item)[0]


# ---- the client's side of a relayed fan-out -----------------------------------------


async def fan_out_relayed(opts: FleetOptions, plan: Plan, *, needs_offset: bool = False,
                          client: FleetClient | None = None) -> FleetAnswer:
    """:func:`fleetd.fleet.dispatch.fan_out` through ``opts.relays``; same answer shape."""
    if client is None:
        async with session(opts.client, warm=opts.keep_warm) as own:
            return await fan_out_relayed(opts, plan, needs_offset=needs_offset, client=own)
    routes: tuple[RelayRoute, ...] = opts.relays
    relayed = {m.address for r in routes for m in r.members}
    listed = {t.address for t in opts.targets}
    # Asked directly: the unrelayed targets (relays among them) and the relays outside
    # the list, for their clocks only.
    direct = [t for t in opts.targets if t.address not in relayed]
    direct += [r.relay for r in routes if r.relay.address not in listed
               and r.relay.address not in {t.address for t in direct}]
    probe = Request("GET", paths.HEALTH, expect=("node",))

    async def work(c: FleetClient, t: Target, offset: int) -> list[dict[str, object]]:
        return await send_all(c, t, plan(offset) if t.address in listed else [probe])

    direct_opts = dataclasses.replace(opts, targets=tuple(direct), relays=())
    started = time.perf_counter()
    client.restart_deadline()
    if needs_offset:
        # Times in the request must be in the relay's clock: learn it first.
        first = await fan_out_work(direct_opts, work, needs_offset=True, client=client)
        by_relay = await asyncio.gather(*(_ask(client, opts, r, plan, _skew_of(first, r),
                                                True) for r in routes))
    else:
        first, by_relay = await asyncio.gather(
            fan_out_work(direct_opts, work, client=client),
            asyncio.gather(*(_ask(client, opts, r, plan, None, False) for r in routes)))
    outcomes = {o.target.address: o for o in first.outcomes}
    for route, got in zip(routes, by_relay, strict=True):
        relay_skew = _skew_of(first, route)
        for o in got:
            o.skew = _compose(o.skew, relay_skew) if o.skew is not None else None
            if o.skew is None and o.skew_failure is None and relay_skew is None:
                o.skew_failure = Failure("skew", f"clock offset of relay {route.relay.name} "
                                         "unknown")
            outcomes[o.target.address] = o
    answer = FleetAnswer([outcomes[t.address] for t in opts.targets], correct=opts.correct,
                         elapsed_s=time.perf_counter() - started)
    settle(answer, opts)
    return answer


def _skew_of(answer: FleetAnswer, route: RelayRoute) -> Skew | None:
    for o in answer.outcomes:
        if o.target.address == route.relay.address:
            return o.skew
    return None


def _compose(peer: Skew, relay: Skew | None) -> Skew | None:
    """Peer minus us = (peer minus relay) + (relay minus us); the error bounds add."""
    if relay is None:
        return None
    return Skew(offset_ns=peer.offset_ns + relay.offset_ns,
                error_ns=peer.error_ns + relay.error_ns, samples=peer.samples, used=peer.used)


async def _ask(client: FleetClient, opts: FleetOptions, route: RelayRoute, plan: Plan,
               relay_skew: Skew | None, needs_offset: bool) -> list[NodeOutcome]:
    """One relay's share: an outcome per member, every one accounted for."""
    offset = relay_skew.correction_ns if (needs_offset and relay_skew and opts.correct) else 0
    requests = list(plan(offset))
    body: RelayBody = {
        "targets": [{"name": m.name, "address": m.address} for m in route.members],
        "requests": [_wire(r, plan, offset, i) if needs_offset and opts.correct
                     else _wire(r) for i, r in enumerate(requests)],
        "timeout_s": round(max(0.05, client.remaining() * RELAY_TIME_SHARE), 3),
        "skew_samples": opts.skew_samples,
        "max_answer_bytes": client.opts.max_answer_bytes,
    }
    try:
        async with asyncio.timeout_at(client.deadline):
            reply = await client.post(route.relay, paths.RELAY, body)
    except NodeFailed as exc:
        return [_failed(m, route, exc.failure) for m in route.members]
    except TimeoutError:
        return [_failed(m, route, Failure(
            "timeout", f"no answer from {route.relay.address} within the "
            f"{client.opts.timeout_s:g} s timeout", "is the relay hung or overloaded? raise "
            "--timeout, or choose other relays")) for m in route.members]
    return unpack(reply, route, requests)


def _failed(member: Target, route: RelayRoute, failure: Failure) -> NodeOutcome:
    return NodeOutcome(member, member.name, failure=Failure(
        failure.kind, f"via relay {route.relay.name}: {failure.message}", failure.hint,
        failure.status, failure.code))


def _wire(r: Request, plan: Plan | None = None, offset: int = 0, index: int = 0
          ) -> RelayedRequest:
    out: RelayedRequest = {"method": r.method, "path": r.path}
    if r.params is not None:
        out["params"] = r.params
    if r.body is not None:
        out["body"] = r.body
    if plan is not None:
        moved = list(plan(offset + SHIFT_PROBE))[index]
        shift = time_paths({"params": r.params, "body": r.body},
                           {"params": moved.params, "body": moved.body}, SHIFT_PROBE)
        if shift:
            out["shift"] = shift
    return out


def time_paths(a: Any, b: Any, delta: int, at: tuple[str | int, ...] = ()
               ) -> list[list[str | int]]:
    """Where ``b`` is ``a`` moved by ``delta`` (integers, or strings of them): the fields
    a plan fills with times in the node's clock, which the relay moves by its offset to
    each peer. Plans are linear in the offset, so comparing two of them finds exactly
    those fields."""
    out: list[list[str | int]] = []
    if isinstance(a, dict) and isinstance(b, dict):
        for key in a:
            if key in b:
                out += time_paths(a[key], b[key], delta, (*at, str(key)))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += time_paths(x, y, delta, (*at, i))
    else:
        x, y = _as_int(a), _as_int(b)
        if x is not None and y is not None and y - x == delta:
            out.append(list(at))
    return out


def _as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.lstrip("-").isdigit() and len(v) <= 20:
        return int(v)
    return None


# ---- a relay's answer, checked ------------------------------------------------------


def unpack(reply: dict[str, object], route: RelayRoute, requests: Sequence[Request]
           ) -> list[NodeOutcome]:
    """A relay's merged answer as one outcome per member; what it says of other nodes
    is dropped, a member it leaves out fails with that said."""
    entries = reply.get("nodes")
    if not isinstance(entries, list):
        failure = bad_value(f"relay {route.relay.address}", "no list of nodes").failure
        return [_failed(m, route, failure) for m in route.members]
    wanted = {m.address: m for m in route.members}
    got: dict[str, NodeOutcome] = {}
    for entry in entries[: len(route.members) * 2]:
        if not isinstance(entry, dict):
            continue
        address = entry.get("address")
        member = wanted.get(address) if isinstance(address, str) else None
        if member is None or member.address in got:
            continue
        got[member.address] = _entry(entry, member, route, requests)
    missing = Failure("relay", f"relay {route.relay.name} gave no answer for this node",
                      "see the relay's log; or ask this node directly")
    return [got.get(m.address) or _failed(m, route, missing) for m in route.members]


def _entry(entry: dict[str, object], member: Target, route: RelayRoute,
           requests: Sequence[Request]) -> NodeOutcome:
    out = NodeOutcome(member, member.name)
    failure = entry.get("failure")
    if failure is not None:
        out.failure = _failure_of(failure, route)
        return out
    try:
        out.replies = _replies(entry.get("replies"), member, requests)
    except NodeFailed as exc:
        out.failure = Failure(exc.failure.kind, f"via relay {route.relay.name}: "
                              f"{exc.failure.message}", exc.failure.hint)
        return out
    out.skew = _skew(entry.get("skew"))
    if out.skew is None:
        why = entry.get("skew_failure")
        out.skew_failure = (_failure_of(why, route) if isinstance(why, dict)
                            else Failure("skew", "the relay sent no clock estimate"))
    return out


def _replies(raw: Any, member: Target, requests: Sequence[Request]
             ) -> list[dict[str, object]]:
    """The same checks a direct answer passes (fanout's per-request checks)."""
    where = f"{member.address} (relayed)"
    if not isinstance(raw, list) or len(raw) != len(requests):
        raise bad_value(where, f"{len(raw) if isinstance(raw, list) else 'no'} replies for "
                        f"{len(requests)} requests")
    out = []
    for reply, r in zip(raw, requests, strict=True):
        if not isinstance(reply, dict):
            raise bad_value(where, "a reply that is not an object")
        out.append(checked(r, reply, f"{where}{r.path}"))
    return out


def _failure_of(raw: Any, route: RelayRoute) -> Failure:
    if not isinstance(raw, dict):
        raw = {}
    kind = raw.get("kind") if raw.get("kind") in FAILURE_KINDS else "relay"
    message = printable(raw.get("message") or "no reason given", 500)
    hint = printable(raw["hint"], 500) if isinstance(raw.get("hint"), str) else None
    code = printable(raw["code"], 40) if isinstance(raw.get("code"), str) else None
    return Failure(str(kind), f"via relay {route.relay.name}: {message}", hint,
                   valid_int(raw.get("status"), 100, 599), code)


def _skew(raw: Any) -> Skew | None:
    """A relay's estimate of a peer's clock, when every figure is a sane integer."""
    if not isinstance(raw, dict):
        return None
    offset = valid_int(raw.get("offset_ns"), INT64_MIN // 4, INT64_MAX // 4)
    error = valid_int(raw.get("error_ns"), 0, INT64_MAX // 4)
    samples = valid_int(raw.get("samples"), 0, 1000)
    used = valid_int(raw.get("used"), 0, 1000)
    if offset is None or error is None or samples is None or used is None:
        return None
    return Skew(offset_ns=float(offset), error_ns=float(error), samples=samples, used=used)


def skew_wire(s: Skew) -> SkewJson:
    """How a relay sends an estimate: integer nanoseconds."""
    return {"offset_ns": round(s.offset_ns), "error_ns": round(s.error_ns),
            "samples": s.samples, "used": s.used}
