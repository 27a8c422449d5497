"""Launch detail on demand, for the always-on mode (``--mode always-on``, #36).

Always-on keeps the launch probes on 1 s in 10; when detail matters, a window opens at
once and stays open for a while:

- the agent's own rule: while a local NCCL rank has waited in a collective for
  :data:`WAIT_NS` or more (the start of a hang, or a straggler's peers waiting for it),
  every :data:`CHECK_S` the window is held open another :data:`HOLD_S`, so the launches
  around the wait are traced whole;
- on request: ``POST /api/v1/detail?seconds=N`` (1 to :data:`MAX_S`), for a client such
  as ``fleetd watch`` or an operator who is about to look.

Full launch tracing costs the traced processes time, so a window is a permission
(issue #40, docs/security.md "Detail windows"): only a client the agent's fleetd.yaml
names under ``detail.clients`` (its certificate's CN or a DNS name of it), or whose
certificate carries an OU listed under ``detail.client_ous``, may open one; any other
gets 403. Every window, the agent's own included, is charged to an hourly budget
(``detail.max_s_per_hour``, 360 s: 10 %); a window is cut to what is left of it, and a
request when nothing is left gets 403. Each opening is logged with who asked and for
how long, and the answer gives the seconds granted and the budget left.

In full mode the launch probes are always on and both are no-ops (``opened`` is false
and says why).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

from aiohttp import web
from cryptography import x509
from cryptography.x509.oid import NameOID

from fleetd.errors import QueryError
from fleetd.node.api import STATE, client_of, json_response
from fleetd.node.ranks import RANKBOOK, local_waits
from fleetd.wire import paths
from fleetd.wire.headers import RELAYED_FOR
from fleetd.wire.values import printable

log = logging.getLogger("fleetd.node.detail")

WAIT_NS = 1_000_000_000  # a rank waiting this long in a collective opens a window
CHECK_S = 1.0
HOLD_S = 10.0  # each check that still sees the wait holds the window this much longer
MAX_S = 60  # the longest window a request may open
HOUR_S = 3600.0
MIN_GRANT_S = 1.0  # less budget left than this: nothing is granted
RULE = "the agent's wait rule"  # who opened a window the agent opened itself


class Detailed(Protocol):
    """The tracer side (fleetd.trace.agent_hook.AgentTracer.ask_detail): True when a
    window was asked for, False when launches are traced all the time anyway."""

    def ask_detail(self, seconds: float) -> bool: ...


class BudgetJson(TypedDict):
    per_hour_s: float  # detail.max_s_per_hour
    used_s: float  # charged to windows of the last hour (the open one's rest included)
    remaining_s: float


class DetailReply(TypedDict):
    node: str
    opened: bool
    seconds: int  # granted: the window is open this long from now (0: not opened)
    asked: int
    why: str
    budget: BudgetJson


@dataclass(frozen=True)
class DetailPolicy:
    """The agent's fleetd.yaml ``detail`` section."""

    clients: frozenset[str] = frozenset()  # certificate CNs or DNS names
    client_ous: frozenset[str] = frozenset()  # or any certificate with one of these OUs
    max_s_per_hour: float = 0.1 * HOUR_S


@dataclass(frozen=True, slots=True)
class Grant:
    """A window the budget allows: open until ``end`` (monotonic s), costing ``charge``
    (what it adds past the window already open)."""

    end: float
    charge: float


@dataclass
class DetailBudget:
    """Launch-detail on-time charged in the last hour. Windows are charged only for what
    they add past the one already open, so charged spans never overlap; a span counts
    (its future part included) until an hour after it ends."""

    per_hour_s: float
    clock: Callable[[], float] = time.monotonic
    spans: list[tuple[float, float]] = field(default_factory=list)

    def used(self) -> float:
        since = self.clock() - HOUR_S
        self.spans = [(a, b) for a, b in self.spans if b > since]
        return sum(b - max(a, since) for a, b in self.spans)

    def remaining(self) -> float:
        return max(0.0, self.per_hour_s - self.used())

    def offer(self, seconds: float) -> Grant | None:
        """The window ``seconds`` from now, cut to the budget left; None when less than
        MIN_GRANT_S is left and the window would add time."""
        now = self.clock()
        start = max(now, self.spans[-1][1] if self.spans else now)
        want = now + seconds - start
        if want <= 0:
            return Grant(start, 0.0)  # already open that long
        left = self.remaining()
        if left < min(MIN_GRANT_S, want):
            return None
        return Grant(start + min(want, left), min(want, left))

    def charge(self, grant: Grant) -> None:
        if grant.charge > 0:
            self.spans.append((grant.end - grant.charge, grant.end))

    def json(self) -> BudgetJson:
        used = self.used()
        return {"per_hour_s": self.per_hour_s, "used_s": round(used, 1),
                "remaining_s": round(max(0.0, self.per_hour_s - used), 1)}


class DetailGate:
    """Who may open windows, and the budget every window is charged to."""

    def __init__(self, policy: DetailPolicy) -> None:
        self.policy = policy
        self.budget = DetailBudget(policy.max_s_per_hour)

    def refusal(self, request: web.Request) -> str | None:
        """Why this request's client may not open a window, or None when it may."""
        names, ous = _client_names(request)
        if names & self.policy.clients or ous & self.policy.client_ous:
            return None
        return (f"{client_of(request)} may not open launch-detail windows on this node "
                "(not in its detail.clients or detail.client_ous)")


DETAIL_TRACER = web.AppKey("detail_tracer", Detailed)
DETAIL_GATE = web.AppKey("detail_gate", DetailGate)
_REFUSED_HINT = ("list the client's certificate name under detail.clients (or one of its "
                 "OUs under detail.client_ous) in the agent's fleetd.yaml "
                 "(docs/security.md \"Detail windows\")")


def _client_names(request: web.Request) -> tuple[frozenset[str], frozenset[str]]:
    """(the names, the OUs) of the client's certificate: its CN and DNS names. For a
    request a relay forwards (only a relay node may: fleetd.relay), the name the relay
    vouches for, without OUs."""
    forwarded = request.headers.get(RELAYED_FOR)
    if forwarded is not None:
        return frozenset({forwarded.removeprefix("cert:")}), frozenset()
    ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return frozenset(), frozenset()
    cert = x509.load_der_x509_certificate(der)
    names = {str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names.update(sans.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        pass
    ous = {str(a.value) for a in
           cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)}
    return frozenset(names), frozenset(ous)


def _seconds(text: str | None) -> int:
    try:
        value = int(text or "")
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_S:
        raise QueryError(f"seconds={str(text)[:40]!r} must be a whole number from 1 to {MAX_S}",
                         f"e.g. POST {paths.DETAIL}?seconds=10", code="bad_request")
    return value


async def detail(request: web.Request) -> web.StreamResponse:
    """``POST /api/v1/detail?seconds=N``: trace launches whole for the next N seconds."""
    seconds = _seconds(request.query.get("seconds"))
    st = request.app[STATE]
    gate = request.app.get(DETAIL_GATE) or DetailGate(DetailPolicy())
    who = printable(client_of(request), 200)
    refusal = gate.refusal(request)
    if refusal is not None:
        log.info("launch detail refused to %s (%d s asked): not permitted", who, seconds)
        raise QueryError(f"refused: {refusal}", _REFUSED_HINT, code="forbidden")
    grant = gate.budget.offer(seconds)
    if grant is None:
        spent = gate.budget.json()
        log.info("launch detail refused to %s (%d s asked): the hourly budget is spent",
                 who, seconds)
        raise QueryError(f"refused: this node's launch-detail budget is spent ("
                         f"{spent['used_s']:g} of {spent['per_hour_s']:g} s in the last "
                         "hour)", "ask again later, or raise detail.max_s_per_hour in the "
                         "agent's fleetd.yaml", code="forbidden")
    tracer = request.app.get(DETAIL_TRACER)
    granted = round(grant.end - gate.budget.clock())
    if tracer is None:
        opened, why = False, "this agent does not trace (started without a tracer)"
    elif tracer.ask_detail(grant.end - gate.budget.clock()):
        gate.budget.charge(grant)
        opened = True
        why = "launch probes on for the window (--mode always-on)"
        if granted < seconds:
            why += f"; cut to {granted} s by the hourly budget"
        log.info("launch detail opened for %s: %d s (asked %d); %s", who, granted, seconds,
                 _budget_text(gate.budget))
    else:
        opened, why = False, "launch probes are on all the time (--mode full)"
    return json_response(DetailReply(node=st.node, opened=opened,
                                     seconds=granted if opened else 0, asked=seconds,
                                     why=why, budget=gate.budget.json()))


def _budget_text(budget: DetailBudget) -> str:
    b = budget.json()
    return f"{b['used_s']:g} of {b['per_hour_s']:g} s used in the last hour"


async def watch_waits(tracer: Detailed, waited: Callable[[], int],
                      budget: DetailBudget) -> None:
    """Until cancelled: hold a window open while ``waited()`` (the longest local
    collective wait, ns) has reached :data:`WAIT_NS`, within ``budget`` (the rule needs
    no client's permission, but its windows count); ends at the first ask a tracer
    without a duty cycle refuses."""
    opened = spent = False
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(CHECK_S)
        # Off the loop: each rank's state is a /proc read (up to 512 ranks).
        longest = await loop.run_in_executor(None, waited)
        if longest < WAIT_NS:
            opened = spent = False
            continue
        grant = budget.offer(HOLD_S)
        if grant is None:
            if not spent:
                log.warning("a rank has waited %.1f s in a collective, but the hourly "
                            "launch-detail budget is spent (%s): no window",
                            longest / 1e9, _budget_text(budget))
            spent = True
            continue
        if not tracer.ask_detail(grant.end - budget.clock()):
            return  # launches are traced all the time (--mode full): nothing to hold
        budget.charge(grant)
        if not opened:
            log.info("launch detail opened for %s: a rank has waited %.1f s in a "
                     "collective; %s", RULE, longest / 1e9, _budget_text(budget))
            opened = True


def longest_wait(app: web.Application, node: str) -> Callable[[], int]:
    """The longest wait of any local rank group, ns (0: none waits)."""
    measure = local_waits(app[RANKBOOK], node)
    return lambda: max((ns for _, _, ns in measure()), default=0)


ROUTES = [web.post(paths.DETAIL, detail)]
