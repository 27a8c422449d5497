"""`fleetd demo`, the README's first command: three real agents on loopback, mTLS, eBPF.

It must name node-3 (whose CPU it shares with a busy loop) as the straggler with the hog
as culprit, and the NCCL job's rank on node-3 as the late rank, write a timeline that
validates and a merged database of the three nodes,
and leave nothing running, also when interrupted.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from perfetto_check import load, validate

from conftest import FLEETD

pytestmark = [pytest.mark.bpf, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the demo traces: needs root")]


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_demo_names_the_straggler_and_writes_its_files(tmp_path: Path) -> None:
    # A fresh header cache, as on a new machine: the three agents build it at once.
    env = {**os.environ, "FLEETD_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([FLEETD, "demo", "--dir", str(tmp_path / "d"), "--out", str(tmp_path),
                           "--duration", "8s"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    (tmp_path / "demo.out").write_text(out)
    assert "STRAGGLER node-3" in out, out[-3000:]
    # The NCCL job's rank on node-3 arrives last at the collectives, for the same reason.
    assert "STRAGGLER rank 2 on node-3" in out, out[-3000:]
    section = out[out.index("STRAGGLER rank 2 on node-3"):]
    assert "culprit cpu-hog" in section.splitlines()[1]
    assert "[HIGH] cpu_contention on node-3" in out
    assert "culprit: cpu-hog" in out
    summary = out[out.rindex("Summary ("):].rstrip("\n").splitlines()
    assert len(summary) <= 12, summary
    assert "straggler: rank 2 on node-3" in summary[1], summary
    assert any(line.startswith("  node-3: [HIGH] cpu_contention, culprit cpu-hog")
               for line in summary), summary
    assert (tmp_path / "fleet-demo-explain.json").exists()
    s = validate(load(tmp_path / "fleet-demo.json"))
    # Each node's track names the rank it ran (torchrun's RANK of its processes).
    assert sorted(s.processes.values()) == ["node-1 (rank 0)", "node-2 (rank 1)",
                                            "node-3 (rank 2)"]
    with sqlite3.connect(f"file:{tmp_path / 'fleet-demo.db'}?mode=ro", uri=True) as c:
        nodes = [r[0] for r in c.execute("SELECT DISTINCT node FROM events ORDER BY 1")]
    assert nodes == ["node-1", "node-2", "node-3"]


def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    proc = subprocess.Popen([FLEETD, "demo", "--dir", str(tmp_path / "d"), "--out",
                             str(tmp_path), "--duration", "60s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    seen = ""
    assert proc.stdout is not None
    while time.monotonic() < deadline and "[3/7]" not in seen:
        seen += proc.stdout.readline()
    assert "[3/7]" in seen, seen
    kids = _children_of(proc.pid)
    assert len(kids) >= 10  # 3 workloads, 3 ranks, the hog, 3 agents
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert [k for k in kids if Path(f"/proc/{k}").exists()] == []
    assert not (tmp_path / "fleet-demo.db").exists()
