"""A memory limit, live: the reference workload in a memory cgroup smaller than what it
touches, traced with real BPF. The feeding thread reclaims for its own allocations on
every step; the chain names the limit and states the thread's reclaim share, which is
the breakdown's column and the kernel's own histogram of the same stalls. Without the
limit, no memory_reclaim chain.

Swap is off on these machines, so an anonymous working set over the limit would be
OOM-killed, not reclaimed. The workload's ``--touch-mb`` stages each step's batch in
the next of 16 buffers and gives it back with MADV_FREE (as jemalloc and tcmalloc do):
lazily freed pages sit on the file LRU and reclaim drops them without swap, so the
cgroup's usage stays at its limit and every new page charged reclaims an older one,
with no disk I/O to blur the picture. The live set is one buffer (8 MiB), the ring
128 MiB, the limit 64 MiB.

The workload also runs in a cgroup of its own on the v2 hierarchy where one is mounted
(beside the v1 controllers on these machines): the kernel keeps pressure stall
information per v2 cgroup, so the chain cites the cgroup's own memory.pressure.

The reclaim, and the kernel work it queues, come per step, so the test sees as many as
the workload runs steps in its 4 s. On a busy node (a busy loop on every CPU, other
sessions' tests) an unprotected workload ran a quarter of them. So it runs pinned to one
CPU in a cpu cgroup of ten times the default weight: against whatever else runs there at
normal priority it gets that CPU nearly to itself, as on a quiet machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
from cpu_first import FIRST, cpu_hierarchy, first_on_cpu
from recorder import running, scratch_cgroup, trace_for

from conftest import FLEETD, REPO

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and BPF need root")]

PY = sys.executable
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
ROOT = Path("/sys/fs/cgroup")
LIMIT = 64 << 20
STEP = ["--launches", "8", "--memcpy", "1", "--touch-mb", "8", "--gpu-ms", "2"]


def _memory_hierarchy() -> tuple[Path, str]:
    """Where memory limits are set here: (hierarchy root, limit file)."""
    if (ROOT / "memory" / "memory.limit_in_bytes").exists():
        return ROOT / "memory", "memory.limit_in_bytes"
    if "memory" in (ROOT / "cgroup.controllers").read_text().split():
        return ROOT, "memory.max"
    pytest.fail("no memory controller: neither /sys/fs/cgroup/memory (v1) nor memory in "
                "/sys/fs/cgroup/cgroup.controllers (v2)")


def _unified() -> Path | None:
    """The v2 hierarchy beside v1 controllers (hybrid), for per-cgroup PSI."""
    u = ROOT / "unified"
    return u if (u / "cgroup.procs").exists() and (u / "memory.pressure").exists() else None


def _groups(stack: ExitStack, limited: bool) -> list[Path]:
    """The workload's cgroups: the memory limit (when ``limited``), a v2 one for its
    pressure stall information on a hybrid machine, and the CPU weight (module
    docstring), in the v1 cpu hierarchy or, on a v2 machine, in its one cgroup."""
    root, setup = ROOT, {}
    if limited:
        root, limit_file = _memory_hierarchy()
        setup[limit_file] = str(LIMIT)
    groups: list[Path] = []
    cpu = cpu_hierarchy()
    v2_cpu = cpu is not None and cpu[0] == "v2"
    if cpu is not None and cpu[1] == root:  # v2 only: one cgroup for limit and weight
        (root / "cgroup.subtree_control").write_text("+cpu")
        setup = {**setup, **FIRST["v2"]}
    elif cpu is not None:
        groups.append(stack.enter_context(first_on_cpu()))
    if setup:
        groups.append(stack.enter_context(scratch_cgroup(root, setup)))
    unified = _unified()
    # A v2 cgroup of the weight's, where there is one, keeps the pressure too.
    if limited and unified is not None and root != ROOT and not v2_cpu:
        groups.append(stack.enter_context(scratch_cgroup(unified, {})))
    return groups


def explain_live(tmp_path: Path, limited: bool) -> dict[str, object]:
    go, db = tmp_path / "go", tmp_path / "t.db"
    cpu = max(os.sched_getaffinity(0))
    with ExitStack() as stack:
        groups = _groups(stack, limited)
        with running([PY, str(WORKLOAD), "--duration", "30", "--go-file", str(go), *STEP],
                     cpu=cpu, groups=groups) as wl:
            trace_for(wl.pid, db, go, "4s")
    r = subprocess.run([FLEETD, "explain", "--db", str(db), "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout), pid=wl.pid, db=str(db))


def _sql(db: str, sql: str) -> list[dict[str, object]]:
    r = subprocess.run([FLEETD, "query", "--db", db, sql, "--format", "json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return [dict(zip(out["columns"], row, strict=True)) for row in out["rows"]]


def _feeding_thread(report: dict[str, object]) -> dict[str, object]:
    [proc] = [p for p in report["processes"]  # type: ignore[attr-defined]
              if p["pid"] == report["pid"]]
    return max(proc["threads"], key=lambda t: t["in_cuda_ns"])  # type: ignore[no-any-return]


def test_a_memory_limit_makes_the_feeding_thread_reclaim(tmp_path: Path) -> None:
    report = explain_live(tmp_path, limited=True)
    chains = [c for c in report["chains"]  # type: ignore[attr-defined]
              if c["root_cause"] == "memory_reclaim"]
    [ch] = chains
    assert ch["victim"]["pid"] == report["pid"]
    assert ch["culprit"] is None and ch["culprits"] == []  # nobody took that time
    d = ch["detail"]
    assert d["limit_bytes"] == LIMIT and d["cgroup"].startswith("/fleetd-test-"), d
    assert d["by_kind"].get("memcg reclaim", 0) > 0 and d["stalls"] > 100, d
    assert ch["severity"] in ("HIGH", "MEDIUM") and ch["impact"] >= 0.05, ch
    # The share stated is the breakdown's reclaim column of the same thread ...
    t = _feeding_thread(report)
    assert t["tid"] == ch["victim"]["tid"]
    assert abs(ch["impact"] - t["reclaim_ns"] / t["wall_ns"]) < 1e-3, (ch["impact"], t)
    # ... and the runs stored add up to the kernel's histogram of every stall.
    [runs] = _sql(str(report["db"]), "SELECT count(*) AS n, sum(a0) AS stalls, sum(bytes) AS ns "
                  f"FROM events WHERE op = 'memcg_reclaim' AND pid = {report['pid']}")
    [hist] = _sql(str(report["db"]), "SELECT sum(count) AS stalls, sum(sum) AS ns FROM "
                  f"aggregates WHERE op = 'memcg_reclaim' AND pid = {report['pid']} "
                  "AND bucket < 0")
    assert runs["stalls"] == hist["stalls"] and runs["ns"] == hist["ns"], (runs, hist)
    text = json.dumps(ch["evidence"])
    assert "memory limit 64 MiB" in text and "reclaim/compaction stall" in text, text
    if _unified() is not None:  # the cgroup's own pressure stall information
        assert d.get("psi_some_share", 0) > 0, d
        assert "memory pressure (PSI)" in text
    assert any("raise the memory limit" in f for f in ch["fixes"]), ch["fixes"]
    # The table: the chain, and the breakdown's reclaim column (shown when a thread
    # reclaimed).
    text = subprocess.run([FLEETD, "explain", "--db", str(report["db"]), "--wide"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "[HIGH] memory_reclaim" in text or "[MEDIUM] memory_reclaim" in text, text
    assert f"at its cgroup's memory limit (64 MiB, {d['cgroup']})" in text
    after = text.split("per-process breakdown", 1)[1].splitlines()
    header = next(line for line in after if line.startswith("node "))
    assert header.split()[-1] == "reclaim", header
    # On the v1 memory controller each reclaim queues the cgroup's pressure notification
    # for a kernel worker: the tracer counts the work the thread queued, and a contention
    # chain whose top culprit is such a worker says the work was the thread's own.
    if _memory_hierarchy()[0] != ROOT:
        work = _sql(str(report["db"]), "SELECT sum(a0) AS n FROM events WHERE op = 'kwork_queued' "
                    f"AND pid = {report['pid']} AND args LIKE '%vmpressure_work_fn%'")
        assert (work[0]["n"] or 0) > 100, work
    for c in report["chains"]:  # type: ignore[attr-defined]
        if c["root_cause"] == "cpu_contention" and c["victim"]["tid"] == ch["victim"]["tid"] \
                and (c["culprit"] or {}).get("comm", "").startswith("kworker/"):
            assert c["detail"]["own_kernel_work"]["reclaim"] is True, c["detail"]
            assert "raise its memory limit" in c["fixes"][0], c["fixes"]
            assert "the kworkers ran work the thread queued itself" in c["summary"], c


def test_without_a_limit_there_is_no_reclaim_chain(tmp_path: Path) -> None:
    report = explain_live(tmp_path, limited=False)
    assert [c for c in report["chains"]  # type: ignore[attr-defined]
            if c["root_cause"] == "memory_reclaim"] == []
    t = _feeding_thread(report)
    assert t["reclaim_ns"] / t["wall_ns"] < 0.01, t
    work = _sql(str(report["db"]), "SELECT count(*) AS n FROM events WHERE op = 'kwork_queued' "
                f"AND pid = {report['pid']} AND args LIKE '%vmpressure_work_fn%'")
    assert work[0]["n"] == 0, work
