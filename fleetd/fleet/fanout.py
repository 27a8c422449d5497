"""Ask every node at once and collect an answer made of the nodes that answered.

Per node, one task on one connection: every answer is also a clock sample (the agent
stamps its receive and send times in headers), so skew estimation adds no request and no
latency; only a request that must be expressed in the node's own clock (an absolute
time window) waits for one ``/api/v1/time`` sample first. Every task lives under
the client's deadline, so a node that hangs (SIGSTOP, a dead link) costs at most the
timeout and becomes a warning, never a delay of the whole answer beyond it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fleetd.errors import UsageError
from fleetd.fleet import skew as skewmod
from fleetd.fleet.client import ClientOptions, ClockLog, FleetClient, clock_samples
from fleetd.fleet.combine import NodeWarning
from fleetd.fleet.skew import Skew
from fleetd.fleet.targets import RelayRoute, Target
from fleetd.wire import paths
from fleetd.wire.failure import BadReply, Failure, NodeFailed
from fleetd.wire.headers import RECV_NS, SEND_NS
from fleetd.wire.limits import INT64_MAX, INT64_MIN, NAME_CHARS
from fleetd.wire.shapes import QueryBody
from fleetd.wire.values import printable

log = logging.getLogger("fleetd.fleet.fanout")
T = TypeVar("T")

EXIT_COMPLETE = 0
EXIT_PARTIAL = 3  # some nodes answered, the others are listed in the warnings
EXIT_NO_ANSWER = 4  # no node answered
# A node's query answer whose clock sample is worse than this (half its round trip)
# is followed by one /api/v1/time sample on the same connection.
EXTRA_SAMPLE_ABOVE_NS = 1_000_000
# Up to this many extra samples are taken one after another (a few ms each, on open
# connections); more go in parallel, where the deadline matters more than the error.
SERIAL_SAMPLES = 16


@dataclass(frozen=True, slots=True)
class FleetOptions:
    targets: tuple[Target, ...]
    client: ClientOptions
    skew_samples: int = skewmod.SAMPLES  # 0: do not estimate skew; else estimate it
    correct: bool = True  # shift node timestamps into our clock
    skew_threshold_ms: float = 10.0
    keep_warm: bool = False  # reuse this thread's open client (see session())
    relays: tuple[RelayRoute, ...] = ()  # ask through peer relays (fleet/relayed.py)


@dataclass(frozen=True, slots=True)
class Request:
    method: str  # GET | POST
    path: str
    params: dict[str, str] | None = None
    # A query's (ours), or a body passed on as it came (a relay's client's: the peer
    # that gets it checks it, fleetd/relay.py).
    body: QueryBody | dict[str, object] | None = None
    expect: tuple[str, ...] = ()  # keys the answer must have
    # The answer checked (trimmed, rebuilt) by the wire's reader for its shape, raising
    # BadReply for one that is not usable; without one, every number in it must be one
    # JSON tools can carry.
    check: Callable[[dict[str, object]], Mapping[str, object]] | None = None


# offset (node clock minus ours, ns; 0 when unknown or not corrected) -> the requests
Plan = Callable[[int], Sequence[Request]]
# (client, node, offset) -> the node's replies: what a plan's requests would give, for
# work that is more than one round of requests (a request that depends on another's
# answer, a streamed body)
NodeWork = Callable[[FleetClient, Target, int], Awaitable[list[dict[str, object]]]]


@dataclass(slots=True)
class NodeOutcome:
    target: Target
    name: str
    # One per request, as checked() left it: the request's reader's typed answer (copied
    # into a plain dict), or a body whose numbers were checked. A node's requests differ
    # in shape, so here each is only a JSON object; whoever planned the request knows
    # its reader and reads the reply as that reader's type.
    replies: list[dict[str, object]] | None = None
    failure: Failure | None = None
    skew: Skew | None = None
    skew_failure: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.replies is not None

    @property
    def correction_ns(self) -> int:
        return self.skew.correction_ns if self.skew is not None else 0


@dataclass(slots=True)
class FleetAnswer:
    outcomes: list[NodeOutcome]
    warnings: list[NodeWarning] = field(default_factory=list)
    elapsed_s: float = 0.0
    correct: bool = True

    @property
    def answered(self) -> list[NodeOutcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def failed(self) -> list[NodeOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def status(self) -> str:
        n = len(self.answered)
        return "complete" if n == len(self.outcomes) else "partial" if n else "none"

    @property
    def exit_code(self) -> int:
        return {"complete": EXIT_COMPLETE, "partial": EXIT_PARTIAL}.get(self.status,
                                                                        EXIT_NO_ANSWER)

    def skew_json(self) -> dict[str, dict[str, float]]:
        return {o.name: o.skew.to_json() for o in self.outcomes if o.skew is not None}

    def offset_ns(self, o: NodeOutcome) -> int:
        """What to subtract from this node's timestamps (0 with --no-skew-correct)."""
        return o.correction_ns if self.correct else 0


def plan_work(plan: Plan) -> NodeWork:
    """A plan's requests as one node's work: sent at once, the first failure fails it."""
    async def work(c: FleetClient, t: Target, offset: int) -> list[dict[str, object]]:
        return await send_all(c, t, plan(offset))

    return work


async def fan_out_work(opts: FleetOptions, work: NodeWork, *, needs_offset: bool = False,
                       client: FleetClient | None = None) -> FleetAnswer:
    """Run ``work`` on every node directly; ``needs_offset``: the work uses the node's
    offset. Every node runs under the same deadline, clock sampling, naming and failure
    handling. (:func:`fleetd.fleet.dispatch.fan_out` also goes through relays.)

    Without ``client`` a new session is made and closed (what one CLI command does);
    a long-running caller passes its own open client to keep connections warm.
    """
    if opts.relays:  # a relay runs plans only (fan_out), not work that depends on replies
        raise UsageError("this command cannot go through relays yet",
                         "drop --relay-via/--fanout-degree (relays serve query, ops, "
                         "overview, stacks, graphs and gpu)")
    if client is None:
        async with session(opts.client, warm=opts.keep_warm) as own:
            return await fan_out_work(opts, work, needs_offset=needs_offset, client=own)
    started = time.perf_counter()
    client.restart_deadline()
    offset_first = needs_offset and opts.correct
    # A fan-out wider than the cap on requests in flight keeps this loop busy from start
    # to end: a second sample would be read as late as the first, so none is added.
    extra = len(opts.targets) <= client.opts.concurrency
    tasks = [asyncio.ensure_future(_node(client, opts, t, work, offset_first, extra))
             for t in opts.targets]
    if opts.skew_samples > 0 and extra:
        # Extra clock samples wait until every node has answered (or half the time is
        # gone, so that a hung node delays nobody's): this loop is then idle (no
        # handshakes, no answers to parse), so a sample's round trip is the network's
        # and the node's, not our own backlog.
        await asyncio.wait(tasks, timeout=max(0.0, client.remaining() / 2))
        unsettled = [t for t in tasks if not (t.done() and t.result().settled)]
        if len(unsettled) <= SERIAL_SAMPLES:
            # One at a time: a sample's answer is then the only thing this loop reads,
            # so its round trip (hence its error) is not stretched by the others'.
            for task in unsettled:
                await _settle_clock(client, task)
        else:
            await asyncio.gather(*(_settle_clock(client, t) for t in unsettled))
    outcomes = [n.out for n in await asyncio.gather(*tasks)]
    client.keep_tickets()  # a later reconnect in this process resumes instead
    answer = FleetAnswer(list(outcomes), correct=opts.correct)
    settle(answer, opts)
    answer.elapsed_s = time.perf_counter() - started
    log.info("fan-out to %d node(s): %d answered in %.3f s", len(outcomes),
             len(answer.answered), answer.elapsed_s)
    return answer


# ---- warm clients for long-running callers --------------------------------------------

_WARM = threading.local()  # per thread (run_loop keeps one loop per thread): its clients


@contextlib.asynccontextmanager
async def session(client_opts: ClientOptions, *, warm: bool) -> AsyncIterator[FleetClient]:
    """A client for one fan-out. ``warm`` (``FleetOptions.keep_warm``, set by
    long-running callers such as the MCP server, whose tools run the sync fan-outs of
    ``fleetd.fleet.queries`` on worker threads): the one this thread keeps open for these
    options, so connections and TLS sessions stay warm from one call to the next; else
    a new one, closed afterwards (one CLI command)."""
    if not warm:
        async with FleetClient(client_opts) as own:
            yield own
        return
    loop = asyncio.get_running_loop()
    pool: dict[ClientOptions, FleetClient] = getattr(_WARM, "clients", {})
    if getattr(_WARM, "loop", None) is not loop:
        pool = {}  # a new loop: the old loop's connections cannot be used on it
        _WARM.loop, _WARM.clients = loop, pool
    client = pool.get(client_opts)
    if client is None:
        client = pool[client_opts] = await FleetClient(client_opts).__aenter__()
    yield client


@dataclass(slots=True)
class _Node:
    out: NodeOutcome
    clock: ClockLog  # the stamps of its exchanges, for its skew estimate
    failure: Failure | None = None  # why a clock sample failed
    settled: bool = False  # its skew is estimated (or it failed): no extra sample


async def _node(client: FleetClient, opts: FleetOptions, t: Target, work: NodeWork,
                offset_first: bool, extra: bool = True) -> _Node:
    """The node's work. Every stamped answer of this node is a clock sample
    (client.clock_samples); one /api/v1/time sample is taken first when the work needs
    the offset (times of ours moved into the node's clock), and after the whole fan-out
    when the work's samples are not good enough (:func:`_settle_clock`)."""
    out = NodeOutcome(t, t.name)
    node = _Node(out, ClockLog([]))
    with clock_samples(node.clock):
        try:
            async with asyncio.timeout_at(client.deadline):
                offset = 0
                if offset_first and opts.skew_samples > 0:
                    node.failure = await _extra_sample(client, t, out)
                    _estimate(out, node.clock, node.failure)
                    offset = out.correction_ns
                out.replies = await work(client, t, offset)
        except NodeFailed as exc:
            out.failure = exc.failure
        except TimeoutError:
            out.failure = Failure(
                "timeout", f"no answer from {t.address} within the "
                f"{client.opts.timeout_s:g} s timeout",
                "is the agent hung or overloaded? raise --timeout if it is just slow")
    if out.failure is not None or opts.skew_samples <= 0:
        node.settled = True
    elif (offset_first or not extra or node.failure is not None
          or not _worth_a_sample(node.clock)):
        # The usual case: no sample to add (and never a second extra one).
        _estimate(out, node.clock, node.failure)
        node.settled = True
    return node


async def _settle_clock(client: FleetClient, task: asyncio.Future[_Node]) -> None:
    """The node's skew from its samples, after one more when they are not good enough."""
    node = await task
    out = node.out
    if node.settled:
        return
    if _worth_a_sample(node.clock):
        with clock_samples(node.clock):
            try:
                async with asyncio.timeout_at(client.deadline):
                    node.failure = await _extra_sample(client, out.target, out)
            except TimeoutError:
                node.failure = Failure("timeout", "the clock sample did not finish in time")
    _estimate(out, node.clock, node.failure)


def _worth_a_sample(clock: ClockLog) -> bool:
    """No stamped answer, or only answers over a connection made for them whose round
    trip leaves the offset uncertain by more than EXTRA_SAMPLE_ABOVE_NS: such a request
    waited at the node for the end of its handshake, so one more exchange on the now
    open connection usually does much better. On a warm connection another sample
    would meet the same delays as the first: none is taken."""
    best = min((skewmod.Sample(*s).rtt_ns for s in clock.stamps), default=None)
    if best is None or best < 0:
        return True
    return clock.new_connection and best / 2 > EXTRA_SAMPLE_ABOVE_NS


async def _extra_sample(client: FleetClient, t: Target, out: NodeOutcome) -> Failure | None:
    name, failure = await skewmod.sample(client, t)
    if name:
        out.name = name
    return failure


def _estimate(out: NodeOutcome, clock: ClockLog, failure: Failure | None) -> None:
    samples = [skewmod.Sample(*s) for s in clock.stamps]
    if log.isEnabledFor(logging.DEBUG):
        log.debug("clock samples of %s (there, back, round trip; ms): %s", out.target.address,
                  ", ".join(f"{(s.t1 - s.t0) / 1e6:.3f}/{(s.t3 - s.t2) / 1e6:.3f}/"
                            f"{s.rtt_ns / 1e6:.3f}" for s in samples))
    out.skew = skewmod.estimate(samples)
    out.skew_failure = None if out.skew is not None else (
        failure or Failure("skew", "no clock sample (the node's answers carry no "
                           f"{RECV_NS}/{SEND_NS} stamps)"))


async def send_all(client: FleetClient, t: Target, requests: Sequence[Request]
                   ) -> list[dict[str, object]]:
    """The requests to one node at once; the first failure fails the node."""
    if len(requests) == 1:
        return [await _send(client, t, requests[0])]
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_send(client, t, r)) for r in requests]
    except BaseExceptionGroup as group:
        failed = group.subgroup(NodeFailed)
        if failed is not None:
            first = failed.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        raise
    return [task.result() for task in tasks]


async def _send(client: FleetClient, t: Target, r: Request) -> dict[str, object]:
    if r.method == "POST":
        reply = await client.post(t, r.path, r.body or {})
    else:
        reply = await client.get(t, r.path, r.params)
    return checked(r, reply, f"{t.address}{r.path}")


VERSION_HINT = f"is the agent a different fleetd version? compare {paths.HEALTH} versions"


def checked(r: Request, reply: dict[str, object], where: str) -> dict[str, object]:
    """A node's answer to ``r`` (direct or relayed), checked once: the keys it must have,
    then ``r.check`` (the wire's reader for its shape) or, without one, its numbers.
    Raises :class:`BadReply`, which fails the node."""
    missing = [k for k in r.expect if k not in reply]
    if missing:
        raise BadReply(f"{where} answered without {', '.join(missing)}", VERSION_HINT)
    if r.check is None:
        return check_numbers(reply, where)
    try:
        return dict(r.check(reply))
    except BadReply as exc:
        raise BadReply(f"{where} answered a malformed reply ({exc})", VERSION_HINT) from None


def bad_value(where: str, what: str) -> BadReply:
    return BadReply(f"{where} answered {what}")


def check_numbers(obj: T, where: str) -> T:
    """Every integer in ``obj`` fits in 64 bits and every float is finite: a node's
    value beyond that (1e300 where nanoseconds belong, 2**70) would fail far from here,
    when the merged answer is printed, and take the healthy nodes' rows with it."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        elif isinstance(v, int):
            if not INT64_MIN <= v <= INT64_MAX:
                raise bad_value(where, f"an integer beyond 64 bits ({printable(v, 30)})")
        elif isinstance(v, float) and not math.isfinite(v):
            raise bad_value(where, f"a number that is not finite ({v})")
    return obj


def settle(answer: FleetAnswer, opts: FleetOptions) -> None:
    """The fan-out's last step, direct or relayed: name the nodes, list the warnings."""
    _name_nodes(answer)
    answer.warnings = _warnings(answer, opts)


def _name_nodes(answer: FleetAnswer) -> None:
    """Rows carry the name a node calls itself; two nodes with one name get @address."""
    for o in answer.outcomes:
        for reply in o.replies or ():
            node = reply.get("node")
            if isinstance(node, str) and node:
                # Self-reported, so printed only once made harmless for a terminal.
                o.name = printable(node, NAME_CHARS)
                break
    counts = Counter(o.name for o in answer.outcomes)
    for o in answer.outcomes:
        if counts[o.name] > 1:
            o.name = f"{o.name}@{o.target.address}"


def fail(answer: FleetAnswer, o: NodeOutcome, failure: Failure) -> None:
    """A node whose answer is found unusable after the fan-out (a reply checked only by
    the operation): now failed, with the same warning as a node that failed in it."""
    o.replies, o.failure = None, failure
    answer.warnings.append(_failed_warning(o, failure))


def _failed_warning(o: NodeOutcome, failure: Failure) -> NodeWarning:
    return NodeWarning(o.name, failure.text(), failure.kind)


def _warnings(answer: FleetAnswer, opts: FleetOptions) -> list[NodeWarning]:
    out = []
    for o in answer.outcomes:
        if o.failure is not None:
            out.append(_failed_warning(o, o.failure))
            continue
        if "@" in o.name:
            out.append(NodeWarning(o.name, "another node answers to the same name; this "
                                   "one is told apart by its address", "name"))
        explicit = o.target.name != o.target.address
        if explicit and o.name.split("@")[0] != o.target.name:
            out.append(NodeWarning(o.name, f"listed as {o.target.name!r} but calls itself "
                                   f"{o.name!r}; rows carry {o.name!r}", "name"))
        if o.skew is None:
            why = o.skew_failure.text() if o.skew_failure else "no sample"
            out.append(NodeWarning(o.name, f"clock offset unknown ({why}); its timestamps "
                                   "are not corrected", "skew"))
        # Only an offset beyond the threshold even at the near end of its error bound:
        # a busy node answers late, and one slow sample must not raise a false alarm.
        elif abs(o.skew.offset_ms) - o.skew.error_ms > opts.skew_threshold_ms:
            done = ("timestamps corrected" if opts.correct
                    else "timestamps NOT corrected (--no-skew-correct)")
            out.append(NodeWarning(o.name, f"{o.skew.describe()}, above the "
                                   f"{opts.skew_threshold_ms:g} ms threshold; {done}", "skew"))
    return out
