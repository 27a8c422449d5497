"""A straggler flagged live, its cause named, then its recovery (issue 43.1): one real agent
on loopback (certificates from `fleetd certs`) tracing four ranks of
tests/workloads/nccl_ranks.py (the real libnccl, in lockstep over a TCP barrier), and
`fleetd watch --webhook` against it (a real local receiver checking the HMAC).

Rank 2 runs in a cgroup of its own. Healthy seconds first: nothing may be flagged. Then
its cgroup gets a CPU quota of 3% (cpu.max, a Kubernetes CPU limit set far too low): its
steps run hundreds of ms behind the others', and watch must say STRAGGLER naming rank 2
within 15 s and its CAUSE within 25 s: cpu_throttled, from the cgroup's own throttling
counters, also when every core is busy besides (the chain is asked over the straggle's
own seconds, and the quota's time is the thread's queued time while the cgroup was
throttled, not a share of a window mostly crowded before); meanwhile the agent's own
/metrics says rank 2 is the late one of its node's ranks (fleetd_rank_late_ratio) and
its process throttled (fleetd_process_throttled_ratio). Once the quota is lifted,
RECOVERED within 20 s. The receiver gets the finding firing (again when its cause came a
poll later), then resolved.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, suppress
from pathlib import Path

import pytest
from agents import Agent, Pki, agent, client_ssl, request
from test_hang_watch import (
    RANKS,
    WORKLOAD,
    _all_ranks_past,
    _by_rank,
    _wait,
    address,
    tracing,
    watch,
)
from webhook_receiver import receiver

from netbed import CpuSlices

QUOTA_CPUS = 0.03


class Lines:
    """The watch's stdout, each line with the monotonic time it was read."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.q: queue.Queue[tuple[float, str]] = queue.Queue()
        self.seen: list[tuple[float, str]] = []
        assert proc.stdout is not None
        out = proc.stdout

        def read() -> None:
            for x in out:
                self.q.put((time.monotonic(), x))
        threading.Thread(target=read, daemon=True).start()

    def wait(self, prefix: str, timeout: float) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with suppress(queue.Empty):
                t, line = self.q.get(timeout=0.2)
                self.seen.append((t, line))
                if line.startswith(prefix):
                    return t, line
        raise AssertionError(f"no {prefix} line within {timeout} s; read: {self.seen}")


@tracing
def test_a_quota_on_one_rank_is_flagged_named_and_recovers(tmp_path: Path, pki: Pki) -> None:
    slices = CpuSlices.detect()
    if slices is None:
        pytest.skip("no cgroup cpu controller")
    go, said = tmp_path / "go", tmp_path / "ranks.out"
    with ExitStack() as stack, said.open("w") as out:
        stack.callback(slices.remove_all)
        cg = slices.make(f"fleetd-test-straggle-{os.getpid()}")
        launcher = subprocess.Popen(
            [sys.executable, str(WORKLOAD), "--spawn", str(RANKS), "--seconds", "150",
             "--compute-ms", "20", "--go-file", str(go), "--barrier-timeout", "150"],
            stdout=out, text=True, start_new_session=True)
        stack.callback(launcher.wait, 20)
        stack.callback(os.killpg, launcher.pid, 9)
        _wait(lambda: '"pids"' in said.read_text(), "the ranks ready", 30)
        pids = _by_rank(__import__("json").loads(said.read_text().splitlines()[0])["pids"])
        for task in Path(f"/proc/{pids[2]}/task").iterdir():
            (cg / ("cgroup.threads" if slices.v2 else "tasks")).write_text(task.name)
        a = stack.enter_context(agent(tmp_path / "n1.db", "n1", pki,
                                      *(x for p in pids for x in ("--pid", str(p)))))
        _wait(lambda: request(a.url, client_ssl(pki))[1]["tracing"], "tracing")
        go.touch()
        _wait(lambda: _all_ranks_past(a, pki, 5), "four ranks past collective 5")
        rec = stack.enter_context(receiver())
        w = watch(pki, address(a), "--interval", "1s", "--hang-after", "30s",
                  "--webhook", rec.url)
        stack.callback(w.wait, 20)
        stack.callback(w.kill)
        lines = Lines(w)
        with pytest.raises(AssertionError, match="no STRAGGLER line"):
            print("false alarm:", lines.wait("STRAGGLER", 10))  # healthy: nothing flagged
        assert _series(a, pki, "fleetd_process_throttled_ratio") == {}  # no quota yet
        stack.callback(lambda: _quota(slices, cg, None))
        _quota(slices, cg, QUOTA_CPUS)
        onset = time.monotonic()
        t_flag, flag = lines.wait("STRAGGLER", 15)
        assert f"rank 2 (n1 pid {pids[2]})" in flag, flag
        t_cause, cause = lines.wait("CAUSE", 25)
        # Its node's top chain: throttled by its quota, on a quiet node or a busy one
        # (busy-node.sh), whose crowded seconds before the quota are no part of it.
        assert f"rank 2 (n1 pid {pids[2]})" in cause, cause
        named = re.search(r"\] (\w+):", cause)
        assert named and named.group(1) == "cpu_throttled", cause
        # The agent's own series: rank 2 the late one among its node's ranks, its process
        # throttled in most periods.
        _wait(lambda: _series(a, pki, "fleetd_rank_late_ratio").get(("rank", "2"), 0) >= 0.75,
              "fleetd_rank_late_ratio of rank 2 at 0.75 or more", 20)
        _wait(lambda: _series(a, pki, "fleetd_process_throttled_ratio").get(
            ("pid", str(pids[2])), 0) >= 0.5, "rank 2's process throttled", 20)
        late = _series(a, pki, "fleetd_rank_late_ratio")
        assert all(late[("rank", str(r))] < 0.5 for r in (0, 1, 3)), late
        _quota(slices, cg, None)
        gone = time.monotonic()
        t_back, back = lines.wait("RECOVERED (straggler)", 20)
        assert f"rank 2 (n1 pid {pids[2]})" in back, back
        print(f"flagged {t_flag - onset:.1f} s after the quota, cause {t_cause - onset:.1f} s, "
              f"recovered {t_back - gone:.1f} s after it ended")
        _wait(lambda: any(p.json()["status"] == "resolved" for p in rec.posts), "resolved", 20)
        posts = [p.json() for p in rec.posts]
        # firing (without its cause when the chain came a poll later), firing with it,
        # resolved; each once
        assert [(p["status"], p["kind"], p["rank"], p["id"]) for p in posts][-2:] == [
            ("firing", "straggler", 2, posts[0]["id"]), ("resolved", "straggler", 2,
                                                         posts[0]["id"])]
        assert len(posts) == 2 or (len(posts) == 3 and posts[0]["cause"] == "straggler")
        assert posts[-2]["cause"] == posts[-1]["cause"] == f"straggler: {named.group(1)}"
        assert posts[-1]["first_seen"] == posts[0]["first_seen"]
        assert posts[0]["evidence"] == f"{a.url}/api/v1/ranks"

def _series(a: Agent, pki: Pki, name: str) -> dict[tuple[str, str], float]:
    """The agent's samples of one gauge, keyed by (its rank or pid label, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, text = request(a.url, client_ssl(pki), path="/metrics")
    assert status == 200, text
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for smp in fam.samples:
            if smp.name == name:
                label = "rank" if "rank" in smp.labels else "pid"
                out[(label, smp.labels[label])] = smp.value
    return out


def _quota(slices: CpuSlices, cg: Path, cpus: float | None) -> None:
    """Cap the cgroup at ``cpus`` (None: lift the cap)."""
    if cpus is not None:
        slices.make(str(cg.relative_to(slices.root)), quota=cpus)
    elif slices.v2:
        (cg / "cpu.max").write_text("max\n")
    else:
        (cg / "cpu.cfs_quota_us").write_text("-1\n")
