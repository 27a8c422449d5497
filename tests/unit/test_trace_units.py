"""Tracer pieces that need no BPF: decoding, probe specs, ELF exports, library
discovery, the clock mapping, header trees, CLI validation and the workload."""

from __future__ import annotations

import argparse
import ctypes
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from fleetd.errors import FleetdError, UsageError
from fleetd.store.catalog import BY_NAME, IMPORTED_CALL, OPS
from fleetd.trace import clock, headers, libs, probes
from fleetd.trace.bpfsrc import REC, ProgramOptions, cflags, probe_wrappers, source_text
from fleetd.trace.decoder import Decoder, launch_args

from conftest import FLEETD, REPO

WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"


def _workload_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_loop", WORKLOAD)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_loop"] = mod
    spec.loader.exec_module(mod)
    return mod


def _cudart() -> str:
    path: str = _workload_module().find_cudart()
    return path


# ---- records -------------------------------------------------------------------------------

def _rec(op: str, **kw: int | bytes) -> bytes:
    f = dict(ts=1_000, dur=50, pid=7, tid=8, op=BY_NAME[op].code, ret=0, bytes=0, peer=0,
             peer_pid=0, a0=0, a1=0, stack=-1, flags=8, x0=0, x1=0, x2=0, x3=0, median=0,
             func=0, comm=b"")
    f.update(kw)
    return REC.pack(*f.values())


def test_decoder_converts_to_wall_clock_and_unpacks_launch_dims() -> None:
    x0 = 64 | (2 << 32)
    x1 = 3 | (1 << 16) | (4096 << 32)
    x2 = 128 | (2 << 32)
    d = Decoder(lambda mono: mono + 10**18)
    b = d.decode([_rec("cudaLaunchKernel", a0=384, a1=256, ret=35, x0=x0, x1=x1, x2=x2,
                       x3=0xABC)])
    assert b.rows == [(10**18 + 1_000, 50, 7, 8, 100, 35, 0, 0, 384, 256, 0)]
    assert b.args == [(0, {"grid": [64, 2, 3], "block": [128, 2, 1], "shared_mem": 4096,
                           "stream": "0xabc"})]
    assert b.new_tids == [(8, 7)]
    assert d.decode([_rec("cudaLaunchKernel")]).new_tids == []  # reported once
    assert launch_args(1 | (1 << 32), 1 | (1 << 16), 1 | (1 << 32), 0) == {
        "grid": [1, 1, 1], "block": [1, 1, 1]}


def test_decoder_sched_peers_lifecycle_and_slow_calls() -> None:
    d = Decoder(lambda mono: mono)
    b = d.decode([
        _rec("off_cpu", a0=2, peer=99, comm=b"kworker/0:1"),
        _rec("wakeup", peer=42, peer_pid=40, comm=b"waker"),
        _rec("exit", a0=3, x0=1),
        _rec("exit", pid=9, tid=9, x0=0),
        _rec("fork", peer=77),
        _rec("cudaStreamSynchronize", flags=2, median=1234, x3=0x10),
        _rec("block_io", x0=int.from_bytes(b"WS", "little"), comm=b"jbd2"),
    ])
    assert (99, None, "kworker/0:1") in b.tasks and (42, 40, "waker") in b.tasks
    assert (8, 7, "jbd2") in b.tasks  # the issuer of a block request
    exits = [(x.pid, x.exit_code) for x in b.lifecycle if x.op == BY_NAME["exit"].code]
    assert exits == [(7, 3), (9, None)]  # no exit() seen: unknown, not 0
    assert [x.child for x in b.lifecycle if x.op == BY_NAME["fork"].code] == [77]
    args = dict(b.args)
    assert args[5] == {"stream": "0x10", "median_ns": 1234}
    assert args[6] == {"rw": "WS"}
    assert len(b.rows) == 7 and all(len(r) == 11 for r in b.rows)


# ---- BPF source and probe specs ---------------------------------------------------------------

def test_every_op_reaches_c_as_a_cflag_and_every_probe_is_generated() -> None:
    flags = cflags(ProgramOptions(tracer_pid=123, sample_n=7))
    for op in OPS:
        assert f"-DOP_{op.name.upper()}={op.code}" in flags
    assert "-DFL_TRACER_PID=123" in flags and "-DFL_SAMPLE_N=7" in flags
    text = source_text({"cuda", "driver", "nccl", "host"})
    for spec in probes.SPECS:
        assert f"static __always_inline int fl_enter_{spec.op.upper()}(" in text
        assert f"int {spec.entry_fn}(struct pt_regs *ctx)" in text
        assert f"case OP_{spec.op.upper()}:" in text
    assert '#include "' not in text  # every include inlined: works from a zip too
    assert "fl_in_multi" not in probe_wrappers(set())


def test_probe_cookies_and_always_classes() -> None:
    by = {s.op: s for s in probes.SPECS}
    assert by["cudaLaunchKernel"].cookie == 100
    assert by["cudaStreamSynchronize"].cookie == BY_NAME["cudaStreamSynchronize"].code | 1 << 32
    assert by["cuMemAlloc_v2"].cookie >> 40 == 1 and by["ncclSend"].cookie >> 40 == 2
    always = {s.op for s in probes.SPECS if s.always}
    assert {"cudaMemcpy", "cudaDeviceSynchronize", "cudaGraphLaunch", "ncclAllReduce"} <= always
    assert not {"cudaLaunchKernel", "cudaMemcpyAsync", "cuLaunchKernel"} & always
    cat = {op.name for op in OPS if op.source in ("cuda", "graph", "driver", "nccl")
           and op.name != IMPORTED_CALL}
    assert {s.op for s in probes.SPECS} == cat


def test_symbol_ladder_falls_back_and_adds_variants() -> None:
    by = {s.op: s for s in probes.SPECS}
    assert probes.planned_symbols(by["cuMemAlloc_v2"], {"cuMemAlloc"}) == ["cuMemAlloc"]
    assert probes.planned_symbols(by["cuMemAlloc_v2"], {"cuMemAlloc", "cuMemAlloc_v2"}) == [
        "cuMemAlloc_v2"]
    assert probes.planned_symbols(
        by["cudaLaunchKernel"], {"cudaLaunchKernel", "cudaLaunchKernel_ptsz"}) == [
        "cudaLaunchKernel", "cudaLaunchKernel_ptsz"]
    assert probes.planned_symbols(by["cudaMalloc"], set()) == []


# ---- libraries -----------------------------------------------------------------------------

def test_exported_functions_match_readelf_on_the_real_runtime() -> None:
    path = _cudart()
    ex = libs.exported_functions(path)
    out = subprocess.run(["readelf", "-W", "--dyn-syms", path], capture_output=True,
                         text=True, check=True).stdout
    m = re.search(r"^\s*\d+: ([0-9a-f]+)\s+\d+ FUNC\s+GLOBAL\s+DEFAULT\s+\d+ "
                  r"cudaLaunchKernel@", out, re.M)
    assert m is not None
    # A shared library's text segment maps at its file offset: value == offset here.
    assert ex.offsets["cudaLaunchKernel"] == int(m.group(1), 16)
    for spec in probes.SPECS_BY_KIND["cudart"]:
        assert probes.planned_symbols(spec, ex.offsets), spec.op


def test_libraries_are_found_where_a_process_maps_them() -> None:
    path = _cudart()
    ctypes.CDLL(path)  # now this test process maps it
    found = libs.mapped_libraries(os.getpid())
    assert [lib.kind for lib in found if lib.ino == os.stat(path).st_ino] == ["cudart"]
    assert found[0].path.startswith(f"/proc/{os.getpid()}/root/")
    assert any(lib.ino == os.stat(path).st_ino for lib in libs.search_usual_places())
    assert libs.kind_of("/x/libcuda.so.1") == "cuda" and libs.kind_of("libnccl.so.2") == "nccl"
    assert libs.kind_of("/x/libcudart_static.a") is None
    assert libs.mapped_libraries(2**22 + 7) == []  # a pid that cannot exist


def test_cuda_lib_override_is_validated(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is not a file"):
        libs.override_libraries([str(tmp_path / "nope.so")])
    junk = tmp_path / "libjunk.so"
    junk.write_bytes(b"\x7fELF" + b"\0" * 60)
    with pytest.raises(UsageError, match="exports no CUDA"):
        libs.override_libraries([str(junk)])
    copy = tmp_path / "renamed.so"
    copy.write_bytes(Path(_cudart()).read_bytes())
    assert [lib.kind for lib in libs.override_libraries([str(copy)])] == ["cudart"]


# ---- clock ------------------------------------------------------------------------------

def test_clock_offset_maps_monotonic_to_wall_time() -> None:
    cm = clock.ClockMap()
    mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    wall = time.time_ns()
    assert abs(cm.to_wall(mono) - wall) < 50_000_000
    s = cm.samples[0]
    assert 0 <= s.window_ns < 10_000_000 and s.error_ns > s.window_ns // 2
    max_err, synced = clock.kernel_max_error_ns()
    assert max_err is not None and max_err >= 0 and synced in (True, False)
    assert not cm.maybe_resample()  # too soon
    assert cm.maybe_resample(s.mono_ns + cm.resample_every_ns + 1)
    assert len(cm.as_json()) == 2 and cm.error_ns >= s.error_ns - 1


# ---- headers ---------------------------------------------------------------------------

def test_overlay_merges_trees_later_layers_win(tmp_path: Path) -> None:
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    (a / "include" / "linux").mkdir(parents=True)
    (a / "include" / "linux" / "x.h").write_text("a")
    (a / "include" / "same.h").write_text("a")
    (b / "include" / "generated").mkdir(parents=True)
    (b / "include" / "same.h").write_text("b")
    headers._overlay(out, [a, b])
    assert (out / "include" / "linux" / "x.h").read_text() == "a"
    assert (out / "include" / "same.h").read_text() == "b"
    assert (out / "include" / "generated").is_dir()


def test_tiny_tree_has_kconfig_and_the_stubs_bcc_needs(tmp_path: Path) -> None:
    config = tmp_path / "config.gz"
    config.write_bytes(gzip.compress(b"CONFIG_BPF=y\nCONFIG_HZ=250\nCONFIG_X=m\n# c\n"))
    root = tmp_path / "tree"
    root.mkdir()
    headers._write_tiny_tree(root, config, "6.18.44-test")
    kconfig = (root / "include/linux/kconfig.h").read_text()
    assert "#define CONFIG_BPF 1" in kconfig and "#define CONFIG_HZ 250" in kconfig
    assert "#define CONFIG_X_MODULE 1" in kconfig
    version = (root / "include/linux/version.h").read_text()
    assert f"LINUX_VERSION_CODE {(6 << 16) + (18 << 8) + 44}" in version
    assert "struct pt_regs" in (root / "arch/x86/include/asm/ptrace.h").read_text()
    assert (root / "include/uapi/linux/bpf.h").read_text().startswith("#include <bcc/bpf.h>")


def test_forced_unknown_route_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETD_HEADERS", "nonsense")
    with pytest.raises(ValueError, match="unknown header route"):
        list(headers.candidate_routes())


# ---- CLI validation --------------------------------------------------------------------

def _trace_args(*argv: str) -> argparse.Namespace:
    from fleetd.cli import trace_cmd

    parser = argparse.ArgumentParser()
    trace_cmd.register(parser.add_subparsers())
    return parser.parse_args(["trace", *argv])


def test_trace_config_from_flags(tmp_path: Path) -> None:
    from fleetd.cli.trace_cmd import build_config

    cfg = build_config(_trace_args("--pid", "5", "--pid", "5", "--db", str(tmp_path / "d.db"),
                                   "--node", "gpu-1", "--no-host", "--sample", "1",
                                   "--offcpu-min", "1ms", "--layers", "cuda"))
    assert cfg.pids == [5] and cfg.node == "gpu-1" and cfg.layers == frozenset({"cuda"})
    assert cfg.sample == 1 and cfg.thresholds_ns["offcpu"] == 1_000_000
    assert not cfg.system_wide
    assert build_config(_trace_args("--db", str(tmp_path / "x"))).system_wide


@pytest.mark.parametrize("argv, match", [
    (["--node", "a:b"], "invalid node name 'a:b'"),
    (["--offcpu-min", "fast"], "--offcpu-min: invalid duration 'fast'"),
    (["--ring-mb", "3"], "--ring-mb 3 is not a power of two"),
    (["--layers", "cuda,gpu"], "--layers: unknown 'gpu'"),
    (["--sample", "-1"], "--sample -1 is negative"),
    (["--pid", "0"], "--pid 0 is not a process id"),
])
def test_bad_trace_flags_say_what_is_wrong(argv: list[str], match: str) -> None:
    from fleetd.cli.trace_cmd import build_config

    with pytest.raises(FleetdError, match=re.escape(match)) as info:
        build_config(_trace_args(*argv))
    assert info.value.hint


def test_bad_duration_exits_2_without_traceback() -> None:
    r = subprocess.run([FLEETD, "trace", "--duration", "soon"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "invalid duration 'soon'" in r.stderr and "Traceback" not in r.stderr


# ---- the reference workload --------------------------------------------------------------

def test_workload_counts_its_calls_and_returns_no_gpu_errors() -> None:
    mod = _workload_module()
    w = mod.Workload(mod.Config(steps=5, launches=3, memcpy=1, host_syncs=1, alloc_churn=1,
                                graph=True))
    s = w.run()
    assert s.calls["cudaLaunchKernel"] == 15 and s.calls["cudaStreamSynchronize"] == 5
    assert s.calls["cudaMalloc"] == s.calls["cudaFree"] == 5
    assert sum(s.calls.values()) == 5 * w.calls_per_step()
    codes = {int(c) for by in s.returns.values() for c in by}
    assert codes <= {35, 100}
    assert s.pid == os.getpid() and s.steps == 5


def test_workload_cli_prints_one_json_summary(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(WORKLOAD), "--steps", "3", "--launches", "2",
                        "--dstate", "vfork:1", "--gpu-ms", "2"], capture_output=True,
                       text=True, timeout=60, check=True)
    s = json.loads(r.stdout)
    assert s["calls"]["cudaLaunchKernel"] == 6 and s["blocked_s"] > 0
    assert s["elapsed_s"] >= 3 * 0.002
