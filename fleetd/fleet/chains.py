"""The top causal chain of a process, asked of its node (``GET /api/v1/chains``): what
``fleetd watch`` names as the cause of a hang's culprit (:mod:`fleetd.fleet.hang`) and of
a straggling rank (:mod:`fleetd.fleet.straggle`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from fleetd.fleet.client import FleetClient
from fleetd.fleet.fanout import FleetAnswer
from fleetd.wire import paths
from fleetd.wire.chains import check_chains_reply
from fleetd.wire.failure import BadReply, NodeFailed
from fleetd.wire.ranks import TopChain, top_chain
from fleetd.wire.shapes import ChainsReply

log = logging.getLogger("fleetd.fleet.chains")

CHAIN_TIMEOUT_S = 5.0


async def chains_of(answer: FleetAnswer, client: FleetClient,
                    wanted: Sequence[tuple[str, int]], since: str
                    ) -> dict[tuple[str, int], TopChain | None]:
    """The top causal chain of each (node, pid) over ``since``, asked of its node at once
    (best effort: one that cannot say within CHAIN_TIMEOUT_S is left out). """
    asks = {(n, p): ChainsAsk(n, p, (("since", since),)) for n, p in wanted}
    got = await chains_answers(answer, client, list(asks.values()), top_n=1)
    return {k: top_chain(got[a]) for k, a in asks.items() if a in got}


@dataclass(frozen=True, slots=True)
class ChainsAsk:
    """The chains of one process over one window: ``window`` the query's window
    parameters (``since``, or ``from``/``to`` in ns by the node's clock)."""

    node: str
    pid: int
    window: tuple[tuple[str, str], ...]


async def chains_answers(answer: FleetAnswer, client: FleetClient,
                         asks: Sequence[ChainsAsk], top_n: int | None = None,
                         timeout_s: float = CHAIN_TIMEOUT_S
                         ) -> dict[ChainsAsk, ChainsReply]:
    """Each ask's ``/api/v1/chains`` answer, checked by its reader, asked of the nodes
    at once, one ask at a time per node in the order given (an agent holds one large
    answer per client at a time: a second at once is refused, HTTP 429); one that cannot
    say within ``timeout_s`` (and the client's deadline), or says it in a broken shape,
    is left out (logged): a cause is named without it, or at the next ask."""
    targets = {o.name: o.target for o in answer.answered}
    found: dict[ChainsAsk, ChainsReply] = {}

    async def one(ask: ChainsAsk) -> None:
        target = targets.get(ask.node)
        if target is None:
            return
        params = {**dict(ask.window), "pid": str(ask.pid)}
        if top_n is not None:
            params["top_n"] = str(top_n)
        try:
            async with asyncio.timeout(timeout_s):
                found[ask] = check_chains_reply(await client.get(target, paths.CHAINS,
                                                                 params))
        except (NodeFailed, TimeoutError, BadReply) as exc:
            log.info("no chains for %s pid %d: %s", ask.node, ask.pid, exc)

    async def node(mine: list[ChainsAsk]) -> None:
        for ask in mine:
            await one(ask)

    by_node: dict[str, list[ChainsAsk]] = {}
    for a in dict.fromkeys(asks):
        by_node.setdefault(a.node, []).append(a)
    client.restart_deadline()
    await asyncio.gather(*(node(mine) for mine in by_node.values()))
    return found
