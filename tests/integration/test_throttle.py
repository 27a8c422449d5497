"""A CPU limit, live: the reference workload alone in a CPU cgroup with a 25% quota (a
Kubernetes 250m limit) on this machine's cgroup v1 ``cpu`` controller, and on the v2
one where the unified hierarchy has the cpu controller, traced with real BPF. The
cause is the quota, named with its cgroup and figures; no process is blamed for the
time the quota kept the thread off the CPU. With a busy loop inside the same
quota, the quota and the busy loop both show; without a quota, no cpu_throttled chain.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from recorder import scratch_cgroup, start_in, trace_for, wait_for_libcudart

from fleetd.trace.host.cgroups import v2_root

from conftest import FLEETD, REPO

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and BPF need root")]

PY = sys.executable
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
NEIGHBOUR = REPO / "tests" / "workloads" / "neighbour.py"
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
STEP = ["--launches", "8", "--memcpy", "1", "--cpu-us", "400", "--gpu-ms", "4"]  # ~45% of a CPU


def _v2_cpu_root() -> Path | None:
    """The unified hierarchy, when it has the cpu controller (pure v2 machines; on this
    project's hybrid machines the cpu controller is bound to the v1 hierarchy)."""
    root = v2_root()
    ok = root is not None and "cpu" in (root / "cgroup.controllers").read_text().split()
    return root if ok else None


V2_ROOT = _v2_cpu_root()
# Every CPU controller this machine offers a quota on; the tests run on each.
HIERARCHIES = [h for h, ok in (("v1", (CPU_ROOT / "cpu.cfs_quota_us").exists()),
                               ("v2", V2_ROOT is not None)) if ok] or ["none"]


@contextmanager
def cpu_cgroup(quota_us: int | None, hierarchy: str = "v1") -> Iterator[Path | None]:
    if quota_us is None:
        yield None
        return
    if hierarchy == "none":
        pytest.fail("no cpu controller: neither /sys/fs/cgroup/cpu (v1) nor cpu in the "
                    "unified hierarchy's cgroup.controllers (v2)")
    root = CPU_ROOT if hierarchy == "v1" else V2_ROOT
    assert root is not None
    if hierarchy == "v2":  # children of the root get the controller
        (root / "cgroup.subtree_control").write_text("+cpu")
    setup = {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": str(quota_us)} \
        if hierarchy == "v1" else {"cpu.max": f"{quota_us} 100000"}
    with scratch_cgroup(root, setup) as d:
        yield d


def _start_in(group: Path | None, argv: list[str]) -> subprocess.Popen[str]:
    # One CPU: the quota is a share of one core.
    return start_in([group] if group is not None else [], argv, cpu=0)


def explain_live(tmp_path: Path, quota_us: int | None, hog: bool,
                 hierarchy: str = "v1") -> dict[str, object]:
    go, db = tmp_path / "go", tmp_path / "t.db"
    with cpu_cgroup(quota_us, hierarchy) as group:
        wl = _start_in(group, [PY, str(WORKLOAD), "--duration", "30", "--go-file", str(go),
                               *STEP])
        hogp = _start_in(group, [PY, str(NEIGHBOUR), "hog", "--seconds", "30"]) if hog \
            else None
        try:
            wait_for_libcudart(wl.pid)
            trace_for(wl.pid, db, go, "6s")
        finally:
            for p in (wl, hogp):
                if p is not None:
                    p.kill()
                    p.wait()
    r = subprocess.run([FLEETD, "explain", "--db", str(db), "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout), pid=wl.pid, hog=hogp.pid if hogp else None)


def _chains(report: dict[str, object], root: str) -> list[dict[str, object]]:
    return [c for c in report["chains"] if c["root_cause"] == root]  # type: ignore[union-attr,index]


@pytest.mark.parametrize("hierarchy", HIERARCHIES)
def test_a_cpu_quota_is_the_cause_and_nobody_is_the_culprit(tmp_path: Path,
                                                            hierarchy: str) -> None:
    report = explain_live(tmp_path, 25_000, hog=False, hierarchy=hierarchy)
    [ch] = _chains(report, "cpu_throttled")
    assert ch["severity"] == "HIGH", ch
    assert ch["culprit"] is None and ch["culprits"] == []
    d = ch["detail"]
    assert d["quota_us"] == 25_000 and d["period_us"] == 100_000
    assert d["cgroup"].startswith("/fleetd-test-") and d["throttled_periods"] > 0
    assert "quota 25000 us per 100000 us" in json.dumps(ch["evidence"])
    # Whatever ran while the quota held the thread off took nothing from it: a
    # contention chain of the thread (on a machine busy with other work, processes
    # outside the quota do preempt it) states only the run-queue time beyond the
    # throttling, so the two add up to the breakdown's run-queue column.
    [proc] = [p for p in report["processes"]  # type: ignore[attr-defined]
              if p["pid"] == report["pid"]]
    t = next(t for t in proc["threads"] if t["tid"] == ch["victim"]["tid"])
    runq = t["runq_ns"] / t["wall_ns"]
    for c in _chains(report, "cpu_contention"):
        if c["victim"]["tid"] != ch["victim"]["tid"] or c["culprit"] is None:
            continue
        assert c["detail"]["quota_share"] == pytest.approx(ch["impact"], abs=1e-3), c
        assert c["impact"] + ch["impact"] == pytest.approx(runq, abs=2e-3), (c, runq)


@pytest.mark.parametrize("hierarchy", HIERARCHIES)
def test_a_busy_neighbour_inside_the_quota_shows_beside_it(tmp_path: Path,
                                                           hierarchy: str) -> None:
    """Alone the workload fits the quota; the busy loop sharing it spends it: the loop
    is the culprit and the chain names the quota it spends."""
    report = explain_live(tmp_path, 50_000, hog=True, hierarchy=hierarchy)
    named = [c for c in report["chains"]  # type: ignore[union-attr]
             if (c.get("culprit") or {}).get("pid") == report["hog"]]
    assert named and named[0]["root_cause"] == "cpu_contention", report["chains"]
    quota = named[0]["detail"]["quota"]
    assert quota["quota_us"] == 50_000 and quota["cgroup"].startswith("/fleetd-test-")
    assert "quota 50000 us per 100000 us" in json.dumps(named[0]["evidence"])
    assert "out of the workload's cgroup" in named[0]["fixes"][0]


def test_without_a_quota_there_is_no_throttling_chain(tmp_path: Path) -> None:
    report = explain_live(tmp_path, None, hog=False)
    assert _chains(report, "cpu_throttled") == []
