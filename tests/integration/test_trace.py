"""The tracer end to end: real BPF programs, the real CUDA runtime, the real CLI.

Each test runs the reference workload (tests/workloads/train_loop.py), which loads
libcudart and waits for a go-file; the tracer attaches to it by pid, and once it
reports it is tracing the go-file is created. The tracer stops by itself when the
workload exits. Counts, return codes, pids/tids, latencies and host events recorded
in the database are compared with what the workload says it did.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cpu_first import first_on_cpu
from recorder import StderrLog, start_in

from fleetd.trace.bpf.bpfsrc import NR_URETPROBE
from fleetd.trace.host.libs import mapped_libraries

from conftest import FLEETD, REPO, wait_for_libcudart
from netbed import why_no_bpf

WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
PY = sys.executable


_bpf_ready = why_no_bpf  # the tracing tests' own name for it
_WHY = _bpf_ready()
pytestmark = [pytest.mark.bpf, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

NO_GPU_ERRORS = {35, 100}  # cudaErrorInsufficientDriver, cudaErrorNoDevice


@dataclass
class Traced:
    workload: dict[str, Any]
    summary: dict[str, Any]
    db: Path
    stderr: str

    def q(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.db) as c:
            return c.execute(sql, params).fetchall()

    def one(self, sql: str, *params: Any) -> Any:
        rows = self.q(sql, *params)
        assert rows, sql
        return rows[0][0]


def run_traced(tmp_path: Path, workload_args: list[str], trace_args: list[str] = (),  # type: ignore[assignment]
               *, launcher: list[str] | None = None, cpu: int | None = None,
               wait_lib: bool = True, groups: Sequence[Path] = ()) -> Traced:
    go = tmp_path / "go"
    db = tmp_path / "trace.db"
    cmd = launcher or [PY, str(WORKLOAD)]
    wl = start_in(groups, [*cmd, "--go-file", str(go), *workload_args], cpu)
    try:
        if wait_lib:
            wait_for_libcudart(wl.pid)
        tr = subprocess.Popen(
            [FLEETD, "trace", "--pid", str(wl.pid), "--db", str(db), "--node", "test-node",
             "--summary-json", *trace_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log = StderrLog(tr)
        assert log.tracing(60), log.text(1)
        go.touch()
        wl_out, _ = wl.communicate(timeout=120)
        assert tr.stdout is not None
        tr_out = tr.stdout.read()
        tr.wait(60)
        err = log.text()
        assert tr.returncode == 0, err
        assert wl.returncode == 0, wl_out
        return Traced(json.loads(wl_out.strip().splitlines()[-1]), json.loads(tr_out), db,
                      err)
    finally:
        for p in (wl,):
            if p.poll() is None:
                p.kill()
                p.wait()


def _counts(t: Traced, pid: int) -> dict[str, int]:
    return dict(t.q("SELECT op, count(*) FROM events WHERE pid = ? AND source IN "
                    "('cuda', 'graph', 'driver') GROUP BY op", pid))


def _agg_totals(t: Traced, pid: int) -> dict[str, int]:
    return dict(t.q("SELECT op, sum(count) FROM aggregates WHERE pid = ? AND bucket = -1 "
                    "AND source IN ('cuda', 'graph', 'driver') GROUP BY op", pid))


# ---- CUDA runtime -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_trace(tmp_path_factory: pytest.TempPathFactory) -> Traced:
    """Every call kept (--sample 1): the reference the exact-count checks run on."""
    tmp = tmp_path_factory.mktemp("full")
    return run_traced(tmp, ["--steps", "150", "--launches", "20", "--memcpy", "2",
                            "--host-syncs", "1", "--alloc-churn", "1", "--graph",
                            "--grid", "64,2,3", "--block", "128,2,1", "--shared-mem", "4096",
                            "--sleep-ms", "1"],
                      ["--sample", "1"])


def test_every_runtime_call_is_recorded_once(full_trace: Traced) -> None:
    t, wl = full_trace, full_trace.workload
    assert _counts(t, wl["pid"]) == wl["calls"]
    assert _agg_totals(t, wl["pid"]) == wl["calls"]
    assert t.summary["lost_total"] == 0 and t.summary["unreported_loss"] == 0
    # Every ring record written, beside the rows the tracer made itself (cgroup samples).
    assert t.summary["events_written"] == t.summary["records"] + t.summary["made_in_user_space"]


def test_our_uretprobes_return_syscall_is_not_the_programs(full_trace: Traced) -> None:
    """On x86_64 since Linux 6.11 every uretprobe returns through a syscall: one
    per traced call. It is the tracer's, not the workload's, so the syscall histogram
    must not count it (it did: one 'syscall' per CUDA call, and its probes' cost)."""
    t, wl = full_trace, full_trace.workload
    calls = sum(wl["calls"].values())
    syscalls = t.one("SELECT coalesce(sum(count), 0) FROM aggregates WHERE op = 'syscall' "
                     "AND bucket = -1 AND pid = ?", wl["pid"])
    assert 0 < syscalls < calls / 2, (syscalls, calls)
    assert t.one("SELECT count(*) FROM events WHERE op = 'syscall' AND a0 = ?",
                 NR_URETPROBE) == 0


def test_return_codes_pids_and_tids_are_the_callers(full_trace: Traced) -> None:
    t, wl = full_trace, full_trace.workload
    rets = t.q("SELECT op, ret, count(*) FROM events WHERE source IN ('cuda', 'graph') "
               "GROUP BY op, ret")
    recorded = {(op, str(ret)): n for op, ret, n in rets}
    made = {(op, ret): n for op, by in wl["returns"].items() for ret, n in by.items()}
    assert recorded == made
    assert {int(r) for _, r in made} <= NO_GPU_ERRORS
    who = t.q("SELECT DISTINCT pid, tid FROM events WHERE source IN ('cuda', 'graph')")
    assert who == [(wl["pid"], wl["tid"])]
    errors = t.q("SELECT op, sum(count) FROM aggregates WHERE bucket = -2 AND pid = ? "
                 "GROUP BY op", wl["pid"])
    assert dict(errors) == wl["calls"]  # without a GPU every call fails


def test_latencies_are_positive_plausible_and_inside_the_session(full_trace: Traced) -> None:
    t = full_trace
    lo, hi, med = t.q("SELECT min(dur_ns), max(dur_ns), "
                      "(SELECT dur_ns FROM events WHERE op='cudaLaunchKernel' ORDER BY dur_ns "
                      " LIMIT 1 OFFSET (SELECT count(*)/2 FROM events WHERE "
                      " op='cudaLaunchKernel')) FROM events WHERE source IN ('cuda', 'graph')")[0]
    assert lo > 0
    assert med < 200_000  # a failing ctypes call plus two uprobes: microseconds
    assert hi < 5_000_000_000
    start, end = t.q("SELECT started_ns, ended_ns FROM sessions")[0]
    first, last = t.q("SELECT min(ts_ns), max(ts_ns + dur_ns) FROM events "
                      "WHERE source IN ('cuda', 'graph')")[0]
    assert start <= first <= last <= end
    # Wall-clock: within a minute of now, not monotonic time since boot.
    assert abs(time.time_ns() - last) < 600 * 10**9


def test_launch_dimensions_and_arguments(full_trace: Traced) -> None:
    t = full_trace
    rows = t.q("SELECT a0, a1, args FROM events WHERE op = 'cudaLaunchKernel' LIMIT 5")
    for a0, a1, args in rows:
        assert (a0, a1) == (64 * 2 * 3, 128 * 2 * 1)
        parsed = json.loads(args)
        assert parsed["grid"] == [64, 2, 3] and parsed["block"] == [128, 2, 1]
        assert parsed["shared_mem"] == 4096
    mem = t.q("SELECT DISTINCT bytes, a0 FROM events WHERE op = 'cudaMemcpyAsync'")
    assert mem == [(1 << 20, 1)]  # 1 MiB, cudaMemcpyHostToDevice
    sync_copy = t.q("SELECT DISTINCT bytes, a0 FROM events WHERE op = 'cudaMemcpy'")
    assert sync_copy == [(4, 2)]  # loss.item(): 4 bytes device-to-host
    assert t.q("SELECT DISTINCT bytes FROM events WHERE op = 'cudaMalloc'") == [(1 << 20,)]


def test_session_process_and_thread_rows(full_trace: Traced) -> None:
    t, wl = full_trace, full_trace.workload
    s = t.q("SELECT node, lost_events, drops, targets, headers_route, mono_offset_ns, "
            "clock_error_ns, clock_samples, tool_version, command FROM sessions")
    assert len(s) == 1
    node, lost, drops, targets, route, offset, err, samples, version, command = s[0]
    assert node == "test-node" and lost == 0 and version
    assert all(v == 0 for v in json.loads(drops).values())
    tg = json.loads(targets)
    assert tg["pids"][str(wl["pid"])] == "named"
    assert tg["libraries"][0]["probes"] >= 18
    assert route and "trace" in command
    # wall = mono + offset: the offset is boot time in wall-clock terms.
    boot_wall = time.time_ns() - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    assert abs(offset - boot_wall) < 5 * 10**9
    assert err > 0 and json.loads(samples)[0][1] == offset
    proc = t.q("SELECT comm, cmdline, ppid, start_ns, exit_ns, exit_code FROM processes "
               "WHERE pid = ?", wl["pid"])[0]
    assert "train_loop.py" in proc[1] and proc[2] == os.getpid()
    assert proc[3] < proc[4] and proc[5] == 0
    assert t.q("SELECT pid FROM threads WHERE tid = ?", wl["tid"]) == [(wl["pid"],)]


def test_sampling_keeps_exact_histograms_and_all_syncs(tmp_path: Path) -> None:
    """--launch-returns: every launch's return is probed, so every bucket is exact while
    only 1 in 100 launches is stored. (The default, entry-only launches, times only the
    sample: test_launch_entry.)"""
    t = run_traced(tmp_path, ["--steps", "200", "--launches", "25", "--memcpy", "2"],
                   ["--sample", "100", "--no-host", "--launch-returns"])
    wl = t.workload
    assert _agg_totals(t, wl["pid"]) == wl["calls"]
    counts = _counts(t, wl["pid"])
    # Syncs are always kept; launches only 1 in 100 plus rate-limited errors/outliers.
    assert counts["cudaStreamSynchronize"] == wl["calls"]["cudaStreamSynchronize"]
    launches = wl["calls"]["cudaLaunchKernel"]
    assert 0 < counts.get("cudaLaunchKernel", 0) < launches // 4
    sampled_out = t.one("SELECT sampled_out FROM sessions")
    kept = sum(counts.values())
    assert sampled_out == sum(wl["calls"].values()) - kept
    assert t.q("SELECT count(*) FROM events WHERE source = 'sched'") == [(0,)]
    bins = t.q("SELECT bucket, count, sum FROM aggregates WHERE op = 'cudaLaunchKernel' "
               "AND bucket >= 0")
    assert sum(c for _, c, _ in bins) == launches
    for b, c, s in bins:  # each bucket's mean lies inside [2^b, 2^(b+1))
        assert 2**b <= s / c < 2 ** (b + 1)


# ---- host events -----------------------------------------------------------------------------

def test_dstate_waits_are_visible(tmp_path: Path) -> None:
    t = run_traced(tmp_path, ["--steps", "12", "--launches", "5", "--dstate", "fsync:8",
                              "--tmpdir", str(tmp_path)])
    wl = t.workload
    d_ns = t.one("SELECT coalesce(sum(dur_ns), 0) FROM events WHERE op = 'off_cpu' "
                 "AND pid = ? AND tid = ? AND (a0 & 2) != 0", wl["pid"], wl["tid"])
    assert d_ns > 0.1 * wl["blocked_s"] * 1e9, (d_ns, wl["blocked_s"])
    io = t.q("SELECT count(*), sum(bytes) FROM events WHERE op = 'block_io' AND pid = ?",
             wl["pid"])[0]
    assert io[0] > 0 and io[1] >= 8 << 20  # at least the data it fsynced, once
    off_hist = t.one("SELECT sum(count) FROM aggregates WHERE op = 'off_cpu' AND bucket = -1 "
                     "AND pid = ?", wl["pid"])
    assert off_hist >= t.one("SELECT count(*) FROM events WHERE op = 'off_cpu' AND pid = ?",
                             wl["pid"])
    pages = t.one("SELECT sum(count) FROM aggregates WHERE op = 'page_alloc' AND bucket = -1 "
                  "AND pid = ?", wl["pid"])
    assert pages > 0


@dataclass
class Hog:
    pid: int
    group: Path  # its cgroup, which comes first on CPU 0 (tests/cpu_first.py)


@pytest.fixture
def cpu_hog() -> Iterator[Hog]:
    """A busy loop named fleetd-hog on CPU 0, in a cgroup that comes first there: the
    workload started in it too shares CPU 0 with the hog alone, busy node or not (where
    a loop of busy-node.sh shared it as well, the workload was preempted by that loop
    and the hog only ran when it slept)."""
    code = ("import ctypes, os; ctypes.CDLL(None).prctl(15, b'fleetd-hog', 0, 0, 0)\n"
            "while True: pass")
    with first_on_cpu() as group:
        hog = start_in([group], [PY, "-c", code], cpu=0)
        time.sleep(0.2)
        try:
            yield Hog(hog.pid, group)
        finally:
            hog.send_signal(signal.SIGKILL)
            hog.wait()


def test_cpu_hog_on_the_same_core_shows_as_off_cpu_and_runqueue_time(
        tmp_path: Path, cpu_hog: Hog) -> None:
    t = run_traced(tmp_path, ["--steps", "60", "--launches", "20", "--cpu-us", "200"], cpu=0,
                   groups=[cpu_hog.group])
    wl, hog = t.workload, cpu_hog.pid
    by_hog = t.q("SELECT count(*), coalesce(sum(dur_ns), 0) FROM events WHERE op = 'off_cpu' "
                 "AND tid = ? AND peer = ?", wl["tid"], hog)[0]
    assert by_hog[0] > 0, t.q("SELECT peer, peer_comm, count(*) FROM events "
                              "WHERE op='off_cpu' GROUP BY 1, 2")
    assert by_hog[1] > 0.1 * wl["elapsed_s"] * 1e9  # shared the core: a real share of time
    assert t.q("SELECT DISTINCT peer_comm FROM events WHERE op = 'off_cpu' AND peer = ?",
               hog) == [("fleetd-hog",)]
    rq = t.one("SELECT coalesce(sum(dur_ns), 0) FROM events WHERE op = 'runq_wait' "
               "AND tid = ?", wl["tid"])
    assert rq > 0
    # Preempted, not sleeping: the state it left in is "runnable" (0 or the preempt bit).
    states = {a0 for (a0,) in t.q("SELECT a0 FROM events WHERE op = 'off_cpu' AND peer = ?",
                                  hog)}
    assert states & {0, 256}


def test_children_started_after_the_tracer_are_picked_up(tmp_path: Path) -> None:
    launcher = [PY, "-c",
                "import subprocess, sys, os, time\n"
                "go = sys.argv[sys.argv.index('--go-file') + 1]\n"
                "while not os.path.exists(go): time.sleep(0.01)\n"
                f"r = subprocess.run([sys.executable, {str(WORKLOAD)!r}, '--steps', '40'] + "
                "sys.argv[sys.argv.index('--go-file') + 2:], capture_output=True, text=True)\n"
                "print(r.stdout.strip())\n"]
    t = run_traced(tmp_path, ["--launches", "10"], launcher=launcher, wait_lib=False)
    wl = t.workload
    assert _counts(t, wl["pid"]) == wl["calls"] or _agg_totals(t, wl["pid"]) == wl["calls"]
    assert _agg_totals(t, wl["pid"]) == wl["calls"]
    parent = t.q("SELECT ppid FROM processes WHERE pid = ?", wl["pid"])
    launcher_pid = t.summary["targets"][0]
    assert parent == [(launcher_pid,)]
    assert t.q("SELECT count(*) FROM events WHERE op = 'fork' AND pid = ? AND peer = ?",
               launcher_pid, wl["pid"]) == [(1,)]
    assert t.one("SELECT count(*) FROM events WHERE op = 'exec' AND pid = ?", wl["pid"]) == 1
    ex = t.q("SELECT exit_code FROM processes WHERE pid = ?", wl["pid"])
    assert ex == [(0,)]


# ---- the Tracer API, stacks and the driver layer ---------------------------------------------

def test_tracer_api_with_stacks_and_no_loss(tmp_path: Path) -> None:
    from fleetd.store.writer import BatchWriter
    from fleetd.trace.tracer import TraceConfig, Tracer

    go = tmp_path / "go"
    wl = subprocess.Popen([PY, str(WORKLOAD), "--steps", "100", "--go-file", str(go)],
                          stdout=subprocess.PIPE, text=True)
    wait_for_libcudart(wl.pid)
    db = tmp_path / "api.db"
    writer = BatchWriter(db, "api-node")
    # Every call kept and stacked: records with Python frames are larger, so the ring
    # gets room for a burst on a loaded machine (the test is about losing nothing).
    tracer = Tracer(TraceConfig(db=db, node="api-node", pids=[wl.pid], sample=1, stacks=True,
                                stack_sample=1, layers=frozenset({"cuda"}), ring_pages=4096),
                    writer=writer)
    tracer.start()
    try:
        go.touch()
        while not tracer.targets_gone():
            tracer.poll(50)
        assert tracer.status()["probes"] >= 36
    finally:
        summary = tracer.stop()
        writer.close()
    made = json.loads(wl.communicate(timeout=30)[0])
    assert summary.unreported_loss == 0 and summary.lost_total == 0
    with sqlite3.connect(db) as c:
        n = c.execute("SELECT count(*) FROM events WHERE op = 'cudaLaunchKernel'").fetchone()[0]
        stacks = c.execute("SELECT count(*) FROM events e JOIN stacks s ON s.hash = e.stack "
                           "WHERE e.op = 'cudaLaunchKernel'").fetchone()[0]
        frames = c.execute("SELECT frames FROM stacks LIMIT 1").fetchone()
    assert n == made["calls"]["cudaLaunchKernel"]
    assert stacks == n  # every kept launch points at a stored stack
    assert frames is not None and json.loads(frames[0])


def _libcuda() -> str | None:
    sys.path.insert(0, str(WORKLOAD.parent))
    try:
        from train_loop import find_libcuda  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    found: str | None = find_libcuda(REPO)
    return found


def test_driver_layer_when_libcuda_is_available(tmp_path: Path) -> None:
    lib = _libcuda()
    if lib is None:
        pytest.skip("libcuda not fetched: run scripts/fetch-libcuda.sh")
    t = run_traced(tmp_path, ["--steps", "30", "--launches", "8", "--driver"],
                   ["--sample", "1"])
    wl = t.workload
    made = {k: v for k, v in wl["calls"].items()
            if k.startswith("cu") and not k.startswith("cuda") and k != "cuInit"}
    got = dict(t.q("SELECT op, count(*) FROM events WHERE source = 'driver' GROUP BY op"))
    assert got == made
    dims = t.q("SELECT a0, a1, args FROM events WHERE op = 'cuLaunchKernel' LIMIT 1")[0]
    assert (dims[0], dims[1]) == (8, 32)
    assert json.loads(dims[2])["grid"] == [8, 1, 1]
    rets = {r for (r,) in t.q("SELECT DISTINCT ret FROM events WHERE source = 'driver'")}
    made_rets = {int(r) for k, v in wl["returns"].items() if k in made for r in v}
    assert rets == made_rets


# ---- the CLI's other paths -------------------------------------------------------------------

def test_check_reports_a_working_route_and_attachable_probes() -> None:
    r = subprocess.run([FLEETD, "check", "--format", "json"], capture_output=True, text=True,
                       timeout=120)
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert r.returncode == 0, r.stdout + r.stderr
    assert checks["headers"]["status"] == "ok"
    assert checks["programs"]["status"] == "ok"
    probes = [c for n, c in checks.items() if n.startswith("probes libcudart")]
    assert probes and all(c["status"] == "ok" for c in probes)
    for c in checks.values():
        assert c["status"] == "ok" or c["fix"], c


def test_check_skips_a_cuda_process_that_exits_during_the_check(tmp_path: Path) -> None:
    """A library found through /proc/PID/root of a process that then exits: the symbol
    and probe checks say the process is gone (SKIP), they do not FAIL."""
    from fleetd.trace import checks as tc

    wl = subprocess.Popen([PY, str(WORKLOAD), "--go-file", str(tmp_path / "never")])
    try:
        wait_for_libcudart(wl.pid)
        # The workload's own maps (the check's scan keeps whichever process it meets
        # first, and another CUDA process on the machine may come before it).
        libs = mapped_libraries(wl.pid)
        assert libs, "the workload's libcudart was not found through its maps"
    finally:
        wl.kill()
        wl.wait()
    found = [tc._symbols_check(lib) for lib in libs] + tc._attach_check(libs)
    assert not [c for c in found if c.status == "fail"], found
    skipped = [c for c in found if c.status == "skip"]
    assert skipped and all(f"process {wl.pid} exited" in c.detail for c in skipped)


def test_trace_of_a_pid_that_does_not_exist_fails_clearly(tmp_path: Path) -> None:
    pid = 2**22 + 12345  # above pid_max's default range
    r = subprocess.run([FLEETD, "trace", "--pid", str(pid), "--db", str(tmp_path / "x.db")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"no such process: {pid}" in r.stderr and "hint:" in r.stderr
    assert "Traceback" not in r.stderr


def test_duration_stops_a_system_wide_trace(tmp_path: Path) -> None:
    """``--duration`` is how long the trace runs: counted from the moment the tracer says
    it is tracing, not from launch (the compile before it takes a minute on a loaded
    machine, and is no part of the trace). So the time is measured from that line."""
    db = tmp_path / "sw.db"
    tr = subprocess.Popen([FLEETD, "trace", "--duration", "1s", "--db", str(db), "--node",
                           "sw", "--no-host", "--summary-json"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        log = StderrLog(tr)
        assert log.tracing(600), log.text()
        tracing = time.monotonic()
        assert tr.stdout is not None
        out = tr.stdout.read()  # the summary, written as it exits
        assert tr.wait(60) == 0, log.text()
        stopped = time.monotonic() - tracing
    finally:
        if tr.poll() is None:
            tr.kill()
            tr.wait()
    err = log.text()
    assert "every CUDA process" in err and "duration reached" in err, err
    s = json.loads(out)
    assert s["probes"] > 0 and s["unreported_loss"] == 0
    # The tracer's own count of the time it traced: the duration (and a poll's worth), not
    # cut short by a compile counted in. From the line to the exit: that and the flush.
    assert 1.0 <= s["duration_s"] < 10, s["duration_s"]
    assert stopped < 30, stopped
    with sqlite3.connect(db) as c:
        [(started, ended)] = c.execute("SELECT started_ns, ended_ns FROM sessions").fetchall()
    assert 1.0 <= (ended - started) / 1e9 < 10, (started, ended)


def test_sigint_flushes_and_records_the_session(tmp_path: Path) -> None:
    go = tmp_path / "go"
    wl = subprocess.Popen([PY, str(WORKLOAD), "--duration", "30", "--go-file", str(go),
                           "--sleep-ms", "2"], stdout=subprocess.PIPE, text=True)
    wait_for_libcudart(wl.pid)
    db = tmp_path / "int.db"
    tr = subprocess.Popen([FLEETD, "trace", "--pid", str(wl.pid), "--db", str(db),
                           "--sample", "1"], stderr=subprocess.PIPE, text=True)
    try:
        assert tr.stderr is not None
        line = tr.stderr.readline()
        while line and "fleetd: tracing" not in line:
            line = tr.stderr.readline()
        go.touch()
        time.sleep(1.0)
        tr.send_signal(signal.SIGINT)
        err = tr.communicate(timeout=60)[1]
        assert tr.returncode == 0, err
        assert "stopped (interrupted)" in err and "Traceback" not in err
        with sqlite3.connect(db) as c:
            ended, lost = c.execute("SELECT ended_ns, lost_events FROM sessions").fetchone()
            n = c.execute("SELECT count(*) FROM events WHERE op = 'cudaLaunchKernel'"
                          ).fetchone()[0]
        assert ended and lost == 0 and n > 100
    finally:
        wl.send_signal(signal.SIGKILL)
        wl.wait()
        if tr.poll() is None:
            tr.kill()


def test_not_root_is_refused_with_a_fix(tmp_path: Path) -> None:
    # A fresh user namespace: uid 65534 inside, no capabilities outside. Files stay
    # readable (the kernel still sees our own uid as their owner), BPF does not.
    r = subprocess.run(["unshare", "--user", FLEETD, "trace", "--duration", "1s",
                        "--db", str(tmp_path / "n.db")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "needs root" in r.stderr and "hint:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("route", ["debian-merged", "generated"])
def test_three_tracers_build_the_header_tree_at_once(tmp_path: Path, route: str) -> None:
    """A fresh cache and three compilers started together (as the demo's three agents
    are): one builds the tree under the lock, the others wait and use it; none finds the
    tree replaced under its compile. With ``generated`` this is also the test that the
    generated header route compiles the programs on its own."""
    env = {**os.environ, "FLEETD_HEADERS": route, "FLEETD_CACHE_DIR": str(tmp_path)}
    code = ("import os\nfrom fleetd.trace.bpf.bpfsrc import ProgramOptions, compile_program, "
            "detach_all\n"
            "b, r = compile_program(ProgramOptions(tracer_pid=os.getpid()))\n"
            "print(r.name)\ndetach_all(b)\n")
    procs = [subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == route
    trees = [d.name for d in (tmp_path / "kheaders").iterdir() if d.is_dir()]
    assert len(trees) == 1 and (tmp_path / "kheaders" / trees[0] / ".complete").exists()


def test_bpf_record_layout_matches_the_decoder() -> None:
    """The compile-time asserts in fleetd.h tie the C layout to bpfsrc.REC."""
    from fleetd.trace.bpf.bpfsrc import REC, ProgramOptions, cflags, source_text

    assert REC.size == 136
    flags = cflags(ProgramOptions(tracer_pid=1))
    assert "-DFL_REC_SIZE=136" in flags
    assert "_Static_assert(sizeof(struct fl_rec) == FL_REC_SIZE" in source_text({"cuda"})
    assert ctypes.sizeof(ctypes.c_uint64) * 17 == REC.size
