"""A CPU limit, live: the reference workload alone in a CPU cgroup with a 10% quota (a
Kubernetes 100m limit) on this machine's cgroup v1 ``cpu`` controller, and on the v2
one where the unified hierarchy has the cpu controller, traced with real BPF. The
cause is the quota, named with its cgroup and figures; no process is blamed for the
time the quota kept the thread off the CPU. With a busy loop inside the same
quota, the quota and the busy loop both show; without a quota, no cpu_throttled chain.
A quota on the cgroup above the workload's is found the same way. A window that is
crowded by a loop outside the quota first and throttled after splits the run-queue time
between the two causes by when each held the thread, naming the limit that throttled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cpu_first import FIRST
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
def cpu_cgroup(quota_us: int | None, hierarchy: str = "v1", *,
               first: bool = False) -> Iterator[Path | None]:
    """A scratch cgroup with a CPU quota (None: no cgroup); ``first``: with the weight
    that gets it that quota on a busy CPU (tests/cpu_first.py), so that it is the quota
    that holds it back."""
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
    if first:
        setup = {**FIRST[hierarchy], **setup}
    with scratch_cgroup(root, setup) as d:
        yield d


def _start_in(group: Path | None, argv: list[str]) -> subprocess.Popen[str]:
    # One CPU: the quota is a share of one core.
    return start_in([group] if group is not None else [], argv, cpu=0)


def explain_live(tmp_path: Path, quota_us: int | None, hog: bool,
                 hierarchy: str = "v1", first: bool = False) -> dict[str, object]:
    go, db = tmp_path / "go", tmp_path / "t.db"
    with cpu_cgroup(quota_us, hierarchy, first=first) as group:
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
    return dict(_explain(db), pid=wl.pid, hog=hogp.pid if hogp else None)


def _explain(db: Path, window: list[str] | None = None) -> dict[str, object]:
    r = subprocess.run([FLEETD, "explain", "--db", str(db), "--format", "json",
                        *(window or [])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def _chains(report: dict[str, object], root: str) -> list[dict[str, object]]:
    return [c for c in report["chains"] if c["root_cause"] == root]  # type: ignore[union-attr,index]


@pytest.mark.parametrize("hierarchy", HIERARCHIES)
def test_a_cpu_quota_is_the_cause_and_nobody_is_the_culprit(tmp_path: Path,
                                                            hierarchy: str) -> None:
    # 10% of a CPU (a 100m limit): the workload wants 45%, and on a machine busy enough
    # to give it a quarter of CPU 0 (other tests' work), the quota still binds.
    report = explain_live(tmp_path, 10_000, hog=False, hierarchy=hierarchy)
    [ch] = _chains(report, "cpu_throttled")
    assert ch["severity"] == "HIGH", ch
    assert ch["culprit"] is None and ch["culprits"] == []
    d = ch["detail"]
    assert d["quota_us"] == 10_000 and d["period_us"] == 100_000
    assert d["cgroup"].startswith("/fleetd-test-") and d["throttled_periods"] > 0
    assert "quota 10000 us per 100000 us" in json.dumps(ch["evidence"])
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
    is the culprit and the chain names the quota it spends. Half a CPU binds only where
    the group can get half of CPU 0: on a busy node (a busy loop there at the same
    weight) it would get less and never be throttled, so the group weighs more."""
    report = explain_live(tmp_path, 50_000, hog=True, hierarchy=hierarchy, first=True)
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


def _set_quota(group: Path, quota_us: int, hierarchy: str) -> None:
    if hierarchy == "v1":
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))
    else:
        (group / "cpu.max").write_text(f"{quota_us} 100000")


def _trace_then(wl: subprocess.Popen[str], other: subprocess.Popen[str], db: Path,
                go: Path, change: Callable[[], None]) -> None:
    """Trace the workload for 10 s, calling ``change`` 3 s into the trace; then both
    processes are killed."""
    def later() -> None:
        deadline = time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3)
        change()
    t = threading.Thread(target=later, daemon=True)
    try:
        wait_for_libcudart(wl.pid)
        t.start()
        trace_for(wl.pid, db, go, "10s")
    finally:
        t.join(10)
        for p in (wl, other):
            p.kill()
            p.wait()


@pytest.mark.parametrize("hierarchy", HIERARCHIES)
def test_crowded_then_throttled_each_cause_gets_its_own_time(tmp_path: Path,
                                                             hierarchy: str) -> None:
    """The first 3 s a busy loop outside the workload's cgroup shares its CPU (a limit of
    0.9 CPU it never reaches); then the loop is gone and the limit drops to 3%. The quota
    is named as it was when it throttled (3000 us), nobody is blamed for the throttled
    part, the loop is the culprit of the crowded part, and the two chains split the
    thread's run-queue time between them."""
    go, db = tmp_path / "go", tmp_path / "t.db"
    with cpu_cgroup(90_000, hierarchy) as group:
        assert group is not None
        wl = _start_in(group, [PY, str(WORKLOAD), "--duration", "30", "--go-file", str(go),
                               *STEP])
        # Niced up: on a busy machine it must stand out among what else runs on the CPU.
        hog = start_in([], [PY, str(NEIGHBOUR), "hog", "--seconds", "30", "--nice", "-10"],
                       cpu=0)

        def switch() -> None:  # the loop goes, the limit drops
            hog.kill()
            _set_quota(group, 3_000, hierarchy)
        _trace_then(wl, hog, db, go, switch)
    report: Any = _explain(db)
    [quota] = [c for c in _chains(report, "cpu_throttled") if c["victim"]["pid"] == wl.pid]
    assert quota["culprit"] is None and quota["culprits"] == [], quota
    assert quota["detail"]["quota_us"] == 3_000, quota["detail"]
    assert "quota 3000 us per 100000 us" in json.dumps(quota["evidence"])
    # The throttled part is the quota's: held off the CPU for much of those 7 s of 10 (what
    # else crowds CPU 0 on a busy machine takes the rest of its queued time there).
    assert quota["explained"] > 0.2 and quota["impact"] >= 0.1, quota
    [crowd] = [c for c in _chains(report, "cpu_contention")
               if c["victim"]["tid"] == quota["victim"]["tid"]]
    assert hog.pid in [c["pid"] for c in crowd["culprits"]], crowd["culprits"]
    [proc] = [p for p in report["processes"] if p["pid"] == wl.pid]
    row = next(x for x in proc["threads"] if x["tid"] == quota["victim"]["tid"])
    runq = row["runq_ns"] / row["wall_ns"]
    assert crowd["impact"] + quota["impact"] == pytest.approx(runq, abs=2e-3), (crowd, runq)


@pytest.mark.parametrize("hierarchy", HIERARCHIES)
def test_a_limit_cut_below_the_workload_is_the_cause_beside_a_neighbour_inside(
        tmp_path: Path, hierarchy: str) -> None:
    """The workload and a busy loop share a cgroup whose limit (0.9 CPU, weighted to come
    first on CPU 0) fits both; 3 s into the trace it is cut to 3%. The loop spends half of
    what is left, as a neighbour inside a quota does, but the workload alone ran far more
    than 3% before the cut (#43: bench/detect.py's quota cut was named cpu_contention
    with the rank's own data loader as culprit): the quota is the cause, in the whole
    recording and in a window after the cut alone (its lookback sees what ran before)."""
    go, db = tmp_path / "go", tmp_path / "t.db"
    cut: list[float] = []
    with cpu_cgroup(90_000, hierarchy, first=True) as group:
        assert group is not None
        wl = _start_in(group, [PY, str(WORKLOAD), "--duration", "30", "--go-file", str(go),
                               *STEP])
        hog = _start_in(group, [PY, str(NEIGHBOUR), "hog", "--seconds", "30"])

        def lower() -> None:
            _set_quota(group, 3_000, hierarchy)
            cut.append(time.time())
        _trace_then(wl, hog, db, go, lower)
    assert cut, "the limit was never lowered"
    after = ["--from", f"{cut[0] + 1:.3f}"]
    for report in (_explain(db), _explain(db, after)):
        mine = [c for c in _chains(report, "cpu_throttled") if c["victim"]["pid"] == wl.pid]
        assert len(mine) == 1, report["chains"]
        assert mine[0]["culprit"] is None and mine[0]["detail"]["quota_us"] == 3_000
        spent = [c for c in _chains(report, "cpu_contention")
                 if "quota" in c["detail"]]  # type: ignore[operator]
        assert spent == [], spent


@pytest.mark.parametrize("hierarchy", HIERARCHIES)
def test_a_quota_on_the_cgroup_above_is_the_cause(tmp_path: Path, hierarchy: str) -> None:
    """The limit sits on the parent (a pod's or a slice's cgroup), the workload in a child
    without one of its own: the parent's throttling holds it off the CPU all the same, so
    the chain is cpu_throttled, naming the parent, and nobody is the culprit."""
    go, db = tmp_path / "go", tmp_path / "t.db"
    with cpu_cgroup(10_000, hierarchy) as parent:  # binds on a busy CPU 0 too
        assert parent is not None
        if hierarchy == "v2":
            (parent / "cgroup.subtree_control").write_text("+cpu")
        with scratch_cgroup(parent, {}) as child:
            wl = _start_in(child, [PY, str(WORKLOAD), "--duration", "30", "--go-file",
                                   str(go), *STEP])
            try:
                wait_for_libcudart(wl.pid)
                trace_for(wl.pid, db, go, "6s")
            finally:
                wl.kill()
                wl.wait()
    report: Any = _explain(db)
    [ch] = _chains(report, "cpu_throttled")
    assert ch["victim"]["pid"] == wl.pid and ch["culprit"] is None, ch
    root = CPU_ROOT if hierarchy == "v1" else V2_ROOT
    assert root is not None
    assert ch["detail"]["cgroup"] == "/" + parent.relative_to(root).as_posix(), ch["detail"]
    assert ch["detail"]["quota_us"] == 10_000 and ch["detail"]["throttled_periods"] > 0
    assert wl.pid in ch["detail"]["members"], ch["detail"]
    assert ch["severity"] == "HIGH", ch
