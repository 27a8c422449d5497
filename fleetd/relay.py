"""Peer relays, the agent's side: ``POST /api/v1/relay`` fans a client's request out to a
list of peers with the fleet client and this node's own certificate, and answers with
one document in which every peer's replies, failure and clock estimate are its own.

It sits above ``fleetd.node`` (it is served by the agent) and ``fleetd.fleet`` (it asks
like a client), so the CLI plugs it into the agent as a route and a middleware.

Rules (docs/fleet.md "Relays"):

* Off unless ``relay.enabled`` is true in this agent's fleetd.yaml (403 otherwise); the
  peers accept the relay's node certificate only when it is in their ``tls.relay_nodes``.
* Only to the fleet: the relay forwards to the nodes its own ``relay.peers`` lists, and
  to no other address. A client names a target (by name, or by an address that is
  listed); the relay dials the address its configuration gives for it. A target it
  does not list fails, named, and is never contacted: a relay is not a port scanner.
* A peer that could not be reached is reported to the client as ``unreachable``, one
  kind and one message whether the connection was refused, timed out or met something
  that does not speak TLS: the client learns nothing about ports. The relay's own log
  keeps the reason.
* Only a client with a certificate may use a relay; a node certificate may not (that
  would be a relayed request relayed again), and neither may a request that already
  carries the relay marker.
* The client's identity (as this agent saw its certificate) and the limits travel to
  every peer in headers, and each peer logs them. Limits are only ever lowered: the
  forwarded row, byte and time limits are the smaller of the client's and this agent's
  own ceilings, and each peer applies its own ceilings on top.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import orjson
from aiohttp import web

from fleetd.config import FleetNode
from fleetd.errors import ConfigError
from fleetd.fleet import skew as skewmod
from fleetd.fleet.client import ClientOptions
from fleetd.fleet.dispatch import fan_out
from fleetd.fleet.fanout import FleetOptions, NodeOutcome, Request
from fleetd.fleet.relayed import MAX_SHIFTS, skew_wire
from fleetd.fleet.targets import Target
from fleetd.node.api import client_of, error_response
from fleetd.security.certs import ROLE_NODE, peer_role
from fleetd.store.guard import Limits
from fleetd.wire import paths
from fleetd.wire.failure import Failure
from fleetd.wire.headers import RELAY_LIMITS, RELAYED_FOR
from fleetd.wire.limits import MAX_ANSWER_BYTES, RELAY_REQUESTS
from fleetd.wire.shapes import RelayNode
from fleetd.wire.values import printable

log = logging.getLogger("fleetd.relay")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

BODY_TIMEOUT_S = 30.0
QUERY_TIME_SHARE = 0.9  # of the relayed fan-out's deadline, for a peer's SQL
PATH_CHARS = 200
MAX_PARAMS = 32
MAX_SHIFT_DEPTH = 6
FORWARDED_CHARS = 200  # of the identity a relay names, as a peer logs it
_HINT_ENABLE = ("set relay: {enabled: true} in the fleetd.yaml of the agents that should "
                "relay (and list them under tls.relay_nodes on their peers), or ask the "
                "nodes directly (drop --relay-via/--fanout-degree)")


# Failures that happen before a peer answers as an agent: they would tell a client what
# is listening where, so a relay reports them all as one kind.
_CONNECTION_KINDS = frozenset({"refused", "unreachable", "tls", "timeout", "disconnected"})


@dataclass(frozen=True)
class RelaySettings:
    node: str
    enabled: bool = False
    peers: tuple[Target, ...] = ()  # relay.peers: the only nodes it forwards to
    client: ClientOptions | None = None  # TLS as this node (its cert, the fleet CA)
    limits: Limits = field(default_factory=Limits)  # ceilings: nothing forwarded goes above
    max_targets: int = 64
    timeout_s: float = 30.0
    max_answer_bytes: int = 64 * 1024 * 1024


def relay_routes(s: RelaySettings) -> list[web.RouteDef]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await relay(request, s)

    return [web.post(paths.RELAY, handle)]


# ---- on every agent: who may forward, and the log of what was forwarded ---------------


def relayed_middleware(relay_nodes: frozenset[str]) -> Any:
    """A node certificate (admitted as a relay by ``tls.relay_nodes``) only forwards a
    client's request, marked as such; such a request is logged with the client and its
    limits, and never relayed again. A client may not send the marker itself."""
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        forwarded = request.headers.get(RELAYED_FOR)
        who = client_of(request)
        cn = who[5:] if who.startswith("cert:") else None
        if forwarded is None and (cn is None or cn not in relay_nodes):
            return await handler(request)  # the common case: a client, unmarked
        if _role(request) == ROLE_NODE:
            if request.path == paths.RELAY:
                return _forbidden(f"node {cn!r} asked this node to relay: a relayed request "
                                  "cannot be relayed again", "give the client a direct "
                                  "route to its relays (one level of relays only)")
            if forwarded is None:
                return _forbidden(f"node certificate {cn!r} may only forward a client's "
                                  f"request (marked {RELAYED_FOR})",
                                  "query with a client certificate: fleetd certs "
                                  "issue-client NAME")
            level = logging.DEBUG if request.path == paths.TIME else logging.INFO
            log.log(level, "relayed by node %s for %s: %s %s (limits: %s)", cn,
                    printable(forwarded, FORWARDED_CHARS), request.method, request.path,
                    printable(request.headers.get(RELAY_LIMITS, "none"), FORWARDED_CHARS))
            return await handler(request)
        if forwarded is not None:
            return _forbidden(f"only a relay node may forward a request for another client "
                              f"({RELAYED_FOR} from {who})",
                              "send the request without that header")
        return await handler(request)

    return check


def _role(request: web.Request) -> str | None:
    ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return None
    try:
        return peer_role(der).role
    except ValueError:
        return None


def _forbidden(message: str, hint: str) -> web.Response:
    return error_response("forbidden", f"refused: {message}", hint)


# ---- on a relay: the fan-out for a client --------------------------------------------


class _Bad(Exception):
    def __init__(self, message: str, hint: str = f"see docs/api.md, POST {paths.RELAY}"):
        super().__init__(message)
        self.message, self.hint = message, hint


async def relay(request: web.Request, s: RelaySettings) -> web.StreamResponse:
    if not s.enabled or s.client is None:
        return _forbidden(f"node {s.node!r} does not relay (relay.enabled is false in its "
                          "fleetd.yaml)", _HINT_ENABLE)
    who = client_of(request)
    if request.headers.get(RELAYED_FOR) is not None or _role(request) == ROLE_NODE:
        return _forbidden("a relayed request cannot be relayed again",
                          "one level of relays only: the client asks the relays itself")
    if not who.startswith("cert:"):
        return _forbidden(f"relaying needs a client certificate, and {who} presented none",
                          "pass --client-cert and --client-key (fleetd certs issue-client "
                          "NAME); agents that relay should require them (tls.client_ca)")
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
        body = orjson.loads(raw)
        job = _job(body, s)
    except (_Bad, orjson.JSONDecodeError, TimeoutError) as exc:
        message = exc.message if isinstance(exc, _Bad) else f"unreadable relay request ({exc})"
        hint = exc.hint if isinstance(exc, _Bad) else "send a JSON object"
        return error_response("bad_request", message, hint)
    log.info("relaying for %s to %d node(s): %s (limits: %s)", who, len(job.targets),
             ", ".join(f"{r.method} {r.path}" for r in job.requests), job.limits_text)
    return await _run(job, s, who)


def relay_peers(nodes: Sequence[FleetNode], source: str = "relay.peers"
                ) -> tuple[Target, ...]:
    """The targets of ``relay.peers`` (``NAME=HOST:PORT`` or ``{name, address}``);
    ConfigError naming a bad entry."""
    from fleetd.config import parse_hostport

    out: dict[str, Target] = {}
    for i, node in enumerate(nodes):
        if not node.address:
            raise ConfigError(f"{source}[{i}] has no address",
                              "list each peer as NAME=HOST:PORT, e.g. gpu-02=10.0.0.12:7600")
        host, port = parse_hostport(node.address, f"{source}[{i}]")
        t = Target(node.name or Target("", host, port).address, host, port)
        out.setdefault(t.address, t)
    return tuple(out.values())


@dataclass(frozen=True)
class _Asked:
    """One target of a relay request: the key the client reads the answer by, and the
    listed peer it resolved to (None: not a peer of this relay, never contacted)."""

    address: str
    name: str
    peer: Target | None


@dataclass(frozen=True, slots=True)
class _Relayed:
    """One request of the client's (wire.shapes.RelayedRequest), checked (:func:`_request`)."""

    method: str  # GET | POST
    path: str  # an agent API path, never the relay's own
    params: dict[str, str] | None
    # Passed on as it came (a query's limits lowered to ours): each peer checks it, as it
    # would the client's own, so it stays the parsed JSON object it is.
    body: dict[str, object] | None
    shift: list[list[str | int]]  # the fields moved into each peer's clock


class _Moved(TypedDict):
    """A request's params and body, copied for one peer and moved into its clock."""

    params: dict[str, str] | None
    body: dict[str, object] | None


@dataclass(frozen=True)
class _Job:
    targets: tuple[Target, ...]  # the listed peers to ask, each once
    asked: tuple[_Asked, ...]
    requests: list[_Relayed]
    timeout_s: float
    skew_samples: int
    max_answer_bytes: int
    limits_text: str


def _job(body: Any, s: RelaySettings) -> _Job:
    if not isinstance(body, dict):
        raise _Bad("the relay request must be a JSON object")
    unknown = set(body) - {"targets", "requests", "timeout_s", "skew_samples",
                           "max_answer_bytes"}
    if unknown:
        raise _Bad(f"unknown field(s) {sorted(unknown)} in the relay request")
    wanted = _targets(body.get("targets"), s.max_targets, s.peers)
    targets = tuple({a.peer.address: a.peer for a in wanted if a.peer is not None}.values())
    requests = [_request(r, s.limits) for r in _list(body.get("requests"), "requests",
                                                      RELAY_REQUESTS)]
    timeout = min(_number(body.get("timeout_s", s.timeout_s), "timeout_s"), s.timeout_s)
    samples = body.get("skew_samples", skewmod.SAMPLES)
    if not isinstance(samples, int) or isinstance(samples, bool) or not 0 <= samples <= 10:
        raise _Bad(f"skew_samples={printable(samples, 40)} must be a whole number 0..10")
    cap = min(int(_number(body.get("max_answer_bytes", s.max_answer_bytes),
                          "max_answer_bytes")), s.max_answer_bytes)
    for r in requests:
        body = r.body
        if r.path == paths.QUERY and body is not None:
            # A node's SQL must stop before this fan-out's deadline, so that it answers
            # with its own timeout error instead of being cut off without one.
            asked = body.get("timeout_s")
            if isinstance(asked, int | float) and not isinstance(asked, bool):
                body["timeout_s"] = min(asked, round(timeout * QUERY_TIME_SHARE, 3))
    query = next((r.body for r in requests if r.path == paths.QUERY), None) or {}
    # The client's query limits as it sent them (only written into a header's text).
    limits: dict[str, object] = {k: query[k] for k in ("max_rows", "max_bytes", "timeout_s")
                                 if k in query}
    text = ";".join(f"{k}={v}" for k, v in {**limits, "fanout_timeout_s": timeout}.items())
    return _Job(targets, wanted, requests, timeout, samples, cap, text)


def _list(value: Any, what: str, most: int) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise _Bad(f'field "{what}" must be a non-empty list')
    if len(value) > most:
        raise _Bad(f'{len(value)} {what} in one relay request, over this relay\'s limit of '
                   f"{most}", "split the nodes over more relays (--relay-via A,B,... or a "
                   "smaller --fanout-degree)")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _Bad(f"{what}={printable(value, 40)} must be a number above zero")
    return float(value)


def _targets(value: Any, most: int, peers: Sequence[Target]) -> tuple[_Asked, ...]:
    """Each requested target resolved against ``peers``: by name first, else by its
    address when that is a listed one. The request's address is only ever a key to
    look up, never dialed."""
    from fleetd.config import parse_hostport

    by_name = {p.name: p for p in peers}
    by_address = {p.address: p for p in peers}
    out: dict[str, _Asked] = {}
    for item in _list(value, "targets", most):
        address = item.get("address") if isinstance(item, dict) else None
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name:
            name = None
        if address is None and name is None:
            raise _Bad(f"target {printable(item, 80)} has neither a name nor an address")
        key = None
        if address is not None:
            if not isinstance(address, str):
                raise _Bad(f"target {printable(item, 80)} has an address that is not a "
                           "string")
            try:
                host, port = parse_hostport(address, "target address")
            except ConfigError as exc:
                raise _Bad(exc.message, exc.hint or "use HOST:PORT") from None
            key = Target("", host, port).address
        peer = by_name.get(name) if name is not None else None
        if peer is None and key is not None:
            peer = by_address.get(key)
        label = printable(name, 253) if name is not None else printable(address, 253)
        wire = address if isinstance(address, str) else (peer.address if peer else label)
        out.setdefault(wire, _Asked(wire, label, peer))
    return tuple(out.values())


def _request(value: Any, ceiling: Limits) -> _Relayed:
    if not isinstance(value, dict):
        raise _Bad("each of requests must be an object {method, path, params?, body?}")
    method, path = value.get("method"), value.get("path")
    if method not in ("GET", "POST"):
        raise _Bad(f"method {printable(method, 20)!r} cannot be relayed", "GET or POST")
    if (not isinstance(path, str) or not path.startswith(paths.PREFIX) or "?" in path
            or len(path) > PATH_CHARS or not path.isprintable()):
        raise _Bad(f"path {printable(path, 80)!r} cannot be relayed",
                   f"an agent API path, e.g. {paths.QUERY}; parameters go in params")
    if path == paths.RELAY:
        raise _Bad("a relayed request cannot be relayed again",
                   "one level of relays only")
    params = value.get("params")
    if params is not None and (not isinstance(params, dict) or len(params) > MAX_PARAMS
                               or not all(isinstance(k, str) and isinstance(v, str)
                                          for k, v in params.items())):
        raise _Bad(f"params of {path} must be an object of strings (at most {MAX_PARAMS})")
    body = value.get("body")
    if body is not None and not isinstance(body, dict):
        raise _Bad(f"body of {path} must be a JSON object")
    if body is not None and path == paths.QUERY:
        body = _lowered(body, ceiling)
    shift = value.get("shift") or []
    if (not isinstance(shift, list) or len(shift) > MAX_SHIFTS or not all(
            isinstance(p, list) and 1 <= len(p) <= MAX_SHIFT_DEPTH
            and all(isinstance(k, str | int) and not isinstance(k, bool) for k in p)
            for p in shift)):
        raise _Bad(f"shift of {path} must be a list of at most {MAX_SHIFTS} field paths")
    return _Relayed(method, path, params, body, shift)


def _lowered(body: dict[str, object], ceiling: Limits) -> dict[str, object]:
    """The client's query limits, never above this agent's ceilings: a relay forwards
    min(client's, its own) and every peer then applies its own on top."""
    out = dict(body)
    for key, top in (("max_rows", ceiling.max_rows), ("max_bytes", ceiling.max_bytes),
                     ("timeout_s", ceiling.timeout_s)):
        asked = out.get(key)
        if asked is None or (isinstance(asked, int | float) and not isinstance(asked, bool)
                             and asked > top):
            out[key] = top
        # Anything else (a string, a negative number) goes on: the peer refuses it with
        # its own message, as it would refuse the client.
    return out


def _plan(requests: list[_Relayed]) -> Callable[[int], list[Request]]:
    def plan(offset_ns: int) -> list[Request]:
        out = []
        for r in requests:
            moved: _Moved = {"params": r.params, "body": r.body}
            if offset_ns and r.shift:
                moved = orjson.loads(orjson.dumps(moved))  # a copy per peer
                for path in r.shift:
                    _shift(moved, path, offset_ns)
            out.append(Request(r.method, r.path, moved["params"], moved["body"]))
        return out

    return plan


def _shift(obj: Any, path: list[str | int], offset_ns: int) -> None:
    """Move one time field (int, or a string of one) from our clock into the peer's."""
    for key in path[:-1]:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return
    last = path[-1]
    try:
        value = obj[last]
    except (KeyError, IndexError, TypeError):
        return
    if isinstance(value, int) and not isinstance(value, bool):
        obj[last] = value + offset_ns
    elif isinstance(value, str) and value.lstrip("-").isdigit() and len(value) <= 20:
        obj[last] = str(int(value) + offset_ns)


async def _run(job: _Job, s: RelaySettings, who: str) -> web.StreamResponse:
    assert s.client is not None
    headers = ((RELAYED_FOR, who), (RELAY_LIMITS, job.limits_text))
    client = ClientOptions(
        ssl=s.client.ssl, token=s.client.token, timeout_s=job.timeout_s,
        connect_timeout_s=min(s.client.connect_timeout_s, job.timeout_s),
        concurrency=s.client.concurrency, retries=s.client.retries, has_client_cert=True,
        max_answer_bytes=min(MAX_ANSWER_BYTES, job.max_answer_bytes), headers=headers)
    started = time.perf_counter()
    outcomes: dict[str, NodeOutcome] = {}
    answered = 0
    if job.targets:
        opts = FleetOptions(job.targets, client, skew_samples=job.skew_samples)
        answer = await fan_out(opts, _plan(job.requests),
                               needs_offset=any(r.shift for r in job.requests))
        outcomes = {o.target.address: o for o in answer.outcomes}
        answered = len(answer.answered)
    parts, used = [], 0
    for a in job.asked:
        o = outcomes.get(a.peer.address) if a.peer is not None else None
        if o is None:
            entry: RelayNode = {"address": a.address, "name": a.name,
                                "failure": _not_a_peer(a, s).to_json()}
        else:
            entry = {"address": a.address, "name": o.name, "replies": o.replies,
                     "failure": _told(o.failure, o, s).to_json() if o.failure else None,
                     "skew": skew_wire(o.skew) if o.skew else None,
                     "skew_failure": _told(o.skew_failure, o, s).to_json()
                     if o.skew_failure else None}
        part = orjson.dumps(entry)
        if used + len(part) > job.max_answer_bytes:
            cut: RelayNode = {"address": a.address, "name": entry["name"],
                              "failure": Failure(
                                  "too_large", f"answer of {len(part)} bytes would take "
                                  f"the relay's merged answer past {job.max_answer_bytes}"
                                  " bytes", "lower --limit, or relay through more nodes"
                              ).to_json()}
            part = orjson.dumps(cut)
        used += len(part)
        parts.append(part)
    log.info("relayed for %s: %d of %d node(s) answered in %.3f s", who, answered,
             len(job.asked), time.perf_counter() - started)
    head = orjson.dumps({"relay": s.node, "for": who})[:-1]
    return web.Response(body=head + b',"nodes":[' + b",".join(parts) + b"]}",
                        content_type="application/json")


def _not_a_peer(a: _Asked, s: RelaySettings) -> Failure:
    log.info("not forwarding to %s: relay.peers does not list it", a.name)
    return Failure("relay", f"{a.name} is not one of relay {s.node}'s peers (relay.peers in "
                   "its fleetd.yaml); it was not contacted",
                   "list the node under relay.peers on that relay, or ask it directly")


def _told(f: Failure, o: NodeOutcome, s: RelaySettings) -> Failure:
    """What a client is told of a peer's failure: a connection that failed any way
    (refused, timed out, not TLS, cut) is one kind and one message, so that a relay
    says nothing about ports; the reason goes to the relay's log."""
    if f.kind not in _CONNECTION_KINDS:
        return f
    log.info("peer %s (%s) failed: %s", o.name, o.target.address, f.text())
    return Failure("unreachable", f"{o.name} could not be reached from relay {s.node} (or "
                   "did not answer in time)", "see that relay's log for the reason; check "
                   "the node, or ask it directly")
