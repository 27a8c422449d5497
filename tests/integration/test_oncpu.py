"""On-CPU samples, live with real BPF: what the feeding thread does while it runs.

The reference loop (the real CUDA runtime: without a GPU every call fails fast and the
probes still fire) traced with the sampler at its default rate, on this venv's CPython
(pyenv 3.11, no USDT: GC is read from the interpreter's state at each sample):

* in a process with a large dict index and a growing history the collector runs full
  collections between launches: a ``gc_pause`` chain naming the thread, its pauses and
  their share; the same loop with ``gc.freeze()`` and a bounded history: none;
* spinning in a known pure-Python function before each launch: ``host_cpu_bound`` with
  that function as the top frame and at least half of the samples, and the folded
  profile holds its stack;
* the quiet reference loop: neither;
* the GC case on pyenv's 3.10, 3.12 and 3.13 (sampled) and on Debian's 3.11, whose
  USDT probes measure each pause and its generation.

The sampler's own accounting (samples x period / wall) is checked against the
breakdown's running share of the same thread.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agents import Pki, agent
from cpu_first import first_on_cpu
from recorder import joining, wait_for_libcudart

from conftest import FLEETD, REPO

sys.path.insert(0, str(REPO / "tests" / "workloads"))
from train_loop import find_cudart  # noqa: E402

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="BPF needs root")]

PY = sys.executable
TRAIN = REPO / "tests" / "workloads" / "train_loop.py"
GC_LOOP = REPO / "tests" / "workloads" / "gc_loop.py"
QUIET = ["--launches", "8", "--memcpy", "1", "--gpu-ms", "4"]
SPIN = ["--launches", "8", "--memcpy", "1", "--cpu-us", "2000"]  # 2 ms of Python per launch


def trace_live(tmp_path: Path, argv: list[str], seconds: int = 8,
               python: str = PY, node: str | None = None) -> tuple[Path, int]:
    """Run a workload, trace it for ``seconds`` with the defaults; the database and the
    workload's pid. Both run in a cgroup that comes first on the CPU (tests/cpu_first.py):
    a pause is estimated from the collector's consecutive samples, and a thread that a
    busy node's loops preempt mid-collection is sampled in pieces (its longest pause read
    as 41 ms under busy-node.sh against the 100 ms it takes alone)."""
    with first_on_cpu() as group:
        return _trace_in(group, tmp_path, argv, seconds, python, node)


def _trace_in(group: Path, tmp_path: Path, argv: list[str], seconds: int, python: str,
              node: str | None) -> tuple[Path, int]:
    go, db = tmp_path / "go", tmp_path / "t.db"
    wl = subprocess.Popen([python, *argv, "--duration", str(seconds + 30), "--go-file",
                           str(go)], stdout=subprocess.DEVNULL, text=True,
                          preexec_fn=joining([group]))
    try:
        wait_for_libcudart(wl.pid)
        tr = subprocess.Popen([FLEETD, "trace", "--pid", str(wl.pid), "--db", str(db),
                               "--duration", f"{seconds}s", "--summary-json",
                               *(["--node", node] if node else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=joining([group]))
        assert tr.stderr is not None
        for line in tr.stderr:
            if line.startswith("fleetd: tracing"):
                go.touch()
                break
        out, err = tr.communicate(timeout=120)
        assert tr.returncode == 0, err
        summary = json.loads(out)
        # No sample lost, and the sample counts the tracer made are accounted for.
        assert summary["lost"]["cpu"] == 0 and summary["unreported_loss"] == 0, summary
        assert summary["made_in_user_space"] > 0, summary
    finally:
        wl.kill()
        wl.wait()
    return db, wl.pid


def fleetd(*args: str) -> str:
    r = subprocess.run([FLEETD, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def explain(db: Path) -> dict[str, Any]:
    return dict(json.loads(fleetd("explain", "--db", str(db), "--format", "json")))


def chains(report: dict[str, Any], root: str) -> list[dict[str, Any]]:
    return [c for c in report["chains"] if c["root_cause"] == root]


def thread_row(report: dict[str, Any], tid: int) -> dict[str, Any]:
    return next(t for p in report["processes"] for t in p["threads"] if int(t["tid"]) == tid)


def sampled_share(db: Path, tid: int, wall_ns: int) -> float:
    prof = json.loads(fleetd("profile", "--db", str(db), "--tid", str(tid), "--format", "json"))
    return float(prof["on_cpu_ns"]) / wall_ns


def test_gc_pauses_between_launches_are_a_gc_pause_chain(tmp_path: Path) -> None:
    db, pid = trace_live(tmp_path, [str(GC_LOOP), *QUIET])
    report = explain(db)
    [ch] = chains(report, "gc_pause")
    assert ch["victim"]["pid"] == pid and ch["victim"]["tid"] == pid, ch["victim"]
    d = ch["detail"]
    # Full collections over the 300k-item index take ~100 ms and more on this machine.
    assert d["pauses"] >= 2 and d["longest_ns"] >= 50_000_000, d
    assert d["gc_samples"] >= 3 and d["gc_share"] >= 0.02, d
    # The share it states is its own samples' time over the wall.
    t = thread_row(report, pid)
    assert ch["impact"] == pytest.approx(d["gc_samples"] * d["period_ns"] / t["wall_ns"],
                                         abs=0.01)
    assert f"{ch['impact']:.1%} of wall" in ch["summary"]
    assert "gc.freeze()" in ch["fixes"][0]
    assert "gc_loop.py" in json.dumps(d["triggers"]), d["triggers"]
    # The sampler and the scheduler agree on how long the thread ran.
    assert sampled_share(db, pid, int(t["wall_ns"])) == pytest.approx(
        int(t["running_ns"]) / int(t["wall_ns"]), abs=0.1)
    folded = fleetd("profile", "--db", str(db), "--pid", str(pid), "--format", "folded")
    assert any(line.split(";")[-1].startswith("[garbage collection] ")
               for line in folded.splitlines()), folded[:2000]


def _interpreters() -> list[Any]:
    """pyenv's other CPythons (their GC state at other offsets, 3.13's from
    _Py_DebugOffsets) and Debian's 3.11. One the machine lacks is a plain skip, as in
    test_pyversions.py: an image without it is reported, not a failure."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    out = []
    for v in ("3.10", "3.12", "3.13"):
        hits = sorted(glob.glob(f"{root}/versions/{v}.*/bin/python{v}"))
        out.append(pytest.param(hits[-1], id=v) if hits else pytest.param(
            v, id=v, marks=pytest.mark.skip(reason=f"no pyenv CPython {v} here")))
    debian = "/usr/bin/python3.11"
    out.append(pytest.param(debian, id="debian-3.11") if os.access(debian, os.X_OK) else
               pytest.param(debian, id="debian-3.11",
                            marks=pytest.mark.skip(reason="no Debian python3.11 here")))
    return out


@pytest.mark.parametrize("python", _interpreters())
def test_gc_pauses_on_other_interpreters(tmp_path: Path, python: str) -> None:
    """The collector's state read at every sample on each interpreter fleetd follows."""
    db, pid = trace_live(tmp_path, [str(GC_LOOP), *QUIET, "--cudart", find_cudart()],
                         seconds=6, python=python)
    report = explain(db)
    [ch] = chains(report, "gc_pause")
    assert ch["victim"]["tid"] == pid and ch["detail"]["longest_ns"] >= 50_000_000, ch
    assert "gc_loop.py" in json.dumps(ch["detail"]["triggers"]), ch["detail"]
    if python.startswith("/usr/bin/"):
        # Debian's CPython has the gc__start/gc__done probes: pauses measured, with their
        # generation (the full collections over the index: 2).
        assert ch["detail"]["measured"] == "usdt" and ch["detail"]["generation"] == 2, ch
        assert all(p["samples"] == 0 and p["generation"] >= 0
                   for p in ch["evidence"][0]["pauses"]), ch["evidence"][0]
    else:
        assert ch["detail"]["measured"] == "samples", ch["detail"]


def test_gc_freeze_and_a_bounded_history_leave_no_gc_pause(tmp_path: Path) -> None:
    db, _ = trace_live(tmp_path, [str(GC_LOOP), "--gc-freeze", *QUIET])
    report = explain(db)
    assert chains(report, "gc_pause") == [], report["chains"]
    assert chains(report, "host_cpu_bound") == [], report["chains"]


def test_a_python_hot_loop_between_launches_is_host_cpu_bound(tmp_path: Path, pki: Pki) -> None:
    db, pid = trace_live(tmp_path, [str(TRAIN), *SPIN], node="oncpu-1")
    report = explain(db)
    [ch] = chains(report, "host_cpu_bound")
    assert ch["victim"]["tid"] == pid
    top = ch["detail"]["top_frames"][0]
    assert top["frame"].startswith("Workload._cpu (train_loop.py:"), ch["detail"]
    assert top["share"] >= 0.5, top
    # Most of the time it could run (a crowded machine queues it: that is another chain's).
    assert ch["detail"]["host_share_of_runnable"] >= 0.5 and ch["severity"] == "HIGH", ch
    t = thread_row(report, pid)
    share = sampled_share(db, pid, int(t["wall_ns"]))
    assert share == pytest.approx(int(t["running_ns"]) / int(t["wall_ns"]), abs=0.1)
    assert chains(report, "gc_pause") == []
    folded = fleetd("profile", "--db", str(db), "--pid", str(pid), "--format", "folded")
    stack = [ln for ln in folded.splitlines()
             if ";Workload.step (train_loop.py:" in ln and ";Workload._cpu (train_loop.py:" in ln]
    assert stack, folded[:2000]
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in stack) >= 0.5 * sum(
        int(ln.rsplit(" ", 1)[1]) for ln in folded.splitlines())
    table = fleetd("profile", "--db", str(db), "--pid", str(pid))
    assert "Workload._cpu (train_loop.py:" in table
    # The same profile from the node's agent (GET /api/v1/cpu_stacks, over mTLS).
    cert, key = pki.pair("laptop")
    with agent(db, "oncpu-1", pki, "--no-trace") as a:
        got = fleetd("profile", "--nodes", "oncpu-1=" + a.url.removeprefix("https://"),
                     "--ca-cert", str(pki.ca), "--client-cert", str(cert), "--client-key",
                     str(key), "--pid", str(pid), "--format", "folded")
    assert sorted(got.splitlines()) == sorted(folded.splitlines())


def test_the_quiet_loop_is_neither(tmp_path: Path) -> None:
    db, pid = trace_live(tmp_path, [str(TRAIN), *QUIET])
    report = explain(db)
    assert chains(report, "gc_pause") == [] and chains(report, "host_cpu_bound") == [], \
        report["chains"]
    prof = json.loads(fleetd("profile", "--db", str(db), "--pid", str(pid), "--format", "json"))
    assert prof["samples"] > 0  # it ran a little, and was sampled
