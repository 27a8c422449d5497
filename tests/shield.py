"""A scenario's own processes first: while a block runs, every other process on the
machine yields the CPU to them at once.

A live test or bench scenario measures who delayed its victim. On a busy machine the
answer is honestly "whoever else was running there" (another session's tests, a soak,
``busy-node.sh``'s loops): real contention the scenario did not inject. Pinning the
victim to a CPU of its own is not enough, since anything unpinned or pinned there too
still runs on it.

What a cgroup v2 cpuset partition would do (take the CPU away from everyone else) is not
available where the cpuset controller is bound to cgroup v1, and v1's equivalent (moving
every other process into a cpuset without the victim's CPU) makes their
``sched_setaffinity`` to that CPU fail with EINVAL, breaking whatever else the machine
is running. So this moves the other processes into one cgroup with ``cpu.idle`` set
(the cpu controller, v1 or v2; Linux 5.15+) instead: a task there is preempted the
moment a normal task wakes on its CPU (no slice protection, weight 3 against 1024), so
it no longer delays the scenario's processes, and it still runs on every CPU they leave
idle. Nothing stops, no affinity changes.

Who moves: every process in the root cgroup that was there when the block began, and
any started during it by someone else (swept again every 0.05 s), except kernel threads,
init and its direct children (the machine's own services), and the caller with its
ancestors. Processes the caller starts inside the block are the scenario's and stay
normal; its children from before (a bench's noise) are other load and yield too. Others
that run in cgroups of their own (another session's CPU slices, pinned to the same CPU)
stay in them, limits and accounting untouched: each such top-level cgroup gets
``cpu.idle`` itself for the block (not one holding the caller's processes, nor an empty
one), and its old value back after. On the
way out (an exception and Ctrl-C included) every process goes back to the root cgroup
(the kernel puts a root task back in its autogroup) and the cgroup is removed; one left
by a killed run is dissolved by the next run's start. Two shielded blocks on one machine
(two benches, a bench and a live test) would each put the other's processes at idle
priority: they take turns instead (a lock file, waited for up to ``WAIT_S``).
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "fleetd-shield-"
SWEEP_S = 0.05  # a process another session starts is at its normal priority until then
WAIT_S = 300.0  # for another shielded block to end
LOCK = Path("/run/lock/fleetd-shield.lock")
IDLED = "fleetd-shield-{}.idled"  # beside LOCK: the cgroups a run set idle, to undo
_KTHREAD = 0x00200000  # PF_KTHREAD in /proc/PID/stat's flags


@dataclass
class Shield:
    """What a block ran under: the idle cgroup the others were moved into (None: no
    shield, ``why`` says why) and how many processes were moved."""

    group: Path | None
    why: str = ""
    moved: set[int] = field(default_factory=set)
    idled: list[Path] = field(default_factory=list)  # others' cgroups set idle

    def describe(self) -> str:
        if self.group is None:
            return f"no shield ({self.why})"
        return (f"{len(self.moved)} other processes (into {self.group}) and "
                f"{len(self.idled)} other cgroups yield the CPU (cpu.idle)")


def cpu_root() -> Path | None:
    """The cpu controller's root cgroup where it has ``cpu.idle``: v1's mount, else the
    cgroup2 mount with the cpu controller."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.shares").exists():
        return v1
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            ctl = Path(parts[1]) / "cgroup.controllers"
            if ctl.exists() and "cpu" in ctl.read_text().split():
                return Path(parts[1])
    return None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, flags) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command, which may hold spaces
    return int(fields[1]), int(fields[6])


def _lineage(pid: int) -> list[int]:
    """pid and its ancestors up to init."""
    out = []
    while pid > 0 and pid not in out:
        out.append(pid)
        st = _stat(pid)
        if st is None:
            break
        pid = st[0]
    return out


class _Mover:
    """Moves the others from ``root`` into ``group`` and sets others' cgroups idle; the
    caller's processes from before the block (``before``) count as others."""

    def __init__(self, root: Path, group: Path) -> None:
        self.root, self.group = root, group
        self.me = os.getpid()
        self.keep = set(_lineage(self.me))  # the caller and its ancestors
        self.before = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
        self.moved: set[int] = set()
        self.passed: set[int] = set()  # judged to stay: not asked again
        self.idled: list[Path] = []  # others' cgroups set idle, to undo
        self.own: set[Path] = set()  # cgroups holding the caller's processes
        self.record = LOCK.parent / IDLED.format(self.me)

    def _root_pids(self) -> list[int]:
        return [int(p) for p in (self.root / "cgroup.procs").read_text().split()]

    def _stays(self, pid: int) -> bool:
        st = _stat(pid)
        if st is None or pid in self.keep or st[1] & _KTHREAD:
            return True
        if pid == 1 or st[0] == 1:
            return True  # init and the machine's services
        return self._mine(pid)

    def _mine(self, pid: int) -> bool:
        """Started during the block by the caller: one of the scenario's processes."""
        return pid not in self.before and self.me in _lineage(pid)[1:]

    def _idle_groups(self) -> None:
        for d in self.root.iterdir():
            if (not d.is_dir() or d.name.startswith(PREFIX) or d in self.own
                    or d in self.idled or not (d / "cpu.idle").exists()):
                continue
            pids = [int(p) for f in d.rglob("cgroup.procs") for p in f.read_text().split()]
            if any(self._mine(p) for p in pids):
                self.own.add(d)
            elif pids and (d / "cpu.idle").read_text().strip() == "0":
                # Written down before it is set, so a killed run's is undone too.
                self.record.write_text("".join(f"{p}\n" for p in [*self.idled, d]))
                (d / "cpu.idle").write_text("1\n")
                self.idled.append(d)

    def undo(self) -> None:
        _unidle(self.idled)
        self.record.unlink(missing_ok=True)

    def sweep(self) -> None:
        with suppress(OSError):  # a cgroup removed meanwhile: the next sweep sees
            self._idle_groups()
        for pid in self._root_pids():
            if pid in self.moved or pid in self.passed:
                continue
            if self._stays(pid):
                self.passed.add(pid)
                continue
            # Gone meanwhile, or not movable (a realtime task into a group without RT
            # time): it stays where it is.
            with suppress(OSError):
                (self.group / "cgroup.procs").write_text(f"{pid}\n")
                self.moved.add(pid)


def _dissolve(root: Path, group: Path) -> None:
    """Every process of ``group`` back to ``root``, then the cgroup removed (retried
    while the processes that a move raced with settle). A process that exited and is
    not reaped yet can neither move nor run: the cgroup then stays, empty of anything
    that runs, until the next shield of this machine removes it."""
    left: list[str] = []
    for _ in range(50):
        left = (group / "cgroup.procs").read_text().split()
        for pid in left:
            with suppress(OSError):
                (root / "cgroup.procs").write_text(f"{pid}\n")
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    time.sleep(0.5)  # one that was exiting is gone by now
    alive = [p for p in (group / "cgroup.procs").read_text().split()
             if (_state(int(p)) or "Z") not in "ZX"]
    if alive:
        print(f"shield: processes {', '.join(alive)} could not leave {group} (still at idle "
              f"priority): move them to {root / 'cgroup.procs'}", file=sys.stderr)


def _state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2]


def _unidle(groups: list[Path]) -> None:
    for d in groups:
        with suppress(OSError):  # removed by its owner meanwhile
            (d / "cpu.idle").write_text("0\n")


def reclaim(root: Path) -> None:
    """Undo the shields of runs that are gone (killed before their way out)."""
    for record in LOCK.parent.glob(IDLED.format("*")):
        owner = record.name.split("-")[-1].split(".")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _unidle([Path(line) for line in record.read_text().split()])
            record.unlink(missing_ok=True)
    for group in root.glob(f"{PREFIX}*"):
        owner = group.name[len(PREFIX):]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _dissolve(root, group)


@contextmanager
def others_yield() -> Iterator[Shield]:
    """While the block runs, every other process yields the CPU to the ones the caller
    starts in it (see the module's docstring). Without root or a cpu controller that
    has ``cpu.idle``, the block runs unshielded and the Shield says why."""
    root = cpu_root()
    if root is None or os.geteuid() != 0:
        yield Shield(None, "needs root and a cgroup cpu controller" if root is None
                     else "needs root")
        return
    with _turn() as why:
        if why:
            yield Shield(None, why)
            return
        with _shielded(root) as shield:
            yield shield


@contextmanager
def _turn() -> Iterator[str]:
    """This process's turn to shield: yields "" once no other shielded block runs,
    or why not after ``WAIT_S``."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("a") as f:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield f"another shielded run held {LOCK} for {WAIT_S:g} s"
                    return
                time.sleep(0.1)
        try:
            yield ""
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _shielded(root: Path) -> Iterator[Shield]:
    reclaim(root)
    group = root / f"{PREFIX}{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        if root != Path("/sys/fs/cgroup/cpu") and "cpu" not in (
                root / "cgroup.subtree_control").read_text().split():
            (root / "cgroup.subtree_control").write_text("+cpu\n")  # v2: hand it down
        (group / "cpu.idle").write_text("1\n")
    except OSError as e:
        with suppress(OSError):
            group.rmdir()
        yield Shield(None, f"cpu.idle not available: {e}")
        return
    mover = _Mover(root, group)
    stop = threading.Event()

    def keep_sweeping() -> None:
        while not stop.wait(SWEEP_S):
            mover.sweep()

    sweeper = threading.Thread(target=keep_sweeping, name="shield-sweep", daemon=True)
    try:
        mover.sweep()
        sweeper.start()
        yield Shield(group, moved=mover.moved, idled=mover.idled)
    finally:
        stop.set()
        if sweeper.is_alive():
            sweeper.join(5)
        mover.undo()
        _dissolve(root, group)
