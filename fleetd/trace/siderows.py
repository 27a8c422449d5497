"""Rows the tracer makes in user space rather than receiving through a ring: samples
of the targets' cgroups (CPU-quota throttling, memory limits), the kernel work they
queued over each aggregate window (read from its map), and the reclaim stall runs
left in their map at stop.

They are counted (``made``) beside the records the kernel emitted, so that what was
made equals what was written plus what was lost (:mod:`fleetd.trace.accounting`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetd.store.catalog import op_code
from fleetd.store.writer import BatchWriter
from fleetd.trace.host import procinfo
from fleetd.trace.host.cgroups import ThrottleSampler
from fleetd.trace.host.memory import KernelWork, MemorySampler, leftover_runs

# A row and its args, as the samplers make them.
SideRow = tuple[tuple[int, ...], dict[str, object]]


class SideRows:
    def __init__(self, ksym: Callable[[int], bytes]) -> None:
        self.made = 0
        self._throttle = ThrottleSampler(op_code("cpu_throttle"), procinfo.environ)
        self._memory = MemorySampler(op_code("mem_cgroup"), procinfo.environ)
        self._kwork = KernelWork(op_code("kwork_queued"), ksym)

    def sample_cgroups(self, writer: BatchWriter, live: list[int], now_ns: int) -> None:
        """CPU-quota throttling and memory limits of the targets' cgroups since the
        last sample."""
        self._add(writer, self._throttle.sample(live, now_ns)
                  + self._memory.sample(live, now_ns))

    def kernel_work(self, writer: BatchWriter, bpf: Any, start_wall: int,
                    end_wall: int) -> None:
        """Kernel work the targets queued over the histograms' window (FL_KWORK)."""
        try:
            table = bpf[b"fl_kwork"]
        except KeyError:  # not compiled in: no mem part, or no such tracepoint
            return
        self._add(writer, self._kwork.rows(table, start_wall, end_wall))

    def reclaim_leftovers(self, writer: BatchWriter, bpf: Any,
                          to_wall: Callable[[int], int]) -> None:
        """The reclaim stall runs the kernel had not sent yet (it sends a run once it
        spans 10 ms): read from its map once the BPF side is frozen."""
        try:
            table = bpf[b"fl_reclaim"]
        except KeyError:  # no reclaim tracepoints compiled in
            return
        rows = leftover_runs(table, to_wall)
        if rows:
            self.made += len(rows)
            writer.add_events(rows)  # type: ignore[arg-type]

    def _add(self, writer: BatchWriter, found: list[SideRow]) -> None:
        """Rows with their args: written, and counted as made."""
        if found:
            self.made += len(found)
            # The samplers' rows are plain int tuples of the event row's length.
            writer.add_events([row for row, _ in found],  # type: ignore[misc]
                              [(i, args) for i, (_, args) in enumerate(found)])
