"""Ask every node at once and collect an answer made of the nodes that answered.

Per node, one task: clock samples (``/api/v1/time``) run beside the node's requests, so
skew estimation adds no latency; only a request that must be expressed in the node's
own clock (an absolute time window) waits for the offset first. Every task lives under
the client's deadline, so a node that hangs (SIGSTOP, a dead link) costs at most the
timeout and becomes a warning, never a delay of the whole answer beyond it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetd.fleet import skew as skewmod
from fleetd.fleet.client import (
    INT64_MAX,
    INT64_MIN,
    NAME_CHARS,
    ClientOptions,
    Failure,
    FleetClient,
    NodeFailed,
    printable,
)
from fleetd.fleet.combine import NodeWarning
from fleetd.fleet.skew import Skew
from fleetd.fleet.targets import Target

log = logging.getLogger("fleetd.fleet.fanout")

EXIT_COMPLETE = 0
EXIT_PARTIAL = 3  # some nodes answered, the others are listed in the warnings
EXIT_NO_ANSWER = 4  # no node answered


@dataclass(frozen=True, slots=True)
class FleetOptions:
    targets: tuple[Target, ...]
    client: ClientOptions
    skew_samples: int = skewmod.SAMPLES  # 0: do not estimate skew
    correct: bool = True  # shift node timestamps into our clock
    skew_threshold_ms: float = 10.0


@dataclass(frozen=True, slots=True)
class Request:
    method: str  # GET | POST
    path: str
    params: dict[str, str] | None = None
    body: dict[str, Any] | None = None
    expect: tuple[str, ...] = ()  # keys the answer must have
    # Checks (and may trim) the answer, raising NodeFailed for one that is not usable;
    # without one, every number in it must be one JSON tools can carry.
    check: Callable[[dict[str, Any]], None] | None = None


# offset (node clock minus ours, ns; 0 when unknown or not corrected) -> the requests
Plan = Callable[[int], Sequence[Request]]
# (client, node, offset) -> the node's replies: what a plan's requests would give, for
# work that is more than one round of requests (a request that depends on another's
# answer, a streamed body)
NodeWork = Callable[[FleetClient, Target, int], Awaitable[list[dict[str, Any]]]]


@dataclass(slots=True)
class NodeOutcome:
    target: Target
    name: str
    replies: list[dict[str, Any]] | None = None
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


async def fan_out(opts: FleetOptions, plan: Plan, *, needs_offset: bool = False,
                  client: FleetClient | None = None) -> FleetAnswer:
    """Run ``plan`` on every node; ``needs_offset``: the plan uses the node's offset.

    Without ``client`` a new session is made and closed (what one CLI command does);
    a long-running caller passes its own open client to keep connections warm.
    """
    async def work(c: FleetClient, t: Target, offset: int) -> list[dict[str, Any]]:
        return await send_all(c, t, plan(offset))

    return await fan_out_work(opts, work, needs_offset=needs_offset, client=client)


async def fan_out_work(opts: FleetOptions, work: NodeWork, *, needs_offset: bool = False,
                       client: FleetClient | None = None) -> FleetAnswer:
    """:func:`fan_out` with a coroutine per node instead of a list of requests; it runs
    under the same deadline, clock sampling, naming and failure handling."""
    if client is None:
        async with FleetClient(opts.client) as own:
            return await fan_out_work(opts, work, needs_offset=needs_offset, client=own)
    started = time.perf_counter()
    client.restart_deadline()
    outcomes = await asyncio.gather(
        *(_node(client, opts, t, work, needs_offset and opts.correct) for t in opts.targets))
    answer = FleetAnswer(list(outcomes), correct=opts.correct)
    _name_nodes(answer)
    answer.warnings = _warnings(answer, opts)
    answer.elapsed_s = time.perf_counter() - started
    log.info("fan-out to %d node(s): %d answered in %.3f s", len(outcomes),
             len(answer.answered), answer.elapsed_s)
    return answer


async def _node(client: FleetClient, opts: FleetOptions, t: Target, work: NodeWork,
                offset_first: bool) -> NodeOutcome:
    out = NodeOutcome(t, t.name)
    sampler = (asyncio.create_task(skewmod.sample(client, t, opts.skew_samples))
               if opts.skew_samples else None)
    try:
        async with asyncio.timeout_at(client.deadline):
            offset = 0
            if offset_first and sampler is not None:
                _take_samples(out, await sampler)
                offset = out.correction_ns
            out.replies = await work(client, t, offset)
    except NodeFailed as exc:
        out.failure = exc.failure
    except TimeoutError:
        out.failure = Failure(
            "timeout", f"no answer from {t.address} within the {client.opts.timeout_s:g} s "
            "timeout", "is the agent hung or overloaded? raise --timeout if it is just slow")
    if sampler is None or out.failure is not None or offset_first:
        if sampler is not None and not sampler.done():
            sampler.cancel()
        return out
    try:
        # The node answered; its samples are normally done by now.
        async with asyncio.timeout_at(client.deadline):
            _take_samples(out, await sampler)
    except TimeoutError:
        out.skew_failure = Failure("timeout", "clock samples did not finish in time")
    return out


def _take_samples(out: NodeOutcome,
                  got: tuple[list[skewmod.Sample], str | None, Failure | None]) -> None:
    samples, name, failure = got
    out.skew = skewmod.estimate(samples)
    if name:
        out.name = name
    if out.skew is None:
        out.skew_failure = failure or Failure("skew", "no clock sample")


async def send_all(client: FleetClient, t: Target, requests: Sequence[Request]
                   ) -> list[dict[str, Any]]:
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


async def _send(client: FleetClient, t: Target, r: Request) -> dict[str, Any]:
    if r.method == "POST":
        reply = await client.post(t, r.path, r.body or {})
    else:
        reply = await client.get(t, r.path, r.params)
    missing = [k for k in r.expect if k not in reply]
    if missing:
        raise NodeFailed(Failure("bad_json", f"{t.address}{r.path} answered without "
                                 f"{', '.join(missing)}",
                                 "is the agent a different fleetd version? compare "
                                 "/api/v1/health versions"))
    if r.check is not None:
        r.check(reply)
    else:
        check_numbers(reply, f"{t.address}{r.path}")
    return reply


def bad_value(where: str, what: str) -> NodeFailed:
    return NodeFailed(Failure("bad_json", f"{where} answered {what}",
                              "is this a fleetd agent, and an unmodified one?"))


def check_numbers(obj: Any, where: str) -> None:
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


def _warnings(answer: FleetAnswer, opts: FleetOptions) -> list[NodeWarning]:
    out = []
    for o in answer.outcomes:
        if o.failure is not None:
            out.append(NodeWarning(o.name, o.failure.text(), o.failure.kind))
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
