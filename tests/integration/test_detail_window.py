"""Launch detail on demand (#36): an agent in ``--mode always-on`` traces launches 1 s in
10; ``POST /api/v1/detail?seconds=N`` opens a window at once. Real agent, real BPF, the
real CUDA runtime, real TLS. Opening one is a permission of the clients the agent's
fleetd.yaml names, within an hourly budget (#40).

With ``--sample 1`` every launch whose return is taken is stored, so stored launches
show when the launch probes were on: the first second of the period, then the asked-for
window, and nothing in between.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agents import Pki, agent, client_ssl, request
from workload_run import running_workload

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="tracing needs root")]


def _config(d: Path, per_hour_s: float = 360) -> str:
    """A fleetd.yaml that lets the client certificate "laptop" open windows."""
    path = d / "fleetd.yaml"
    path.write_text(f"detail:\n  clients: [laptop]\n  max_s_per_hour: {per_hour_s}\n")
    return str(path)


@pytest.fixture
def workload(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A steady stream of launches (~100 per 10 ms step) for up to a minute."""
    with running_workload(tmp_path / "go", "--duration", "60", "--launches", "20",
                          "--cpu-us", "50", "--gpu-ms", "5") as proc:
        yield proc


def _wait_tracing(url: str, pki: Pki) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, health, _ = request(url, client_ssl(pki))
        if status == 200 and health["tracing"]:
            return
        time.sleep(0.1)
    raise AssertionError("the agent never started tracing")


def _launch_times(db: Path) -> list[int]:
    with sqlite3.connect(db) as c:
        return [r[0] for r in c.execute(
            "SELECT ts_ns FROM events WHERE op = 'cudaLaunchKernel' ORDER BY ts_ns")]


def test_a_window_asked_for_traces_launches_at_once(
        tmp_path: Path, pki: Pki, workload: subprocess.Popen[str]) -> None:
    db = tmp_path / "gpu-01.db"
    ssl = client_ssl(pki)
    with agent(db, "gpu-01", pki, "--pid", str(workload.pid), "--sample", "1",
               "--mode", "always-on", "--cpu-sample-hz", "0",
               "--config", _config(tmp_path)) as a:
        _wait_tracing(a.url, pki)
        (tmp_path / "go").touch()
        time.sleep(3.0)  # past the first period's second of launch probes
        status, bad, _ = request(a.url, ssl, "POST", "/api/v1/detail?seconds=0")
        assert status == 400 and "seconds='0'" in bad["error"]["message"], bad
        asked = time.time_ns()
        status, reply, _ = request(a.url, ssl, "POST", "/api/v1/detail?seconds=4")
        assert status == 200 and reply["opened"] is True, reply
        time.sleep(5.0)
    times = _launch_times(db)
    inside = [t for t in times if asked + 300_000_000 <= t <= asked + 3_700_000_000]
    before = [t for t in times if times[0] + 1_500_000_000 <= t < asked - 200_000_000]
    assert before == [], "launch probes were on between the period's second and the ask"
    # the window: launches all through it, no gap longer than a few steps
    assert len(inside) > 50, (len(times), len(inside))
    gaps = [b - a for a, b in zip(inside, inside[1:], strict=False)]
    assert max(gaps) < 300_000_000, max(gaps)


def test_full_mode_says_no_window_is_needed(tmp_path: Path, pki: Pki,
                                            workload: subprocess.Popen[str]) -> None:
    db = tmp_path / "gpu-01.db"
    with agent(db, "gpu-01", pki, "--pid", str(workload.pid), "--cpu-sample-hz", "0",
               "--config", _config(tmp_path)) as a:
        _wait_tracing(a.url, pki)
        status, reply, _ = request(a.url, client_ssl(pki), "POST", "/api/v1/detail?seconds=5")
    assert status == 200 and reply["opened"] is False and "--mode full" in reply["why"], reply


def test_windows_are_a_permission_within_an_hourly_budget(
        tmp_path: Path, pki: Pki, workload: subprocess.Popen[str]) -> None:
    db = tmp_path / "gpu-01.db"
    with agent(db, "gpu-01", pki, "--pid", str(workload.pid), "--mode", "always-on",
               "--cpu-sample-hz", "0", "--config", _config(tmp_path, per_hour_s=8)) as a:
        _wait_tracing(a.url, pki)
        laptop, desk = client_ssl(pki, "laptop"), client_ssl(pki, "desk")
        status, no, _ = request(a.url, desk, "POST", "/api/v1/detail?seconds=5")
        assert status == 403 and no["error"]["code"] == "forbidden", no
        assert "cert:desk may not open launch-detail windows" in no["error"]["message"], no
        assert "detail.clients" in no["error"]["hint"], no
        status, first, _ = request(a.url, laptop, "POST", "/api/v1/detail?seconds=5")
        assert status == 200 and first["opened"] is True and first["seconds"] == 5, first
        assert first["budget"]["per_hour_s"] == 8 and 2.9 <= first["budget"][
            "remaining_s"] <= 3.0, first
        # More than is left: cut to the budget (the 5 s open plus the 3 s left).
        status, cut, _ = request(a.url, laptop, "POST", "/api/v1/detail?seconds=60")
        assert status == 200 and cut["opened"] is True and cut["asked"] == 60, cut
        assert 7 <= cut["seconds"] <= 8 and "cut to" in cut["why"], cut
        assert cut["budget"]["remaining_s"] == 0, cut
        # Inside the open window: costs nothing. Past it: nothing is left.
        status, inside, _ = request(a.url, laptop, "POST", "/api/v1/detail?seconds=2")
        assert status == 200 and inside["opened"] is True, inside
        status, spent, _ = request(a.url, laptop, "POST", "/api/v1/detail?seconds=20")
        assert status == 403 and "budget is spent" in spent["error"]["message"], spent
        assert "8 of 8 s" in spent["error"]["message"], spent
    log = a.log.read_text()
    assert "launch detail opened for cert:laptop: " in log and "(asked 5)" in log, log
    assert "(asked 60)" in log and "launch detail refused to cert:desk" in log, log
