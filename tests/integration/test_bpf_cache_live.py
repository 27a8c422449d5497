"""The compiled-program cache, live (fleetd/trace/bpf/bpfcache.py, bpfload.py): real BCC
compiles, real maps and programs, the real CLI tracing the reference workload.

* a cold start (empty FLEETD_CACHE_DIR) compiles and keeps the programs; the next start
  loads them from the cache without a compile, and both record every CUDA call the
  workload makes;
* what the cache loads is what BCC compiles for that start: the kept instructions with
  this process's pid patched in equal, instruction for instruction, those of a compile
  with the pid given as a -D flag (map references compared by map);

A corrupt, foreign or too-open entry is discarded before any of this (tests/unit/
test_bpf_cache.py); the start then compiles, as the cold start here does.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from recorder import StderrLog
from test_trace import _bpf_ready

from fleetd.trace.bpf import bpfcache

from conftest import FLEETD, REPO, wait_for_libcudart

_WHY = _bpf_ready()
pytestmark = [pytest.mark.bpf, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
LOADED = "loaded from the compiled-program cache"
KEPT = "compiled BPF programs kept in"
COLD_LIMIT_S = 240  # a cold compile on a loaded 2-core machine


def _trace(tmp: Path, cache: Path, name: str, limit_s: float) -> tuple[dict[str, int], str,
                                                                        dict[str, int]]:
    """One traced run of the workload: (calls it made per op, the tracer's stderr,
    calls recorded per op)."""
    go = tmp / f"{name}.go"
    db = tmp / f"{name}.db"
    wl = subprocess.Popen([sys.executable, str(WORKLOAD), "--go-file", str(go), "--steps",
                           "40", "--launches", "10", "--memcpy", "2"],
                          stdout=subprocess.PIPE, text=True)
    try:
        wait_for_libcudart(wl.pid)
        tr = subprocess.Popen([FLEETD, "trace", "-v", "--pid", str(wl.pid), "--db", str(db),
                               "--sample", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "FLEETD_CACHE_DIR": str(cache)})
        log = StderrLog(tr)
        assert log.tracing(limit_s), log.text(1)
        go.touch()
        out, _ = wl.communicate(timeout=120)
        tr.wait(60)
        err = log.text()
        assert tr.returncode == 0 and wl.returncode == 0, err[-3000:]
    finally:
        if wl.poll() is None:
            wl.kill()
            wl.wait()
    made = json.loads(out.strip().splitlines()[-1])
    with sqlite3.connect(db) as c:
        got = dict(c.execute("SELECT op, count(*) FROM events WHERE pid = ? AND source = "
                             "'cuda' GROUP BY op", (made["pid"],)).fetchall())
    return made["calls"], err, got


@pytest.mark.timeout(600)  # one compile through the CLI
def test_a_warm_start_loads_the_kept_programs_and_records_every_call(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    made, err, got = _trace(tmp_path, cache, "cold", COLD_LIMIT_S)
    assert KEPT in err and LOADED not in err, err[-3000:]
    assert got == made, "cold start"
    [entry] = (cache / "bpf").glob("*.prog")
    kept = entry.stat().st_mtime_ns
    made, err, got = _trace(tmp_path, cache, "warm", 60)
    assert LOADED in err and KEPT not in err, err[-3000:]
    assert got == made, "warm start"
    assert entry.stat().st_mtime_ns == kept, "the warm start wrote nothing"


@pytest.mark.timeout(900)  # two compiles of the whole program: minutes on a busy node
def test_the_kept_programs_are_what_bcc_compiles_for_this_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetd.trace.bpf import bpfsrc
    from fleetd.trace.bpf.bpfload import capture

    monkeypatch.setenv("FLEETD_CACHE_DIR", str(tmp_path))
    opts = bpfsrc.ProgramOptions(tracer_pid=os.getpid(), stacks=True, cgroups=True,
                                 system_wide=True)
    text = bpfsrc.source_text(opts.layers, False)  # read once: both compiles get this
    bpf, route = bpfsrc.compile_source(text, bpfsrc.cflags(opts),
                                       params={"FL_TRACER_PID": os.getpid()})
    try:
        assert type(bpf).__name__ == "CachedBPF"
        # Every program loads and passes the verifier (uprobe ones on first attach).
        for name in bpf.entry.funcs:
            if not name.startswith(("tracepoint__", "raw_tracepoint__")):
                bpf.load_func(name.encode(), 2)  # BPF_PROG_TYPE_KPROBE
        loaded = {n.decode(): bpf.dump_func(n) for n in list(bpf._insns)}
        fd_index = {fd: i for i, fd in enumerate(bpf.map_fds)}
        ours = {n: bpfcache.fds_to_indices(b, fd_index) for n, b in loaded.items()}
    finally:
        bpfsrc.detach_all(bpf)
    flags = bpfsrc._with_values(bpfsrc.cflags(opts), {"FL_TRACER_PID": os.getpid()})
    direct, _ = bpfsrc._compile(text, flags, autoload=False)
    try:
        theirs = capture(direct, (route.name, route.source, route.detail), {}, text)
    finally:
        direct.cleanup()
    assert theirs.tables == bpf.entry.tables
    assert sorted(ours) == sorted(theirs.funcs)
    differ = [n for n in ours if ours[n] != theirs.funcs[n]]
    assert not differ, f"programs that differ from BCC's own compile: {differ[:5]}"
    pid = os.getpid().to_bytes(4, "little")
    assert any(pid in b for b in ours.values()), "the pid is in the programs"


SMALL = r"""
BPF_ARRAY(hits, u64, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    int k = 0;
    u64 *v = hits.lookup(&k);
    if (v && (bpf_get_current_pid_tgid() >> 32) == FL_TRACER_PID)
        __sync_fetch_and_add(v, 1);
    return 0;
}
"""


def test_an_entry_the_kernel_refuses_is_dropped_and_compiled_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """An intact entry (its checksum holds) whose program the verifier rejects: the start
    says so, removes it, compiles, and the compiled program records."""
    import ctypes
    import logging
    from dataclasses import replace

    from fleetd.trace.bpf.bpfsrc import compile_source, detach_all

    monkeypatch.setenv("FLEETD_CACHE_DIR", str(tmp_path))
    params = {"FL_TRACER_PID": os.getpid()}
    bpf, _ = compile_source(SMALL, [], params=params)
    detach_all(bpf)
    [path] = (tmp_path / "bpf").glob("*.prog")
    entry = bpfcache.load(tmp_path, path.stem)
    assert entry is not None
    # r0 = *(u64 *)(r10 - 8) before anything was stored there, then exit: refused.
    bad = bytes([0x79, 0x0A, 0xF8, 0xFF, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])
    bpfcache.store(tmp_path, path.stem, replace(
        entry, funcs={n: bad for n in entry.funcs}))
    with caplog.at_level(logging.INFO, logger="fleetd.trace"):
        bpf, _ = compile_source(SMALL, [], params=params)
    try:
        assert "loading it failed (Failed to load BPF program tracepoint__syscalls__" \
            in caplog.text and "compiled BPF programs kept in" in caplog.text, caplog.text
        for _ in range(3):
            os.getppid()
        assert bpf[b"hits"][ctypes.c_int(0)].value == 3
    finally:
        detach_all(bpf)
    kept = bpfcache.load(tmp_path, path.stem)
    assert kept is not None and kept.funcs == entry.funcs
