"""tests/shield.py on this machine's real cgroups: a busy loop sharing a victim's CPU
delays it; inside ``others_yield`` the same loop does not, whether it runs in the root
cgroup or in a cgroup of its own, and after the block (an exception included) it is
back where it was, its own cgroup as it was, and the shield's cgroup gone; what a killed
run left is undone by the next one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from recorder import scratch_cgroup
from shield import IDLED, LOCK, PREFIX, cpu_root, others_yield

ROOT = cpu_root()
pytestmark = pytest.mark.skipif(ROOT is None or os.geteuid() != 0,
                                reason="needs root and a cgroup cpu controller")

# The victim: 1 ms of work, 1 ms asleep, for 1.5 s; prints the share of its wall time
# it spent runnable but waiting for the CPU (schedstat's run_delay).
VICTIM = """
import time
def delay():
    return int(open("/proc/self/schedstat").read().split()[1])
t0, d0 = time.monotonic(), delay()
while time.monotonic() - t0 < 1.5:
    end = time.monotonic() + 0.001
    while time.monotonic() < end:
        pass
    time.sleep(0.001)
print((delay() - d0) / 1e9 / (time.monotonic() - t0))
"""


def _cpu() -> int:
    return sorted(os.sched_getaffinity(0))[-1]


def _on(cpu: int) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, {cpu})


@pytest.fixture
def hog() -> Iterator[subprocess.Popen[bytes]]:
    """A busy loop on the victim's CPU, started before any shield (other load)."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                         preexec_fn=_on(_cpu()))
    yield p
    p.kill()
    p.wait(10)


def _cgroup(pid: int) -> str:
    """The process's cgroup in the cpu controller's hierarchy."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (controllers == "" and Path(
                "/sys/fs/cgroup") == ROOT):
            return path
    raise AssertionError(f"no cpu cgroup for {pid}")


def _victim_delay() -> float:
    out = subprocess.run([sys.executable, "-c", VICTIM], capture_output=True, text=True,
                         check=True, timeout=60, preexec_fn=_on(_cpu()))
    return float(out.stdout)


def test_other_load_stops_delaying_the_victim_and_comes_back(
        hog: subprocess.Popen[bytes]) -> None:
    # The control: a busy loop at the same priority takes a real share from the victim.
    assert _victim_delay() > 0.15
    with others_yield() as shield:
        assert shield.group is not None, shield.why
        assert hog.pid in shield.moved
        assert _cgroup(hog.pid) == f"/{shield.group.name}"
        assert _victim_delay() < 0.03
        group = shield.group
    assert _cgroup(hog.pid) == "/"  # back in the root cgroup
    assert not group.exists()


def test_an_exception_in_the_block_restores_everything(
        hog: subprocess.Popen[bytes]) -> None:
    with pytest.raises(KeyboardInterrupt), others_yield() as shield:
        assert shield.group is not None and _cgroup(hog.pid) == f"/{shield.group.name}"
        raise KeyboardInterrupt
    assert _cgroup(hog.pid) == "/"
    assert shield.group is not None and not shield.group.exists()


def test_load_in_a_cgroup_of_its_own_yields_and_keeps_its_cgroup(
        hog: subprocess.Popen[bytes]) -> None:
    assert ROOT is not None
    with scratch_cgroup(ROOT, {}) as own:
        (own / "cgroup.procs").write_text(f"{hog.pid}\n")
        assert _victim_delay() > 0.15
        with others_yield() as shield:
            assert own in shield.idled and (own / "cpu.idle").read_text().strip() == "1"
            assert _cgroup(hog.pid) == f"/{own.name}"  # not moved
            assert _victim_delay() < 0.03
        assert (own / "cpu.idle").read_text().strip() == "0"
        assert _cgroup(hog.pid) == f"/{own.name}"
        # A killed run's record of what it set idle is undone by the next run.
        dead = subprocess.Popen(["true"])
        dead.wait()
        (own / "cpu.idle").write_text("1\n")
        (LOCK.parent / IDLED.format(dead.pid)).write_text(f"{own}\n")
        with others_yield():
            pass
        assert (own / "cpu.idle").read_text().strip() == "0"
        assert not (LOCK.parent / IDLED.format(dead.pid)).exists()


def test_a_killed_runs_cgroup_is_dissolved_by_the_next(
        hog: subprocess.Popen[bytes]) -> None:
    assert ROOT is not None
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = ROOT / f"{PREFIX}{dead.pid}"
    stale.mkdir()
    (stale / "cpu.idle").write_text("1\n")
    (stale / "cgroup.procs").write_text(f"{hog.pid}\n")
    assert _cgroup(hog.pid) == f"/{stale.name}"
    with others_yield() as shield:
        assert not stale.exists()
        assert shield.group is not None
    assert _cgroup(hog.pid) == "/"
