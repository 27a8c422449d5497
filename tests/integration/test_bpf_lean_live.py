"""The start's lean module, live (#41.1): where the kernel has uprobe_multi a cold start
compiles the BPF programs without the per-op programs of the per-symbol probe ladder
(fleetd/trace/bpf/bpfsrc.py, per_symbol_first); the first time one of those is loaded,
the complete module is loaded from the cache or compiled and kept, and its programs
join the start's, on the start's maps (bpfload.CachedBPF.load_func).

* small sources: a left-out program loads on first use, writes the start's own map
  with the start's parameters patched in, and a complete module whose maps are not the
  start's is refused with a message (every later load hears the same);
* the real programs: none of the per-op programs is in the start's module; loaded
  afterwards, each passes the verifier on the start's maps and is, instruction for
  instruction, what BCC compiles for the complete program with this process's pid.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from fleetd.trace.bpf import bpfcache, probes
from fleetd.trace.bpf.bpfsrc import compile_source, detach_all

from netbed import why_no_bpf

_WHY = why_no_bpf()
pytestmark = [pytest.mark.bpf, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

LEAN = r"""
BPF_ARRAY(hits, u64, 2);
static __always_inline void hit(int k)
{
    u64 *v = hits.lookup(&k);
    if (v && (bpf_get_current_pid_tgid() >> 32) == FL_TRACER_PID)
        __sync_fetch_and_add(v, 1);
}
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    hit(0);
    return 0;
}
"""
# The complete module: the same, and a program the lean one leaves out.
EXTRA = r"""
int extra_getpgrp(void *ctx) {
    hit(1);
    return 0;
}
"""


def test_a_left_out_program_loads_on_first_use_on_the_starts_maps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETD_CACHE_DIR", str(tmp_path))
    bpf, _ = compile_source(LEAN, [], params={"FL_TRACER_PID": os.getpid()},
                            complete=LEAN + EXTRA)
    try:
        assert b"extra_getpgrp" not in bpf._insns  # not compiled by the start
        assert len(list((tmp_path / "bpf").glob("*.prog"))) == 1
        bpf.attach_tracepoint(tp=b"syscalls:sys_enter_getpgrp", fn_name=b"extra_getpgrp")
        assert len(list((tmp_path / "bpf").glob("*.prog"))) == 2  # the complete one kept
        for _ in range(3):
            os.getppid()
            os.getpgrp()
        # Both programs count into the one map, each only for this process (the pid
        # patched into the adopted program as into the start's).
        assert bpf[b"hits"][ctypes.c_int(0)].value == 3
        assert bpf[b"hits"][ctypes.c_int(1)].value == 3
    finally:
        detach_all(bpf)


def test_a_complete_module_on_other_maps_is_refused_with_a_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETD_CACHE_DIR", str(tmp_path))
    other = LEAN.replace("BPF_ARRAY(hits, u64, 2)", "BPF_ARRAY(hits, u64, 4)") + EXTRA
    bpf, _ = compile_source(LEAN, [], params={"FL_TRACER_PID": os.getpid()}, complete=other)
    try:
        for _ in range(2):  # the failure is kept: no second compile, the same message
            with pytest.raises(Exception, match="its map hits is not one of this module's"):
                bpf.load_func(b"extra_getpgrp", 5)  # BPF_PROG_TYPE_TRACEPOINT
        assert len(list((tmp_path / "bpf").glob("*.prog"))) == 2
    finally:
        detach_all(bpf)


@pytest.mark.timeout(900)  # three compiles of the whole program on a busy node
def test_the_left_out_per_op_programs_are_bccs_own_and_pass_the_verifier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetd.trace.bpf import bpfsrc
    from fleetd.trace.bpf.bpfload import capture

    if bpfsrc.per_symbol_first():
        pytest.skip("a kernel without uprobe_multi compiles the per-op programs at start")
    monkeypatch.setenv("FLEETD_CACHE_DIR", str(tmp_path))
    opts = bpfsrc.ProgramOptions(tracer_pid=os.getpid())
    bpf, route = bpfsrc.compile_program(opts)
    per_op = [n for s in probes.SPECS for n in (s.entry_fn, s.return_fn)]
    try:
        assert not set(per_op) & {n.decode() for n in bpf._insns}, "left out at start"
        for name in per_op:  # each passes the verifier, on the start's maps
            bpf.load_func(name.encode(), 2)  # BPF_PROG_TYPE_KPROBE
        fd_index = {fd: i for i, fd in enumerate(bpf.map_fds)}
        ours = {n: bpfcache.fds_to_indices(bpf.dump_func(n), fd_index) for n in per_op}
        tables = bpf.entry.tables
    finally:
        detach_all(bpf)
    complete = bpfsrc.source_text(opts.layers, False)
    flags = bpfsrc._with_values(bpfsrc.cflags(opts), {"FL_TRACER_PID": os.getpid()})
    direct, _ = bpfsrc._compile(complete, flags, autoload=False)
    try:
        theirs = capture(direct, (route.name, route.source, route.detail), {}, complete)
    finally:
        direct.cleanup()
    assert theirs.tables == tables
    differ = [n for n in per_op if ours[n] != theirs.funcs[n]]
    assert not differ, f"programs that differ from BCC's own compile: {differ[:5]}"
