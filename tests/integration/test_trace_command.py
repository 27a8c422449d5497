"""``fleetd trace [options] -- CMD ARGS`` (issue 44.6): the program started under the
tracer, like ``py-spy record --`` and ``nsys profile``. Real BPF, the real CUDA runtime:
every call the reference workload makes from its first one is recorded (the program is
held before its exec until the probes are in), its exit status and its death by a signal
are fleetd's, a SIGTERM to fleetd goes on to it, and mistakes are one line before anything
starts."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FLEETD, REPO, assert_one_line_error

WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
root = pytest.mark.skipif(os.geteuid() != 0, reason="tracing needs root")


def _trace(tmp: Path, *cmd: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEETD, "trace", "--db", str(tmp / "t.db"), "--node", "cmd-node",
                           "--sample", "1", "--no-host", "--summary-json", *extra, "--", *cmd],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.bpf
@pytest.mark.slow
@root
def test_a_program_started_under_the_tracer_is_traced_from_its_first_call(
        tmp_path: Path) -> None:
    r = _trace(tmp_path, sys.executable, str(WORKLOAD), "--steps", "40", "--launches", "10",
               "--memcpy", "2", "--host-syncs", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    wl, summary = json.loads(lines[0]), json.loads(lines[-1])
    with sqlite3.connect(tmp_path / "t.db") as c:
        got = dict(c.execute("SELECT op, count(*) FROM events WHERE pid = ? AND source IN "
                             "('cuda', 'graph', 'driver') GROUP BY op", (wl["pid"],)))
    assert got == wl["calls"], (got, wl["calls"])
    assert summary["lost_total"] == 0
    assert "the command exited with status 0" in r.stderr


@pytest.mark.bpf
@pytest.mark.slow
@root
@pytest.mark.parametrize(("script", "status"), [
    ("import sys; sys.exit(7)", 7),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL),
])
def test_its_exit_status_is_fleetds(tmp_path: Path, script: str, status: int) -> None:
    r = _trace(tmp_path, sys.executable, "-c", script)
    assert r.returncode == status, r.stderr[-2000:]
    assert f"the command exited with status {status}" in r.stderr


@pytest.mark.bpf
@pytest.mark.slow
@root
def test_a_sigterm_to_fleetd_goes_on_to_the_program(tmp_path: Path) -> None:
    marker = tmp_path / "got-term"
    prog = ("import signal, sys, time\n"
            "def bye(*_):\n"
            f"    open({str(marker)!r}, 'w').write('term'); sys.exit(3)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "time.sleep(120)\n")
    p = subprocess.Popen([FLEETD, "trace", "--db", str(tmp_path / "t.db"), "--no-host", "--",
                          sys.executable, "-c", prog], stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    deadline = time.monotonic() + 120
    seen = ""
    while "fleetd: tracing" not in seen and time.monotonic() < deadline:
        seen += p.stderr.readline()
    assert "fleetd: tracing" in seen, seen
    time.sleep(1)  # the program past its exec
    p.send_signal(signal.SIGTERM)
    rest = p.communicate(timeout=60)[1]
    assert marker.read_text() == "term"
    assert p.returncode == 3, seen + rest
    assert "the command exited with status 3" in rest


@pytest.mark.parametrize(("args", "says"), [
    (["--", "no-such-program-fleetd"], "'no-such-program-fleetd' not found"),
    (["--pid", "1", "--", "true"], "with --pid/--cgroup"),
])
def test_command_mistakes_are_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    r = subprocess.run([FLEETD, "trace", "--db", str(tmp_path / "t.db"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert_one_line_error(r, says)
    assert not (tmp_path / "t.db").exists()


@pytest.mark.bpf
@pytest.mark.slow
@root
def test_python_frames_are_read_from_the_program_not_from_fleetd(tmp_path: Path) -> None:
    """The program is forked from fleetd (a Python process) and then execs: its frames
    must be read from the new image, not from the fork's copy of fleetd's interpreter."""
    r = subprocess.run([FLEETD, "trace", "--db", str(tmp_path / "t.db"), "--node", "cmd-node",
                        "--no-host", "--cpu-sample-hz", "199", "--", sys.executable,
                        str(WORKLOAD), "--duration", "4", "--gil-thread", "--launches", "5"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    folded = subprocess.run([FLEETD, "profile", "--db", str(tmp_path / "t.db"), "--format",
                             "folded"], capture_output=True, text=True, timeout=120)
    assert folded.returncode == 0, folded.stderr
    assert "train_loop.py:" in folded.stdout, folded.stdout[:2000]
