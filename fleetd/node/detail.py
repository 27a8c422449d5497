"""Launch detail on demand, for the always-on mode (``--mode always-on``, #36).

Always-on keeps the launch probes on 1 s in 10; when detail matters, a window opens at
once and stays open for a while:

- the agent's own rule: while a local NCCL rank has waited in a collective for
  :data:`WAIT_NS` or more (the start of a hang, or a straggler's peers waiting for it),
  every :data:`CHECK_S` the window is held open another :data:`HOLD_S`, so the launches
  around the wait are traced whole;
- on request: ``POST /api/v1/detail?seconds=N`` (1 to :data:`MAX_S`), for a client such
  as ``fleetd watch`` or an operator who is about to look.

In full mode the launch probes are always on and both are no-ops (``opened`` is false
and says why).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypedDict

from aiohttp import web

from fleetd.errors import QueryError
from fleetd.node.api import STATE, json_response
from fleetd.node.ranks import RANKBOOK, local_waits
from fleetd.wire import paths

log = logging.getLogger("fleetd.node.detail")

WAIT_NS = 1_000_000_000  # a rank waiting this long in a collective opens a window
CHECK_S = 1.0
HOLD_S = 10.0  # each check that still sees the wait holds the window this much longer
MAX_S = 60  # the longest window a request may open


class Detailed(Protocol):
    """The tracer side (fleetd.trace.agent_hook.AgentTracer.ask_detail): True when a
    window was asked for, False when launches are traced all the time anyway."""

    def ask_detail(self, seconds: float) -> bool: ...


class DetailReply(TypedDict):
    node: str
    opened: bool
    seconds: int
    why: str


DETAIL_TRACER = web.AppKey("detail_tracer", Detailed)


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
    tracer = request.app.get(DETAIL_TRACER)
    if tracer is None:
        reply = DetailReply(node=st.node, opened=False, seconds=seconds,
                            why="this agent does not trace (started without a tracer)")
    elif tracer.ask_detail(seconds):
        reply = DetailReply(node=st.node, opened=True, seconds=seconds,
                            why="launch probes on for the window (--mode always-on)")
    else:
        reply = DetailReply(node=st.node, opened=False, seconds=seconds,
                            why="launch probes are on all the time (--mode full)")
    return json_response(reply)


async def watch_waits(tracer: Detailed, waited: Callable[[], int]) -> None:
    """Until cancelled: hold a window open while ``waited()`` (the longest local
    collective wait, ns) has reached :data:`WAIT_NS`; ends at the first ask a tracer
    without a duty cycle refuses."""
    opened = False
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(CHECK_S)
        # Off the loop: each rank's state is a /proc read (up to 512 ranks).
        longest = await loop.run_in_executor(None, waited)
        if longest < WAIT_NS:
            opened = False
        elif not tracer.ask_detail(HOLD_S):
            return  # launches are traced all the time (--mode full): nothing to hold
        elif not opened:
            log.info("a rank has waited %.1f s in a collective: launch detail on",
                     longest / 1e9)
            opened = True


def longest_wait(app: web.Application, node: str) -> Callable[[], int]:
    """The longest wait of any local rank group, ns (0: none waits)."""
    measure = local_waits(app[RANKBOOK], node)
    return lambda: max((ns for _, _, ns in measure()), default=0)


ROUTES = [web.post(paths.DETAIL, detail)]
