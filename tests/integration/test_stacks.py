"""Stacks and kernel names end to end: real BPF programs, the real CUDA runtime.

The reference workload is traced with stacks on; each stacked call must carry the
workload's own Python function and line (read in the kernel from the interpreter's
frame chain), and a launch of a function from a library built here with gcc must be
named after that function's demangled symbol. The recording then goes through
``fleetd stacks --format folded`` and ``fleetd explain -v``.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from recorder import running
from test_trace import _bpf_ready  # the same requirements as the tracer's own tests
from workload_run import trace_in_process

from conftest import FLEETD, REPO

WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
PY = sys.executable
MANGLED = "_Z11gemm_kernelIfEvPT_S1_i"  # void gemm_kernel<float>(float*, float*, int)
DEMANGLED = "void gemm_kernel<float>(float*, float*, int)"


_WHY = _bpf_ready()
pytestmark = [pytest.mark.bpf, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


def _line_of(fragment: str) -> int:
    """The workload's source line holding ``fragment`` (exactly one)."""
    hits = [i for i, line in enumerate(WORKLOAD.read_text().splitlines(), 1)
            if fragment in line]
    assert len(hits) == 1, hits
    return hits[0]


def _kernel_lib(tmp: Path) -> Path:
    """A shared library whose exported function has a C++ (mangled) name."""
    src = tmp / "kern.c"
    src.write_text(f'void gemm(float *a, float *b, int n) __asm__("{MANGLED}");\n'
                   "void gemm(float *a, float *b, int n) { if (n) a[0] = b[0]; }\n")
    lib = tmp / "libkern.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return lib


def _trace(tmp: Path, wl_args: list[str], **cfg: Any) -> tuple[Path, dict[str, Any], Any]:
    go, db = tmp / "go", tmp / "stacks.db"
    with running([PY, str(WORKLOAD), "--go-file", str(go), *wl_args]) as wl:
        made, summary = trace_in_process(wl, db, "stack-node", go, **cfg)
    return db, made, summary


def _stacks_of(db: Path, op: str) -> list[list[str]]:
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT s.frames FROM events e JOIN stacks s ON s.hash = e.stack "
                         "WHERE e.op = ?", (op,)).fetchall()
    return [json.loads(r[0]) for r in rows]


def _top_python(frames: list[str]) -> str:
    return next(f for f in frames if re.search(r"\.py:\d+\)$", f))


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Any]:
    """Every kept call with its stack; the process lives long enough to be read."""
    tmp = tmp_path_factory.mktemp("stacks")
    lib = _kernel_lib(tmp)
    return _trace(tmp, ["--steps", "12", "--launches", "3", "--sleep-ms", "120",
                        "--kernel", f"{lib}:{MANGLED}"], sample=1, stack_sample=1)


def test_syncs_carry_the_workloads_function_and_line(sampled: Any) -> None:
    db, made, summary = sampled
    assert summary.lost_total == 0
    syncs = _stacks_of(db, "cudaStreamSynchronize")
    assert len(syncs) == made["calls"]["cudaStreamSynchronize"]
    want = f"Workload.step ({WORKLOAD}:{_line_of('rt.cudaStreamSynchronize(None)')})"
    assert {_top_python(f) for f in syncs} == {want}
    launches = _stacks_of(db, "cudaLaunchKernel")
    assert launches
    want = f"Workload.launch ({WORKLOAD}:{_line_of('ret: int = self.rt.cudaLaunchKernel')})"
    assert {_top_python(f) for f in launches} == {want}
    # Native frames first (the ctypes call path), then the Python frames down to main.
    frames = syncs[0]
    assert frames[-1].startswith("<module> (")
    assert any(f.startswith("main (") for f in frames)
    with sqlite3.connect(db) as c:
        dropped, targets = c.execute("SELECT dropped_stacks, targets FROM sessions").fetchone()
    assert dropped == 0
    assert json.loads(targets)["python"] == {str(made["pid"]): "CPython 3.11"}


def test_launches_are_named_after_the_demangled_host_stub(sampled: Any) -> None:
    db, made, _ = sampled
    with sqlite3.connect(db) as c:
        names = c.execute("SELECT json_extract(args, '$.kernel'), count(*) FROM events "
                          "WHERE op = 'cudaLaunchKernel' GROUP BY 1").fetchall()
    assert names == [(DEMANGLED, made["calls"]["cudaLaunchKernel"])]


def test_ops_by_kernel_names_the_launched_kernel(sampled: Any) -> None:
    db, made, _ = sampled
    out = subprocess.run([FLEETD, "ops", "--db", str(db), "--by", "kernel", "--format", "ndjson"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    by_name = {r["kernel"]: r for r in rows}
    assert set(by_name) == {DEMANGLED}
    row = by_name[DEMANGLED]
    # Every launch was stored (sample=1), so the estimate is the stored count.
    assert row["op"] == "cudaLaunchKernel" and row["stats_from"] == "events"
    assert row["count"] == row["est_calls"] == made["calls"]["cudaLaunchKernel"]
    assert row["p50_ns"] > 0


def test_folded_output_parses_as_folded_stacks(sampled: Any) -> None:
    db, made, _ = sampled
    out = subprocess.run([FLEETD, "stacks", "--db", str(db), "--format", "folded"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        assert count.isdigit() and all(frames), line
        assert frames[0].startswith("<module> (train_loop.py:")  # outermost first
        total += int(count)
    assert total == sum(made["calls"].values())
    sync = f"Workload.step (train_loop.py:{_line_of('rt.cudaStreamSynchronize(None)')})"
    assert any(line.split(";")[-1].startswith("0x") or sync in line for line in lines)
    assert any(sync in line for line in lines)


def test_stacks_min_dur_filters_calls(sampled: Any) -> None:
    db, _, _ = sampled
    out = subprocess.run([FLEETD, "stacks", "--db", str(db), "--min-dur", "10s",
                          "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["rows"] == [] and got["events_without_stack"] == 0


def test_slow_calls_carry_stacks_without_sampling(tmp_path: Path) -> None:
    """--stack-sample 0: only calls past the threshold (1 ns here: every call) are
    stacked, and kept even though ordinary launches are otherwise sampled out. A launch's
    duration is known only where its return is probed: --launch-returns (the default,
    entry-only launches, times the 1-in-N sample alone, and --sample 0 is none)."""
    db, made, summary = _trace(tmp_path, ["--steps", "6", "--launches", "2",
                                          "--sleep-ms", "150"], sample=0, stack_sample=0,
                               stack_slow_ns=1, launch_returns=True)
    assert summary.lost_total == 0
    launches = _stacks_of(db, "cudaLaunchKernel")
    assert len(launches) == made["calls"]["cudaLaunchKernel"]
    assert all(_top_python(f).startswith("Workload.launch (") for f in launches)


def test_check_reports_python_support() -> None:
    from fleetd.trace.checks import _python_check
    from fleetd.trace.enrich import pyframes

    check = _python_check()
    assert os.path.realpath(sys.executable) in check.data["interpreters"]
    assert check.data["interpreters"][os.path.realpath(sys.executable)] == "ok"
    for path, why in check.data["interpreters"].items():
        assert (why == "ok") == (pyframes.support_of(path) is None)
    assert "not supported" in (pyframes.support_of("/usr/bin/python3.9") or "")


def test_python_frames_of_every_installed_interpreter(tmp_path: Path) -> None:
    """Every CPython on the machine that fleetd supports shows its own frames."""
    from fleetd.trace.enrich import pyframes

    script = tmp_path / "sleeper.py"
    script.write_text("import time\n\ndef nap():\n    time.sleep(30)\n\nnap()\n")
    tried = 0
    for exe in pyframes.installed_interpreters():
        if pyframes.support_of(exe) is not None:
            continue
        p = subprocess.Popen([exe, str(script)])
        try:
            # Walk until the script's own frame is on top: under load the walk can land
            # while the interpreter is still importing (importlib's frames on top).
            deadline = time.monotonic() + 15
            interp, names = None, list[str]()
            while time.monotonic() < deadline and names[:1] != [f"nap ({script}:4)"]:
                time.sleep(0.1)
                interp = pyframes.find_interpreter(p.pid)
                if interp is None or not interp.runtime or interp.layout is None:
                    continue
                mem = pyframes.Memory(p.pid)
                try:
                    states = pyframes.thread_states(interp, mem)
                    names = (pyframes.walk(interp, mem, states[p.pid])
                             if p.pid in states else [])
                finally:
                    mem.close()
            assert interp is not None and interp.layout is not None, exe
        finally:
            p.kill()
            p.wait()
        assert names[:2] == [f"nap ({script}:4)", f"<module> ({script}:6)"], (exe, names)
        tried += 1
    assert tried >= 1
