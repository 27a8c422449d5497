"""Probes before the first call, and runtimes inside other files (issue #41, points 2-3).

One ``fleetd trace`` follows two named processes, both started before it and both
waiting for a go file: a Python process that dlopens a copy of the real libcudart only
after the tracer says ``tracing`` (a copy under an auditwheel-style name, in a directory
fleetd never searches: nothing was probed on that file before the process mapped it),
and a launcher that, once told to go, starts the rest (all of them started after the
tracer and calling at once):

- a C program linked against the venv's ``libcudart_static.a`` (no libcudart.so mapped);
- a Python process that dlopens another fresh copy and calls at once;
- the same C program, stripped: its runtime cannot be probed, and fleetd must say so.

Every call each process made must be recorded (they fail fast without a GPU and the
probes still fire), and the stripped one named in a warning that says the driver layer
is still traced.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetd.trace.host.libs import exported_functions

from conftest import REPO

SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
    "site-packages" / "nvidia" / "cuda_runtime" / "lib"
CUDART = SITE / "libcudart.so.12"
STATIC = SITE / "libcudart_static.a"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF)"
    if not CUDART.exists() or not STATIC.exists():
        return "needs the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12, libcudart_static.a)"
    if shutil.which("cc") is None:
        return "needs a C compiler"
    return None


_WHY = _why_not()
pytestmark = [pytest.mark.bpf, pytest.mark.timeout(600),
              pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

# A Python process that waits for GO (if given), dlopens LIB and calls the runtime.
DLOPENER = r"""
import ctypes, json, os, sys, time
lib, go, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
while go != "-" and not os.path.exists(go):
    time.sleep(0.002)
rt = ctypes.CDLL(lib)
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p,
                                ctypes.c_size_t, ctypes.c_void_p]
buf = ctypes.create_string_buffer(64)
for _ in range(n):
    rt.cudaLaunchKernel(ctypes.cast(rt.cudaLaunchKernel, ctypes.c_void_p), Dim3(8, 1, 1),
                        Dim3(32, 1, 1), None, 0, None)
    rt.cudaMemcpy(buf, buf, 64, 1)
rt.cudaDeviceSynchronize()
print(json.dumps({"pid": os.getpid(), "calls": {"cudaLaunchKernel": n, "cudaMemcpy": n,
                                                 "cudaDeviceSynchronize": 1}}), flush=True)
"""


def _build(tmp: Path) -> tuple[Path, Path]:
    exe = tmp / "static_cudart"
    subprocess.run(["cc", "-O1", "-o", str(exe), str(REPO / "tests/workloads/static_cudart.c"),
                    str(STATIC), "-lpthread", "-ldl", "-lrt"], check=True, timeout=120)
    stripped = tmp / "static_cudart_stripped"
    shutil.copy(exe, stripped)
    subprocess.run(["strip", str(stripped)], check=True, timeout=60)
    return exe, stripped


def _copy(tmp: Path, name: str) -> Path:
    """A fresh inode of the real runtime under a vendored name, where fleetd never looks."""
    d = tmp / name
    d.mkdir()
    out = d / "libcudart-1a2b3c4d.so.12"
    shutil.copy(CUDART, out)
    return out


def _counts(db: Path, pid: int) -> dict[str, int]:
    with sqlite3.connect(db) as c:
        return dict(c.execute("SELECT op, count(*) FROM events WHERE pid = ? AND "
                              "source = 'cuda' GROUP BY op", (pid,)).fetchall())


def _until_tracing(tracer: subprocess.Popen[str]) -> list[str]:
    """The tracer's stderr lines up to ``fleetd: tracing`` (it has ended if it never says)."""
    assert tracer.stderr is not None
    lines: list[str] = []
    while not any("fleetd: tracing" in ln for ln in lines):
        line = tracer.stderr.readline()
        assert line, "".join(lines)
        lines.append(line)
    return lines


def test_calls_counted_from_the_first_one(tmp_path: Path) -> None:
    exe, stripped = _build(tmp_path)
    late_lib, child_lib = _copy(tmp_path, "late"), _copy(tmp_path, "child")
    go, db, outs = tmp_path / "go", tmp_path / "t.db", tmp_path / "outs"
    outs.mkdir()
    py = sys.executable
    late = subprocess.Popen([py, "-c", DLOPENER, str(late_lib), str(go), "300"],
                            stdout=subprocess.PIPE, text=True)
    # The launcher: once told to go, starts three processes that call at once.
    script = (f"while [ ! -e {go} ]; do sleep 0.01; done; "
              f"{exe} 40 25 3 > {outs}/static.json & "
              f"{py} -c '{DLOPENER}' {child_lib} - 300 > {outs}/child.json & "
              f"{stripped} 5 4 1 > {outs}/stripped.json & wait")
    launcher = subprocess.Popen(["sh", "-c", script])
    tracer = subprocess.Popen(
        [str(REPO / ".venv/bin/fleetd"), "trace", "--pid", str(late.pid), "--pid",
         str(launcher.pid), "--db", str(db), "--sample", "1", "--node", "first-call",
         "--summary-json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert tracer.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = tracer.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "fleetd: tracing" in line:
                break
        assert any("fleetd: tracing" in ln for ln in lines), "".join(lines)
        go.touch()
        out, _ = late.communicate(timeout=120)
        assert launcher.wait(timeout=120) == 0
        summary, err = tracer.communicate(timeout=120)  # the targets exited: it stops itself
    finally:
        for p in (late, launcher, tracer):
            if p.poll() is None:
                p.kill()
                p.wait()
    err = "".join(lines) + err
    made = {"late dlopen": json.loads(out),
            "static runtime": json.loads((outs / "static.json").read_text()),
            "started after, at once": json.loads((outs / "child.json").read_text())}
    for what, m in made.items():
        got = _counts(db, m["pid"])
        assert got == m["calls"], (what, got, m["calls"], err[-3000:])
    # The stripped program: nothing of its runtime recorded, and said so, by pid.
    hidden = json.loads((outs / "stripped.json").read_text())
    assert _counts(db, hidden["pid"]) == {}
    warned = [ln for ln in err.splitlines() if str(stripped) in ln]
    assert warned and f"pid {hidden['pid']}" in warned[0], err[-3000:]
    assert "driver layer (libcuda) is still traced" in warned[0]
    with sqlite3.connect(db) as c:
        targets = json.loads(c.execute("SELECT targets FROM sessions").fetchone()[0])
    mapping = targets["mapping"]
    assert mapping["hook"] == "hold" and mapping["late"] == 0, mapping
    assert mapping["held"] >= 3, mapping  # the late dlopen, the child's, the static exec
    assert str(stripped) in targets["hidden_runtimes"]
    assert json.loads(summary)["mapping"]["held"] == mapping["held"]
    kinds = {(Path(lib["path"]).name, lib["kind"]) for lib in targets["libraries"]}
    assert {("libcudart-1a2b3c4d.so.12", "cudart"), ("static_cudart", "cudart")} <= kinds


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_killed_tracer_leaves_no_process_stopped(tmp_path: Path) -> None:
    """The kernel stops a target that maps an unknown file; if the tracer dies before it
    resumes it (here: stopped, then SIGKILL), its releaser does."""
    lib, go = _copy(tmp_path, "fresh"), tmp_path / "go"
    target = subprocess.Popen([sys.executable, "-c", DLOPENER, str(lib), str(go), "10"],
                              stdout=subprocess.PIPE, text=True)
    tracer = subprocess.Popen(
        [str(REPO / ".venv/bin/fleetd"), "trace", "--pid", str(target.pid), "--db",
         str(tmp_path / "t.db"), "--node", "killed"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _until_tracing(tracer)
        tracer.send_signal(19)  # SIGSTOP: the tracer cannot resume anyone now
        go.touch()
        deadline = time.monotonic() + 30
        while _state(target.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(target.pid) == "T", "the mapping did not stop the target"
        tracer.kill()
        tracer.wait(30)
        t = time.monotonic()
        out, _ = target.communicate(timeout=120)  # resumed by the releaser, and done
        print(f"resumed and done {time.monotonic() - t:.1f} s after the kill")
        assert target.returncode == 0 and json.loads(out)["calls"]["cudaMemcpy"] == 10
    finally:
        for p in (target, tracer):
            if p.poll() is None:
                p.kill()
                p.wait()


# A Python process with the runtime loaded and initialised before any tracer starts, that
# waits for GO, launches libc's abs N times and exits.
LAUNCH_AND_EXIT = r"""
import ctypes, os, sys, time
lib, go, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rt, libc = ctypes.CDLL(lib), ctypes.CDLL(None)
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p,
                                ctypes.c_size_t, ctypes.c_void_p]
count = ctypes.c_int(0)
rt.cudaGetDeviceCount(ctypes.byref(count))  # whatever the runtime maps, mapped now
stub = ctypes.cast(libc.abs, ctypes.c_void_p)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.002)
for _ in range(n):
    rt.cudaLaunchKernel(stub, Dim3(8, 1, 1), Dim3(32, 1, 1), None, 0, None)
"""


def test_launches_drained_after_the_process_exited_keep_their_kernel_names(
        tmp_path: Path) -> None:
    """A loaded tracer drains a short job's launches after the job has gone (the GPU
    check's stand-in path, 2 runs in 5 under busy-node.sh): here the tracer is stopped
    while the job launches and exits, and resumed only once /proc/PID is gone. Every
    launch is recorded with its kernel's name, from the job's mappings as the tracer
    read them at start and the library on disk."""
    go, db, n = tmp_path / "go", tmp_path / "t.db", 200
    job = subprocess.Popen([sys.executable, "-c", LAUNCH_AND_EXIT, str(CUDART), str(go),
                            str(n)], stdout=subprocess.PIPE, text=True)
    assert job.stdout is not None and job.stdout.readline().strip() == "ready"
    tracer = subprocess.Popen(
        [str(REPO / ".venv/bin/fleetd"), "trace", "--pid", str(job.pid), "--db", str(db),
         "--sample", "1", "--node", "after-exit"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = _until_tracing(tracer)
        exited, err = _go_while_stopped(tracer, go, job)
    finally:
        _kill(job, tracer)
    assert exited == 0 and not Path(f"/proc/{job.pid}").exists()
    names = _kernel_names(db, job.pid)
    assert names == {"abs": n}, (names, ("".join(lines) + err)[-3000:])


def _go_while_stopped(tracer: subprocess.Popen[str], go: Path, job: subprocess.Popen[str]
                      ) -> tuple[int, str]:
    """Stop the tracer (SIGSTOP: nothing read or drained), let the job go and wait for
    it to end, then resume the tracer and wait for it to stop itself (its targets have
    exited): the job's exit code and the tracer's stderr."""
    tracer.send_signal(19)
    go.touch()
    exited = job.wait(timeout=120)
    tracer.send_signal(18)
    _, err = tracer.communicate(timeout=180)
    return exited, err


def _kill(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _kernel_names(db: Path, pid: int) -> dict[str, int]:
    with sqlite3.connect(db) as c:
        return dict(c.execute(
            "SELECT coalesce(json_extract(args, '$.kernel'), '(none)'), count(*) FROM events "
            "WHERE pid = ? AND op = 'cudaLaunchKernel' GROUP BY 1", (pid,)).fetchall())


class _PerfAttr(ctypes.Structure):
    # struct perf_event_attr up to config2 (PERF_ATTR_SIZE_VER1), the rest zero.
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32),
                ("config", ctypes.c_uint64), ("sample_period", ctypes.c_uint64),
                ("sample_type", ctypes.c_uint64), ("read_format", ctypes.c_uint64),
                ("flags", ctypes.c_uint64), ("wakeup_events", ctypes.c_uint32),
                ("bp_type", ctypes.c_uint32), ("config1", ctypes.c_uint64),
                ("config2", ctypes.c_uint64)]


def _other_tracers_uprobe(path: Path, offset: int) -> int:
    """A uprobe at ``path``:``offset`` opened the way any other tracer would (perf's
    uprobe PMU, no reference counter), held until its descriptor is closed."""
    libc = ctypes.CDLL(None, use_errno=True)
    name = ctypes.create_string_buffer(os.fsencode(path))
    attr = _PerfAttr(type=int(Path("/sys/bus/event_source/devices/uprobe/type").read_text()),
                     size=ctypes.sizeof(_PerfAttr), config1=ctypes.addressof(name),
                     config2=offset, flags=1)  # disabled: it only has to exist
    nr = {"x86_64": 298, "aarch64": 241}[os.uname().machine]
    fd = int(libc.syscall(nr, ctypes.byref(attr), -1, 0, -1, 8))  # PERF_FLAG_FD_CLOEXEC
    assert fd >= 0, os.strerror(ctypes.get_errno())
    return fd


def test_per_symbol_uprobes_on_the_runtime_count_every_call(tmp_path: Path) -> None:
    """The ladder's lower rung (FLEETD_NO_UPROBE_MULTI=1: one uprobe per symbol) on the
    wheel's libcudart while another tracer probes its cudaLaunchKernel. BCC's Python
    binding left libbcc's reference-counter argument to chance, and the kernel refused
    a probe whose counter differed from the other one's (EINVAL): no launch counted."""
    go, db, n = tmp_path / "go", tmp_path / "t.db", 150
    offset = exported_functions(str(CUDART), frozenset({"cudaLaunchKernel"})).offsets[
        "cudaLaunchKernel"]
    other = _other_tracers_uprobe(CUDART, offset)
    job = subprocess.Popen([sys.executable, "-c", DLOPENER, str(CUDART), str(go), str(n)],
                           stdout=subprocess.PIPE, text=True)
    tracer = subprocess.Popen(
        [str(REPO / ".venv/bin/fleetd"), "trace", "--pid", str(job.pid), "--db", str(db),
         "--sample", "1", "--node", "per-symbol", "--layers", "cuda"],
        env={**os.environ, "FLEETD_NO_UPROBE_MULTI": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = _until_tracing(tracer)
        go.touch()
        out, _ = job.communicate(timeout=120)
        _, err = tracer.communicate(timeout=120)
    finally:
        os.close(other)
        for p in (job, tracer):
            if p.poll() is None:
                p.kill()
                p.wait()
    err = "".join(lines) + err
    made = json.loads(out)
    assert _counts(db, made["pid"]) == made["calls"], err[-3000:]
    with sqlite3.connect(db) as c:
        targets = json.loads(c.execute("SELECT targets FROM sessions").fetchone()[0])
    runtimes = [lib for lib in targets["libraries"] if lib["path"].endswith(CUDART.name)]
    assert runtimes and {lib["via"] for lib in runtimes} == {"perf"}, runtimes
    assert "failed to attach" not in err, err[-3000:]


# A Python process that loads the runtime, launches libc's abs N times at once and exits,
# printing its pid first (it is gone before anyone could read its maps).
LAUNCH_AT_ONCE = r"""
import ctypes, os, sys
print(os.getpid(), flush=True)
rt, libc = ctypes.CDLL(sys.argv[1]), ctypes.CDLL(None)
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p,
                                ctypes.c_size_t, ctypes.c_void_p]
stub = ctypes.cast(libc.abs, ctypes.c_void_p)
for _ in range(int(sys.argv[2])):
    rt.cudaLaunchKernel(stub, Dim3(8, 1, 1), Dim3(32, 1, 1), None, 0, None)
"""


def test_a_process_started_after_the_tracer_that_exits_at_once_keeps_its_kernel_names(
        tmp_path: Path) -> None:
    """A job started after the tracer (a child of a named launcher: a target from its
    fork) that maps only files the session has seen (a first job ran the same program),
    launches and exits while the tracer is stopped: no one ever read its maps, no
    mapping of it was held, and the maps scan never saw it. The kernel's report of each
    executable mapping it made (fl_rb_maps) names every launch."""
    warm, go, db, n = tmp_path / "warm", tmp_path / "go", tmp_path / "t.db", 200
    py = sys.executable
    script = (f"while [ ! -e {warm} ]; do sleep 0.01; done; "
              f"{py} -c '{LAUNCH_AT_ONCE}' {CUDART} 3 > {tmp_path}/warm.out; "
              f"touch {tmp_path}/warmed; "
              f"while [ ! -e {go} ]; do sleep 0.01; done; "
              f"{py} -c '{LAUNCH_AT_ONCE}' {CUDART} {n} > {tmp_path}/job.out")
    launcher = subprocess.Popen(["sh", "-c", script], text=True)
    tracer = subprocess.Popen(
        [str(REPO / ".venv/bin/fleetd"), "trace", "--pid", str(launcher.pid), "--db",
         str(db), "--sample", "1", "--node", "exits-at-once"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = _until_tracing(tracer)
        warm.touch()  # the first job: its files become known (held once each)
        deadline = time.monotonic() + 120
        while not (tmp_path / "warmed").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tmp_path / "warmed").exists(), "the first job did not finish"
        exited, err = _go_while_stopped(tracer, go, launcher)  # the launcher ends with the job
    finally:
        _kill(launcher, tracer)
    job = int((tmp_path / "job.out").read_text().split()[0])
    assert exited == 0 and not Path(f"/proc/{job}").exists()
    first = int((tmp_path / "warm.out").read_text().split()[0])
    log = ("".join(lines) + err)[-3000:]
    assert _kernel_names(db, first) == {"abs": 3}, log
    assert _kernel_names(db, job) == {"abs": n}, log
