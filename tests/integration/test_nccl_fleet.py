"""Distributed training across namespace hosts (issue #15): four ranks of
tests/workloads/nccl_ranks.py on the real libnccl, one per host of the test bed, each
traced by its host's own ``fleetd agent``; the client asks from its own namespace.

One job runs through three phases: quiet (nobody is late, nothing hangs), a CPU hog in
one host's CPU slice (that rank arrives last at the collectives: ``explain --nodes``
names it, by collective arrival, with the hog as the why), then that rank stopped
(``fleetd watch`` names it, stopped, within 20 s) and another killed (named exited).
A second job runs with one host's wall clock 2.5 s ahead (libfaketime) and another
rank late by a fixed delay: the late rank is still named, since arrivals are
clock-corrected.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from netbed import FAKETIME_LIB, PY, NetBed, why_no_bpf, why_unavailable

_WHY = why_unavailable() or why_no_bpf() or (
    None if Path(FAKETIME_LIB).exists() else f"libfaketime is not installed ({FAKETIME_LIB})")
pytestmark = [pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

WORKLOAD = REPO / "tests" / "workloads" / "nccl_ranks.py"
RANKS = 4
MASTER_PORT = 29511
HOG = "fleetd-hog"
# Quiet ranks are never this late (measured: 2.2 ms at worst); the hog's is (5.6 ms).
QUIET_LATE_NS = 4_000_000
FAKED = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": "+2.5s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
# 1 ms of Python work and 8 ms "on the GPU" per step: ~15% of a CPU, inside each slice's
# quota, until a hog shares the slice.
STEP = ["--compute-ms", "1", "--sleep-ms", "8"]


@dataclass
class Job:
    bed: NetBed
    ranks: list[subprocess.Popen[str]]
    pids: list[int]  # by rank, as seen from the root namespace

    def explain(self, *extra: str) -> Any:
        proc = self.bed.client("explain", "--nodes", self.bed.nodes_arg(),
                               *self.bed.client_tls_args(), "--timeout", "90s",
                               "--format", "json", *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def watch(self, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.bed.client_ns}", str(REPO / ".venv/bin/fleetd"),
             "watch", "--nodes", self.bed.nodes_arg(), *self.bed.client_tls_args(),
             "--format", "json", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextmanager
def job(tmp: Path, name: str, extra: list[str], faked: int | None = None
        ) -> Iterator[Job]:
    """Four ranks on four hosts, each traced by its host's agent, running once this
    yields (every rank past its first collectives)."""
    from netbed import netbed

    with netbed(tmp / f"{name}-bed", RANKS, quota=0.2) as bed:
        go = tmp / f"{name}.go"
        master = bed.hosts[0].address
        ranks = []
        for i, h in enumerate(bed.hosts):
            env = {"RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": str(RANKS),
                   "MASTER_ADDR": master, "MASTER_PORT": str(MASTER_PORT),
                   "TORCHELASTIC_RUN_ID": f"{name}-job"}
            ranks.append(bed.spawn(h, [PY, str(WORKLOAD), "--seconds", "90", *STEP, *extra,
                                       "--go-file", str(go), "--barrier-timeout", "60",
                                       "--max-listed", "0"],
                                   in_slice=True, env=env, stdout=subprocess.PIPE))
        pids = []
        for r in ranks:  # each says so once it loaded libnccl
            assert r.stdout is not None
            line = r.stdout.readline()
            assert '"ready"' in line, line
            pids.append(int(json.loads(line)["pid"]))
        for h, pid in zip(bed.hosts, pids, strict=True):
            bed.start_agent(h, db=tmp / f"{name}-{h.name}.db", trace_pid=pid,
                            env=FAKED if h.index == faked else None)
        bed.wait_agents()
        go.touch()
        time.sleep(2)
        yield Job(bed, ranks, pids)
        for p in pids:
            with suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)


def _stragglers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in obj["stragglers"] if s.get("metric") == "collective_arrival"]


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, Any, str]:
    """The watch's exit code, its verdict (its last JSON line) and its stderr."""
    code, lines, err = _watched(proc, timeout)
    return code, lines[-1] if lines else None, err


def _watched(proc: subprocess.Popen[str], timeout: float
             ) -> tuple[int, list[dict[str, Any]], str]:
    """The watch's exit code, every JSON line it printed (events, then the verdict) and
    its stderr."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_quiet_then_a_hog_then_a_hang(tmp_path: Path) -> None:
    with job(tmp_path, "hog", []) as j:
        bed = j.bed
        # Quiet: no hang while the job runs, and no late rank.
        quiet_from = time.time_ns()
        code, lines, err = _watched(j.watch("--hang-after", "5s", "--for", "6s"), 60)
        verdict = lines[-1]
        assert code == 0 and verdict["status"] == "ok", (err, verdict)
        # A rank out last by the quiet phase's millisecond or two of scheduling (below)
        # at every poll of a watch just begun (no usual lateness of its own known yet)
        # may be flagged; one late as the hog makes it may not.
        early = [e for e in lines[:-1] if e.get("event") == "straggler"]
        assert all(e["late_ms"] * 1e6 < QUIET_LATE_NS for e in early), early
        quiet = j.explain("--from", str(quiet_from), "--to", str(time.time_ns()))
        # Four ranks in 20% CPU slices on two shared cores: a rank can come out last by
        # a millisecond or two of scheduling (measured in CI: 2.2 ms, last in 53%), and
        # the analyzer rightly reports it. Quiet means no rank late by QUIET_LATE_NS; the
        # hog phase below must stand well above whatever the quiet phase saw.
        quiet_late = [s["lateness_p50_ns"] for s in _stragglers(quiet) if s["flagged"]]
        assert all(ns < QUIET_LATE_NS for ns in quiet_late), quiet["stragglers"]
        assert quiet["collectives"]["matching"] == "torchrun"

        # A hog in host-2's slice: its rank arrives last.
        slow = bed.hosts[2]
        hog = bed.start_hog(slow, HOG)
        hog_from = time.time_ns()
        time.sleep(10)
        obj = j.explain("--from", str(hog_from), "--to", str(time.time_ns()))
        print(json.dumps(obj["stragglers"], indent=1))
        top = obj["stragglers"][0]
        assert (top["metric"], top["rank"], top["node"], top["pid"]) == (
            "collective_arrival", 2, slow.name, j.pids[2]), obj["stragglers"]
        assert top["flagged"] and top["share_last"] >= 0.5
        assert all(top["lateness_p50_ns"] > 1.5 * ns for ns in quiet_late), (top, quiet_late)
        assert HOG in top["reason"], top["reason"]
        assert [s["rank"] for s in _stragglers(obj) if s["flagged"]] == [2]
        hog.kill()

        # Stopped: the watch names it within 20 s of the stop.
        watch = j.watch("--hang-after", "10s")
        time.sleep(2)
        assert watch.poll() is None, watch.communicate()
        stopped_at = time.monotonic()
        os.kill(j.pids[2], signal.SIGSTOP)
        code, verdict, err = _finish(watch, 40)
        took = time.monotonic() - stopped_at
        print(f"hang verdict after {took:.1f} s:", json.dumps(verdict, indent=1))
        assert code != 0 and verdict["status"] == "hang", err
        assert took <= 20
        hang = verdict["hangs"][0]
        culprit = hang["culprits"][0]
        assert (culprit["rank"], culprit["node"], culprit["pid"], culprit["state"]) == (
            2, slow.name, j.pids[2], "stopped"), hang
        assert hang["seq"] >= 1 and {w["rank"] for w in hang["waiting"]} <= {0, 1, 3}
        assert hang["waiting"], hang

        # A rank that exits is named as exited.
        os.kill(j.pids[2], signal.SIGCONT)
        time.sleep(1)
        os.kill(j.pids[1], signal.SIGKILL)
        code, verdict, err = _finish(j.watch("--hang-after", "5s"), 40)
        assert code != 0 and verdict["status"] == "hang", err
        named = [c for h in verdict["hangs"] for c in h["culprits"]]
        assert any((c["rank"], c["node"], c["state"]) == (1, bed.hosts[1].name, "exited")
                   for c in named), verdict


def test_a_late_rank_is_found_through_a_skewed_clock(tmp_path: Path) -> None:
    # host-1's wall clock runs 2.5 s ahead: uncorrected, its rank would be "last" by
    # 2.5 s at every collective. Rank 3 is late by a fixed 15 ms per step.
    with job(tmp_path, "skew", ["--extra-ms-rank", "3:15"], faked=1) as j:
        since = time.time_ns()
        time.sleep(8)
        obj = j.explain("--from", str(since), "--to", str(time.time_ns()))
    print(json.dumps(obj["stragglers"], indent=1))
    assert abs(obj["skew"]["host-1"]["offset_ms"] - 2500) < 50, obj["skew"]
    flagged = [s for s in _stragglers(obj) if s["flagged"]]
    assert [(s["rank"], s["node"]) for s in flagged] == [(3, "host-3")], obj["stragglers"]
    assert flagged[0]["lateness_p50_ns"] >= 10_000_000
