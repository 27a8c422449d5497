"""What the agent says of its own parts in ``GET /api/v1/health`` (docs/api.md) and on
/metrics: the tracer's figures and the store's.

The tracer fills :class:`TraceStats` (:mod:`fleetd.trace.agent_hook`) and the agent
serves it (:mod:`fleetd.node`); neither may import the other, so the shape both name
lives here, below both, beside the store's own part.
"""

from __future__ import annotations

from typing import TypedDict

from fleetd.store.losses import CrashReport


class TracerCounts(TypedDict):
    """What a running tracer counts (``Tracer.status``)."""

    records: int  # decoded from the ring buffers
    lost: int  # events lost, counted (fleetd.trace.accounting.LOST_KEYS)
    targets: int  # processes traced now
    probes: int  # uprobes attached
    libraries: int


class TraceStats(TypedDict, total=False):
    """``trace`` in the health answer: a running tracer's counts, its event rate,
    whether its thread runs and why it stopped; a tracer that never started has only
    the last four."""

    records: int
    lost: int
    targets: int
    probes: int
    libraries: int
    events_per_s: float
    running: bool
    error: str | None


class StoreStatus(TypedDict):
    """``store`` in the health answer while the agent writes."""

    disk_full: bool  # writes fail for lack of space now
    disk_full_dropped: int  # events dropped because the disk was full, since the start
    failed_writes: int  # events lost to any failed write (disk full included)
    pruned_events: int  # oldest events deleted to keep store.max_bytes (or a full disk)
    crashed_sessions: list[CrashReport]  # sessions found killed at this start


class NodeStatus(TypedDict, total=False):
    """What the health answer adds while the agent traces into its store."""

    trace: TraceStats
    store: StoreStatus
