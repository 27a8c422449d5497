"""The demo's nodes as a Kubernetes node runs pods: each in a CPU share of its own.

Each demo node's processes (its workload, its NCCL rank, and on the slow node the hog)
run in one cgroup per node: a cpuset (the CPUs it may use, as the kubelet's static CPU
manager gives a Guaranteed pod) and a CFS quota of as many CPUs (a pod's CPU limit).
The slow node gets a CPU of its own, the last one, so the hog there only takes from
that node, whatever else the machine runs; the other nodes and the agents share the
rest. On a 2-core machine that is CPU 1 for node-3 and CPU 0 for the others: a machine
busy on CPU 0 slows node-1 and node-2 a little, and node-3 stays the one the hog holds
back, with the hog its culprit.

Where the hierarchy has them: cgroup v2 (``cpuset.cpus``, ``cpu.max``, the controllers
enabled down to the slice), else v1's ``cpuset`` and ``cpu`` controllers. The CPUs are
also set with the affinity each process inherits, so a machine without a cpuset
controller keeps the placement.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from fleetd.errors import TraceError

PERIOD_US = 100_000  # the kernel's default CFS period, as Kubernetes uses it
CGROUP_FS = Path("/sys/fs/cgroup")


def placement(nodes: Sequence[str], slow: str) -> tuple[dict[str, list[int]], list[int]]:
    """(each node's CPUs, the agents' CPUs). The slow node gets the last CPU alone; with
    4 CPUs or more every node gets one of its own and the agents the rest, else the
    other nodes share the CPUs below it with the agents."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) == 1:
        return {n: cpus for n in nodes}, cpus
    rest = cpus[:-1]
    others = [n for n in nodes if n != slow]
    if len(cpus) > len(nodes):
        own = {n: [rest[-1 - i]] for i, n in enumerate(others)}
        agents = rest[: len(rest) - len(others)]
    else:
        own = {n: rest for n in others}
        agents = rest
    return {**own, slow: cpus[-1:]}, agents


@dataclass
class Slices:
    """One cgroup per node under ``fleetd-demo-<pid>`` in each hierarchy found."""

    cpus: dict[str, list[int]]
    agent_cpus: list[int]
    joined: dict[str, list[Path]] = field(default_factory=dict)  # node -> cgroup.procs
    made: list[Path] = field(default_factory=list)  # every cgroup made, parents first
    kinds: list[str] = field(default_factory=list)

    @staticmethod
    def create(nodes: Sequence[str], slow: str) -> Slices:
        cpus, agents = placement(nodes, slow)
        s = Slices(cpus, agents, {n: [] for n in nodes})
        try:
            s._make(nodes)
        except OSError as exc:
            s.remove()
            raise TraceError(f"could not make the demo's CPU slices: {exc}",
                             "the demo needs root and a writable cgroup cpu controller "
                             "(fleetd check says what this machine lacks)") from None
        return s

    def _make(self, nodes: Sequence[str]) -> None:
        v2 = _v2_controllers()
        for controller in ("cpuset", "cpu"):
            if controller in v2:
                root, ctl = CGROUP_FS, v2
            elif (CGROUP_FS / controller / "cgroup.procs").exists():
                root, ctl = CGROUP_FS / controller, set()
            else:
                continue
            parent = root / f"fleetd-demo-{os.getpid()}"
            self._mkdir(parent, controller if ctl else None)
            if controller == "cpuset":
                _cpuset(parent, sorted({c for cs in self.cpus.values() for c in cs}))
            for n in nodes:
                path = parent / n
                self._mkdir(path, controller if ctl else None)
                if controller == "cpuset":
                    _cpuset(path, self.cpus[n])
                else:
                    _quota(path, len(self.cpus[n]), v2=bool(ctl))
                self.joined[n].append(path / "cgroup.procs")
            self.kinds.append(f"{controller} ({'v2' if ctl else 'v1'})")
        if not self.kinds:
            raise OSError("no cgroup cpuset or cpu controller is mounted under "
                          f"{CGROUP_FS}")

    def _mkdir(self, path: Path, v2_controller: str | None) -> None:
        path.mkdir(exist_ok=True)
        self.made.append(path)
        if v2_controller:
            # A child gets the controller's files only when its parent hands it down.
            ctl = path.parent / "cgroup.subtree_control"
            if v2_controller not in ctl.read_text().split():
                ctl.write_text(f"+{v2_controller}\n")

    def enter(self, node: str, nice: int = 0) -> Callable[[], None]:
        """A preexec_fn: the child joins the node's cgroups and CPUs before it execs,
        so none of its instants runs outside them."""
        procs, cpus = list(self.joined[node]), set(self.cpus[node])

        def go() -> None:
            for p in procs:
                p.write_text(f"{os.getpid()}\n")
            os.sched_setaffinity(0, cpus)
            if nice:
                with suppress(OSError):
                    os.nice(nice)
        return go

    def label(self, node: str) -> str:
        return f"CPU {','.join(map(str, self.cpus[node]))}"

    def kind(self) -> str:
        return "cgroup " + " and ".join(self.kinds)

    def remove(self) -> None:
        """Remove the cgroups, children first (a cgroup is removable once its tasks
        have exited, which the kernel notes a moment after they are reaped)."""
        for path in reversed(self.made):
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def _v2_controllers() -> set[str]:
    controllers = CGROUP_FS / "cgroup.controllers"
    return set(controllers.read_text().split()) if controllers.exists() else set()


def _cpuset(path: Path, cpus: list[int]) -> None:
    (path / "cpuset.cpus").write_text(",".join(map(str, cpus)) + "\n")
    mems = path / "cpuset.mems"
    if mems.exists() and not mems.read_text().strip():  # v1: empty until set
        mems.write_text((path.parent / "cpuset.mems").read_text())


def _quota(path: Path, cpus: int, *, v2: bool) -> None:
    """A CPU limit of ``cpus`` CPUs: the pod's limit, equal to its cpuset."""
    quota_us = cpus * PERIOD_US
    if v2:
        (path / "cpu.max").write_text(f"{quota_us} {PERIOD_US}\n")
    else:
        (path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
        (path / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")


def pin(pid: int, cpus: Sequence[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (affinity is per thread; a process's later
    threads inherit it from the thread that creates them)."""
    with suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with suppress(OSError):
                os.sched_setaffinity(int(task.name), set(cpus))
