"""Agents attached to a job that is already running (issue #28, item 2): four ranks of
tests/workloads/nccl_ranks.py on the real libnccl, one per namespace host, each host's
agent started 0.3 s to 3 s after the job, in random order. Each agent numbers a rank's
collectives from the moment it attached, so the raw numbers of two ranks differ by the
collectives made between their agents' starts; the ranks must still be matched by the
job's steps.

- one rank computes 15 ms more per step: ``explain --nodes`` names it (collective
  arrival), and ``collectives --nodes`` says the numbers were aligned from the calls,
  with high confidence;
- then one rank is stopped (SIGSTOP): ``watch`` names exactly that rank, stopped, within
  25 s, and no other rank as a culprit.

The random choices (delays, order, late and stopped rank) come from one seed, printed,
and taken from FLEETD_LATE_SEED when set.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from netbed import PY, NetBed, netbed, why_no_bpf, why_unavailable

_WHY = why_unavailable() or why_no_bpf()
pytestmark = [pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

WORKLOAD = REPO / "tests" / "workloads" / "nccl_ranks.py"
RANKS = 4
MASTER_PORT = 29531
STEP = ["--compute-ms", "1", "--sleep-ms", "8"]
LATE_MS = 15


def _client(bed: NetBed, *args: str, timeout: float = 120) -> Any:
    proc = bed.client(*args, "--nodes", bed.nodes_arg(), *bed.client_tls_args(),
                      "--format", "json", timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _watch(bed: NetBed, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{bed.client_ns}", str(REPO / ".venv/bin/fleetd"),
         "watch", "--nodes", bed.nodes_arg(), *bed.client_tls_args(), "--format", "json",
         *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_agents_attached_late_in_random_order(tmp_path: Path) -> None:
    seed = int(os.environ.get("FLEETD_LATE_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    delays = [rng.uniform(0.3, 3.0) for _ in range(RANKS)]  # by host
    order = sorted(range(RANKS), key=lambda i: delays[i])
    late, stopped = rng.randrange(RANKS), rng.randrange(RANKS)
    print(f"seed {seed}: agents at {[round(d, 2) for d in delays]} s after the job "
          f"(order {order}), rank {late} late by {LATE_MS} ms, rank {stopped} stopped")

    with netbed(tmp_path / "bed", RANKS, quota=0.2) as bed:
        go = tmp_path / "go"
        ranks = []
        for i, h in enumerate(bed.hosts):
            env = {"RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": str(RANKS),
                   "MASTER_ADDR": bed.hosts[0].address, "MASTER_PORT": str(MASTER_PORT),
                   "TORCHELASTIC_RUN_ID": "late-job"}
            ranks.append(bed.spawn(h, [PY, str(WORKLOAD), "--seconds", "300", *STEP,
                                       "--extra-ms-rank", f"{late}:{LATE_MS}",
                                       "--go-file", str(go), "--barrier-timeout", "90",
                                       "--max-listed", "0"],
                                   in_slice=True, env=env, stdout=subprocess.PIPE))
        pids = []
        for r in ranks:
            assert r.stdout is not None
            line = r.stdout.readline()
            assert '"ready"' in line, line
            pids.append(int(json.loads(line)["pid"]))
        go.touch()  # the job runs; the agents come later, one by one
        started = time.monotonic()
        for i in order:
            time.sleep(max(0.0, started + delays[i] - time.monotonic()))
            bed.start_agent(bed.hosts[i], db=tmp_path / f"{bed.hosts[i].name}.db",
                            trace_pid=pids[i])
        bed.wait_agents()
        time.sleep(2)
        try:
            _late_rank_found(bed, late)
            _stopped_rank_named(bed, pids, stopped)
        finally:
            for p in pids:
                with suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)


def _late_rank_found(bed: NetBed, late: int) -> None:
    since = time.time_ns()
    time.sleep(8)
    until = str(time.time_ns())
    obj = _client(bed, "collectives", "--from", str(since), "--to", until)
    [comm] = obj["communicators"]
    print("collectives:", json.dumps({k: comm[k] for k in (
        "key", "matching", "instances", "judged", "ambiguous", "op_mismatch", "alignment",
        "verdict") if k in comm}, indent=1))
    explained = _client(bed, "explain", "--from", str(since), "--to", until,
                        "--timeout", "90s")
    flagged = [(s["rank"], s["node"]) for s in explained["stragglers"]
               if s.get("metric") == "collective_arrival" and s["flagged"]]
    print("explain stragglers:", json.dumps(explained["stragglers"], indent=1))
    assert comm["matching"] == "torchrun" and comm["op_mismatch"] == 0, comm
    align = comm["alignment"]
    assert (align["method"], align["confidence"]) == ("calls", "high"), align
    assert comm["judged"] >= 50, comm
    assert flagged == [(late, f"host-{late}")], explained["stragglers"]


def _stopped_rank_named(bed: NetBed, pids: list[int], stopped: int) -> None:
    watch = _watch(bed, "--hang-after", "10s")
    time.sleep(2)
    assert watch.poll() is None, watch.communicate()
    os.kill(pids[stopped], signal.SIGSTOP)
    at = time.monotonic()
    out, err = watch.communicate(timeout=60)
    took = time.monotonic() - at
    # The verdict is the last line: live straggler events (one JSON object a line) may
    # come first while the stopped rank makes the others late.
    verdict = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
    print(f"verdict {took:.1f} s after the stop:", json.dumps(verdict, indent=1), err)
    assert watch.returncode == 6 and verdict is not None and verdict["status"] == "hang", err
    assert took <= 25
    named = [(c["rank"], c["node"], c["pid"], c["state"])
             for h in verdict["hangs"] for c in h["culprits"]]
    assert named and set(named) == {(stopped, f"host-{stopped}", pids[stopped], "stopped")}, \
        verdict
    hang = verdict["hangs"][0]
    assert {w["rank"] for w in hang["waiting"]} == set(range(RANKS)) - {stopped}, hang
    assert f"rank {stopped} (host-{stopped} pid {pids[stopped]}, stopped" in hang["summary"]
