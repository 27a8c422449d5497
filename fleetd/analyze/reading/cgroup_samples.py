"""The tracer's per-cgroup samples, read back in one place.

The tracer samples each cgroup the traced processes run in (``cpu_throttle``: its CPU
quota and ``cpu.stat``; ``mem_cgroup``: its memory limit, usage and pressure) as rows of
``event_data``, the details in ``event_args``: the cgroup's path, the pids it held and
where it runs (container, pod). The ``cpu_throttled`` and ``memory_reclaim`` analyzers
(fleetd.analyze.causes.throttle, fleetd.analyze.causes.memory) sum them per cgroup; the query and
the
fields every sample carries are read here, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from fleetd.analyze.reading.data import args_object
from fleetd.analyze.reading.nodeview import NodeView
from fleetd.analyze.reading.rows import CgroupPlace, CgroupPlaceKey
from fleetd.store.sparse import sparse_only

# The args keys that say where a cgroup runs (fleetd.analyze.reading.pods.where shows them).
PLACE_KEYS: tuple[CgroupPlaceKey, ...] = ("container", "container_name", "runtime", "pod",
                                          "namespace", "pod_uid")

# A sample's event_data columns, and its args: JSON from the file (a merged or imported
# one is untrusted), an object of unchecked values that its reader checks key by key.
Sample = tuple[tuple[Any, ...], dict[str, object]]


def samples(view: NodeView, op: int, columns: tuple[str, ...], *, by_time: bool = False,
            reach_ns: int = 0) -> Iterator[Sample]:
    """Each ``op`` sample in the view's window: its event_data ``columns`` and its args
    object ({} when it has none). ``by_time``: oldest first, for a caller that keeps a
    sample's latest value; otherwise in the order SQLite returns them. ``reach_ns``: also
    the samples that began up to that long before the window and end inside it (an
    interval sample whose time the caller clips to the window)."""
    order = " ORDER BY e.ts_ns" if by_time else ""
    picked = ", ".join(f"e.{c}" for c in columns)
    start = view.win.start_ns
    for row in view.conn.execute(
            f"SELECT {picked}, x.args FROM event_data e LEFT JOIN "
            "event_args x ON x.id = e.id WHERE e.op = ? AND e.ts_ns >= ? AND e.ts_ns < ? "
            f"AND e.id BETWEEN ? AND ? AND (e.ts_ns >= ? OR e.ts_ns + e.dur_ns > ?)"
            f"{sparse_only((op,))}{order}",
            (op, start - reach_ns, view.win.end_ns, view.node.lo, view.node.hi, start, start)):
        yield tuple(row[:-1]), args_object(row[-1])


def sampled_pids(pid: int, args: Mapping[str, object]) -> list[int]:
    """The sampled process and every pid the sample lists as in its cgroup."""
    listed = args.get("pids")
    return [int(pid), *(p for p in (listed if isinstance(listed, list) else [])
                        if isinstance(p, int))]


def place_of(args: Mapping[str, object]) -> CgroupPlace:
    """Where the sampled cgroup runs (container, pod, namespace), as far as it says."""
    out: CgroupPlace = {}
    for k in PLACE_KEYS:
        v = args.get(k)
        if isinstance(v, str):
            out[k] = v
    return out
