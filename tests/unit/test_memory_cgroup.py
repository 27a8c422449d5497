"""Memory cgroups read from files laid out as the kernel writes them (v1 memory
controller, v2 memory.max up the tree, PSI), and the sampler's rows from two samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetd.store.catalog import op_code
from fleetd.trace.host.memory import (
    MemorySampler,
    memory_state,
    parse_psi,
    tracepoints,
)

PSI = "some avg10=1.50 avg60=0.30 avg300=0.10 total={some}\n" \
      "full avg10=1.00 avg60=0.20 avg300=0.05 total={full}\n"


def _v1(root: Path, path: str, *, limit: int, usage: int, failcnt: int) -> None:
    d = root / "memory" / path.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.stat").write_text(
        f"cache 100\nrss 200\nhierarchical_memory_limit {limit}\ntotal_cache 4096\n"
        f"total_rss 8192\ntotal_inactive_file 1000\ntotal_active_file 24\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.max_usage_in_bytes").write_text(f"{usage + 1}\n")
    (d / "memory.failcnt").write_text(f"{failcnt}\n")


def _v2(root: Path, path: str, files: dict[str, str]) -> Path:
    (root / "cgroup.procs").write_text("")
    (root / "cgroup.controllers").write_text("cpu memory\n")
    d = root / path.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_psi_totals() -> None:
    assert parse_psi(PSI.format(some=1234, full=56)) == {"some": 1234, "full": 56}
    assert parse_psi("") == {}


def test_v1_limit_is_the_hierarchical_one_and_unlimited_is_none(tmp_path: Path) -> None:
    _v1(tmp_path, "/kubepods/pod1/c1", limit=64 << 20, usage=60 << 20, failcnt=7)
    s = memory_state({"memory": "/kubepods/pod1/c1", "": "/"}, tmp_path)
    assert s is not None
    assert (s.limit, s.usage, s.peak, s.limit_hits) == (64 << 20, 60 << 20, (60 << 20) + 1, 7)
    assert (s.file, s.anon) == (1024, 8192)  # the file LRU, total_rss
    assert s.psi_some_us is None  # no v2 hierarchy: no PSI
    _v1(tmp_path, "/free", limit=9223372036854771712, usage=1, failcnt=0)
    free = memory_state({"memory": "/free"}, tmp_path)
    assert free is not None and free.limit is None


def test_v2_takes_the_smallest_limit_up_the_tree_and_the_cgroups_psi(tmp_path: Path) -> None:
    pod = "/kubepods.slice/kubepods-pod1.slice"
    _v2(tmp_path, pod, {"memory.max": f"{128 << 20}\n"})
    _v2(tmp_path, pod + "/cri-containerd-x.scope", {
        "memory.max": "max\n", "memory.current": f"{100 << 20}\n", "memory.peak": "5\n",
        "memory.events": "low 0\nhigh 0\nmax 42\noom 0\n",
        "memory.stat": "anon 10\nfile 20\nactive_file 3\ninactive_file 4\n",
        "memory.pressure": PSI.format(some=900, full=100)})
    s = memory_state({"": pod + "/cri-containerd-x.scope"}, tmp_path)
    assert s is not None
    assert (s.limit, s.usage, s.peak, s.limit_hits) == (128 << 20, 100 << 20, 5, 42)
    assert (s.file, s.anon, s.psi_some_us, s.psi_full_us) == (7, 10, 900, 100)


def test_the_sampler_writes_deltas_between_samples(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    groups = {"memory": "/job", "": "/"}
    from fleetd.trace.host import cgroups as cg

    monkeypatch.setattr(cg, "read_groups", lambda pid: groups)
    psi = tmp_path / "pressure"
    psi.write_text(PSI.format(some=1000, full=0))
    _v1(tmp_path, "/job", limit=64 << 20, usage=10 << 20, failcnt=5)
    (tmp_path / "memory" / "job" / "cgroup.procs").write_text("41\n42\n")
    s = MemorySampler(op_code("mem_cgroup"), lambda pid: {}, tmp_path, psi)
    assert s.sample([42], 1_000) == []  # the first sample is the baseline
    _v1(tmp_path, "/job", limit=64 << 20, usage=20 << 20, failcnt=9)
    psi.write_text(PSI.format(some=1600, full=0))
    [(row, args)] = s.sample([42], 2_000)
    assert row[:5] == (1_000, 1_000, 42, 42, op_code("mem_cgroup"))
    assert (row[6], row[8], row[9]) == (20 << 20, 64 << 20, -1)  # usage, limit, no v2 PSI
    assert args["limit_hits"] == 4 and args["psi_system_some_us"] == 600
    assert args["cgroup"] == "/job" and args["pids"] == [41, 42]
    groups["memory"] = "/unlimited"  # a cgroup without a limit is not sampled
    _v1(tmp_path, "/unlimited", limit=1 << 62, usage=1, failcnt=0)
    assert MemorySampler(op_code("mem_cgroup"), lambda pid: {}, tmp_path, psi
                         ).sample([7], 1) == []


def test_tracepoints_need_both_ends(tmp_path: Path) -> None:
    for tp in ("vmscan/mm_vmscan_memcg_reclaim_begin", "vmscan/mm_vmscan_memcg_reclaim_end",
               "compaction/mm_compaction_begin"):
        (tmp_path / tp).mkdir(parents=True)
        (tmp_path / tp / "format").write_text("")
    assert tracepoints([tmp_path]) == {"FL_VMSCAN": False, "FL_MEMCG_RECLAIM": True,
                                       "FL_COMPACTION": False, "FL_KWORK": False}
    assert not any(tracepoints([tmp_path / "missing"]).values())


@pytest.mark.parametrize("layout", ["v2", "hybrid"])
def test_v2_cpu_limit_where_the_unified_hierarchy_is_mounted(tmp_path: Path,
                                                              layout: str) -> None:
    """cpu.max and cpu.stat of the process's v2 cgroup: at the root on a v2 machine,
    under ``unified`` beside the v1 controllers on a hybrid one."""
    from fleetd.trace.host import cgroups as cg

    v2 = tmp_path if layout == "v2" else tmp_path / "unified"
    v2.mkdir(exist_ok=True)
    d = _v2(v2, "/kubepods.slice/pod.slice/cri-containerd-x.scope", {
        "cpu.max": "25000 100000\n", "cgroup.procs": "7\n8\n",
        "cpu.stat": "usage_usec 9\nnr_periods 10\nnr_throttled 7\nthrottled_usec 1200\n"})
    assert cg.v2_root(tmp_path) == v2
    groups = {"": "/" + d.relative_to(v2).as_posix()}
    limit = cg.cpu_limit(groups, tmp_path)
    assert limit == cg.CpuLimit(25000, 100000, 10, 7, 1_200_000)
    assert cg.members(groups, tmp_path) == [7, 8]


def test_kernel_work_counts_become_deltas_with_named_functions() -> None:
    """The kernel's cumulative counts per (thread, function) read as the work queued
    since the last read; a kernel address (above 2**63) is stored signed."""
    from types import SimpleNamespace

    from fleetd.trace.host.memory import KernelWork

    func = 0xFFFFFFFF81234560
    counts = {(7, 5, func): 10}

    class Table:
        def items(self) -> list[tuple[SimpleNamespace, SimpleNamespace]]:
            return [(SimpleNamespace(tid=t, pid=p, func=f), SimpleNamespace(value=n))
                    for (t, p, f), n in counts.items()]

    kw = KernelWork(op_code("kwork_queued"), lambda a: b"vmpressure_work_fn")
    [(row, args)] = kw.rows(Table(), 1_000, 3_000)
    assert row == (1_000, 2_000, 5, 7, op_code("kwork_queued"), 0, 0, 0, 10,
                   func - (1 << 64), 0)
    assert args == {"function": "vmpressure_work_fn"}
    assert kw.rows(Table(), 3_000, 4_000) == []  # nothing new
    counts[(7, 5, func)] = 25
    [(row, _)] = kw.rows(Table(), 4_000, 5_000)
    assert row[8] == 15
