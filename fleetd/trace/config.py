"""What a trace session is asked to do (:class:`TraceConfig`) and what it did
(:class:`TraceSummary`).

Apart from :mod:`fleetd.trace.tracer`, so that the tracer's parts (targets, rings, side
rows) read the configuration without importing the tracer back; the tracer re-exports
both, which is where callers import them from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetd.store.writer import WriterStats
from fleetd.trace.bpf.bpfsrc import HOST_PARTS
from fleetd.trace.bpf.modes import LAUNCH_RETURNS
from fleetd.trace.enrich.oncpu import DEFAULT_HZ

GPU_LAYERS = ("cuda", "driver", "nccl")


@dataclass
class TraceConfig:
    db: Path
    node: str
    pids: list[int] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    cuda_libs: list[str] = field(default_factory=list)
    layers: frozenset[str] = frozenset((*GPU_LAYERS, "host"))
    host_parts: frozenset[str] = frozenset(HOST_PARTS)
    sample: int = 100
    slow_k: int = 8
    slow_min_ns: int = 20_000
    err_burst: int = 10
    stacks: bool = False
    stack_sample: int = 100  # with stacks: 1 in N kept calls carries one ...
    stack_slow_ns: int = 1_000_000  # ... and every call at least this long
    # ... and the waker's on a wakeup by a followed Python thread, at most once per
    # (waker, woken) thread pair per this many ns (None: never)
    wake_stack_ns: int | None = 20_000_000
    ring_pages: int = 256
    thresholds_ns: dict[str, int] = field(default_factory=lambda: {
        "offcpu": 50_000, "runq": 50_000, "irq": 20_000, "syscall": 1_000_000,
        "block": 10_000_000,
    })
    agg_interval_ns: int = 10_000_000_000
    max_db_bytes: int | None = None
    command: str | None = None
    follow_children: bool = True
    cpu_sample_hz: int = DEFAULT_HZ  # on-CPU samples per second per CPU; 0: off
    # False: launch-type calls traced at entry, their returns sampled (fleetd.trace.bpf.modes)
    launch_returns: bool = LAUNCH_RETURNS
    # "always-on": launch probes only duty_on_ns of every aggregate window (dutycycle.py)
    mode: str = "full"
    duty_on_ns: int = 1_000_000_000

    @property
    def system_wide(self) -> bool:
        return not self.pids and not self.cgroups


@dataclass
class TraceSummary:
    session: int
    records: int
    events_written: int
    lost: dict[str, int]
    lost_total: int
    sampled_out: int
    emitted_by_kernel: int  # with the rows made in user space (below)
    made_in_user_space: int  # on-CPU sample counts, cgroup samples, map reads: no ring
    unreported_loss: int
    duration_s: float
    targets: list[int]
    libraries: list[str]
    probes: int
    headers_route: str
    writer: WriterStats
    # The mapping hook over the session (fleetd.trace.bpf.mapwatch.MappingJSON): holds, and
    # every window in which calls could have been missed.
    mapping: dict[str, Any] = field(default_factory=dict)
