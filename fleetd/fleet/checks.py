"""``fleetd check --nodes``: can this machine reach every agent, over real mTLS?

Per node: one cold ``GET /api/v1/health`` (TCP connect, TLS 1.3 handshake with the
client certificate, the request), then the clock samples of ``/api/v1/time`` on the same
connection, whose best round trip is the network's. A node that fails gets the fleet
client's own failure class and hint, the same words ``fleetd query --nodes`` would use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import NotRequired, TypedDict

from fleetd.checks import FAIL, OK, WARN, Check, Finding, row
from fleetd.fleet import skew
from fleetd.fleet.client import FleetClient, clock_samples
from fleetd.fleet.fanout import FleetOptions
from fleetd.fleet.targets import Target
from fleetd.runner import run_loop
from fleetd.store.schema import SCHEMA_VERSION
from fleetd.wire import paths
from fleetd.wire.failure import NodeFailed

CLOCK_SAMPLES = 5  # /api/v1/time requests per node: the best round trip is the network's


class NodeFigures(TypedDict):
    """A node check's figures (``data`` in ``fleetd check --format json``): what its
    /health said of it, as it said it (shown, never computed with), and the timings."""

    address: str
    node: object
    version: object
    schema_version: object
    connect_ms: float
    rtt_ms: NotRequired[float]
    offset_ms: NotRequired[float]
    error_ms: NotRequired[float]


def node_checks(opts: FleetOptions) -> list[Check]:
    """One check per target, in the order given."""
    found: list[Check] = run_loop(_all(opts))
    return found


async def _all(opts: FleetOptions) -> list[Check]:
    # No retries: a check reports what it saw, at once; the fleet commands retry.
    client_opts = dataclasses.replace(opts.client, retries=0)
    async with FleetClient(client_opts) as client:
        return list(await asyncio.gather(
            *(_one(client, t, opts.skew_threshold_ms) for t in opts.targets)))


async def _one(client: FleetClient, target: Target, threshold_ms: float) -> Check:
    name = f"node {target.name}"
    started = time.perf_counter()
    try:
        health = await client.get(target, paths.HEALTH)
    except NodeFailed as exc:
        f = exc.failure
        return Check(name, FAIL, f"{target.address}: {f.kind}: {f.message}",
                     f.hint or "see the agent's log", group="nodes",
                     data={"address": target.address, "failure": f.kind})
    connect_ms = (time.perf_counter() - started) * 1e3
    with clock_samples() as clock:  # the answers' stamps, on the now open connection
        await skew.sample(client, target, CLOCK_SAMPLES)
    est = skew.estimate([skew.Sample(*s) for s in clock.stamps])
    return _judge(name, target, health, connect_ms, est, threshold_ms)


def _judge(name: str, target: Target, health: dict[str, object], connect_ms: float,
           est: skew.Skew | None, threshold_ms: float) -> Check:
    """``health``: the node's answer as parsed (unchecked: each value is only shown)."""
    data: NodeFigures = {
        "address": target.address, "node": health.get("node"),
        "version": health.get("version"), "schema_version": health.get("schema_version"),
        "connect_ms": round(connect_ms, 3),
    }
    tracing = "tracing" if health.get("tracing") else "not tracing"
    parts = [f"{health.get('node')} (fleetd {health.get('version')}, schema "
             f"{health.get('schema_version')}, {tracing})", f"connect+TLS+GET {connect_ms:.1f} ms"]
    findings = [_schema(health.get("schema_version"))]
    if est is None:
        findings.append(Finding(WARN, f"its clock could not be sampled (GET {paths.TIME} "
                                "failed)", "see the agent's log"))
    else:
        data["rtt_ms"] = round(2 * est.error_ms, 3)
        data["offset_ms"] = round(est.offset_ms, 3)
        data["error_ms"] = round(est.error_ms, 3)
        parts.append(f"round trip {2 * est.error_ms:.2f} ms, clock {est.offset_ms:+.2f} ms "
                     f"(+/- {est.error_ms:.2f})")
        findings.append(_clock(est, threshold_ms))
    return row(name, "nodes", target.address, findings, ", ".join(parts), data,
               always_summary=True)


def _schema(version: object) -> Finding:
    if isinstance(version, int) and version > SCHEMA_VERSION:
        return Finding(WARN, f"its database schema v{version} is newer than this fleetd's "
                       f"v{SCHEMA_VERSION}", "upgrade fleetd on this machine")
    return Finding(OK, "")


def _clock(est: skew.Skew, threshold_ms: float) -> Finding:
    # Beyond the threshold even at the near end of the error bound, as the fleet
    # commands judge it (docs/fleet.md).
    if abs(est.offset_ms) - est.error_ms <= threshold_ms:
        return Finding(OK, "")
    return Finding(WARN, f"its {est.describe()}, beyond {threshold_ms:g} ms",
                   "run an NTP/PTP client (chrony) on both machines; fleet commands correct "
                   "the offset, but files copied off and merged are only aligned roughly")
