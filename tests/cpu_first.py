"""A live test's own CPU: a cgroup whose processes get their CPU nearly to themselves
against whatever else runs there at normal priority (busy-node.sh's loops, other
sessions' tests), as on a quiet machine.

A test that measures what its own processes do to each other (a quota they share, a
hog that preempts the workload, the reclaim each step does) passes on a quiet machine
only, unless its processes come first on the CPU they are pinned to. Ten times the
default weight does that: against one busy loop at the default weight the cgroup gets
10/11 of the CPU, and what it leaves is what its own processes do not use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from recorder import scratch_cgroup

from fleetd.trace.host.cgroups import v2_root

CPU_V1 = Path("/sys/fs/cgroup/cpu")
# Ten times the default weight of each hierarchy (v1 cpu.shares 1024, v2 cpu.weight 100).
FIRST = {"v1": {"cpu.shares": "10240"}, "v2": {"cpu.weight": "1000"}}


def cpu_hierarchy() -> tuple[str, Path] | None:
    """Where this machine's cpu controller is: ("v1", its mount), or ("v2", the unified
    root) where that has the controller; None without one."""
    if (CPU_V1 / "cpu.shares").exists():
        return "v1", CPU_V1
    root = v2_root()
    if root is not None and "cpu" in (root / "cgroup.controllers").read_text().split():
        return "v2", root
    return None


@contextmanager
def first_on_cpu(setup: dict[str, str] | None = None) -> Iterator[Path]:
    """A scratch cgroup of :data:`FIRST` weight in the cpu hierarchy, with ``setup``'s
    files written too (a quota); an AssertionError without a cpu controller."""
    where = cpu_hierarchy()
    assert where is not None, ("no cpu controller: neither /sys/fs/cgroup/cpu (v1) nor cpu "
                               "in the unified hierarchy's cgroup.controllers (v2)")
    kind, root = where
    if kind == "v2":  # children of the root get the controller
        (root / "cgroup.subtree_control").write_text("+cpu")
    with scratch_cgroup(root, {**FIRST[kind], **(setup or {})}) as group:
        yield group
