"""The top causal chain of a process, asked of its node (``GET /api/v1/chains``): what
``fleetd watch`` names as the cause of a hang's culprit (:mod:`fleetd.fleet.hang`) and of
a straggling rank (:mod:`fleetd.fleet.straggle`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from fleetd.fleet.client import FleetClient
from fleetd.fleet.fanout import FleetAnswer
from fleetd.wire import paths
from fleetd.wire.failure import NodeFailed
from fleetd.wire.ranks import TopChain, top_chain

log = logging.getLogger("fleetd.fleet.chains")

CHAIN_TIMEOUT_S = 5.0


async def chains_of(answer: FleetAnswer, client: FleetClient,
                    wanted: Sequence[tuple[str, int]], since: str
                    ) -> dict[tuple[str, int], TopChain | None]:
    """The top causal chain of each (node, pid) over ``since``, asked of its node at once
    (best effort: one that cannot say within CHAIN_TIMEOUT_S is left out). """
    targets = {o.name: o.target for o in answer.answered}
    found: dict[tuple[str, int], TopChain | None] = {}

    async def one(node: str, pid: int) -> None:
        target = targets.get(node)
        if target is None:
            return
        try:
            async with asyncio.timeout(CHAIN_TIMEOUT_S):
                reply = await client.get(target, paths.CHAINS,
                                         {"since": since, "pid": str(pid), "top_n": "1"})
        except (NodeFailed, TimeoutError) as exc:
            log.info("no chain for %s pid %d: %s", node, pid, exc)
            return
        found[(node, pid)] = top_chain(reply)

    client.restart_deadline()
    await asyncio.gather(*(one(n, p) for n, p in wanted))
    return found
