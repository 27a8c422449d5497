"""The fan-out's entry: every node asked directly, or through peer relays.

:mod:`fleetd.fleet.fanout` asks nodes directly; :mod:`fleetd.fleet.relayed` asks relays
that ask their share of the nodes. Both give the same answer shape, so every operation
asks here and never needs to know which way its request went.
"""

from __future__ import annotations

from fleetd.fleet.client import FleetClient
from fleetd.fleet.fanout import FleetAnswer, FleetOptions, Plan, fan_out_work, plan_work
from fleetd.fleet.relayed import fan_out_relayed


async def fan_out(opts: FleetOptions, plan: Plan, *, needs_offset: bool = False,
                  client: FleetClient | None = None) -> FleetAnswer:
    """Run ``plan`` on every node; ``needs_offset``: the plan uses the node's offset.

    Without ``client`` a new session is made and closed (what one CLI command does);
    a long-running caller passes its own open client to keep connections warm.
    """
    if opts.relays:
        return await fan_out_relayed(opts, plan, needs_offset=needs_offset, client=client)
    return await fan_out_work(opts, plan_work(plan), needs_offset=needs_offset, client=client)
