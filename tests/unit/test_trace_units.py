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
from fleetd.trace.bpf import probes
from fleetd.trace.bpf.bpfsrc import REC, ProgramOptions, cflags, probe_wrappers, source_text
from fleetd.trace.bpf.decoder import Decoder, launch_args, nccl_id_hash
from fleetd.trace.host import clock, headers, libs, procinfo

from conftest import FLEETD, REPO

WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
NCCL_WORKLOAD = REPO / "tests" / "workloads" / "nccl_ranks.py"


def _load(path: Path) -> ModuleType:
    """A workload script imported as a module of its own name (its helpers, not its run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def _workload_module() -> ModuleType:
    return _load(WORKLOAD)


def _nccl_ranks() -> ModuleType:
    return _load(NCCL_WORKLOAD)


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


def test_a_stacked_wakeup_is_the_wakers_stack() -> None:
    """A wakeup that carries a stack (its Python frames appended as to a CUDA record)
    carries the waker's: symbolized in the waker's process, not the woken one's."""
    from fleetd.trace.bpf.bpfsrc import PYFRAME, PYSTACK_HEAD

    frames = PYSTACK_HEAD.pack(2, 1) + PYFRAME.pack(0x10, 0x20) + PYFRAME.pack(0x30, 0x40)
    d = Decoder(lambda mono: mono)
    b = d.decode([
        _rec("wakeup", pid=7, tid=8, peer=42, peer_pid=40, stack=5, comm=b"py-busy") + frames,
        _rec("wakeup", pid=7, tid=8, peer=43, peer_pid=40, comm=b"py-busy"),
        _rec("cudaStreamSynchronize", pid=7, tid=8, peer_pid=40, stack=6) + frames,
    ])
    assert [(r.row, r.pid, r.native, r.py, r.py_status) for r in b.stacks] == [
        (0, 40, 5, [(0x10, 0x20), (0x30, 0x40)], 1), (2, 7, 6, [(0x10, 0x20), (0x30, 0x40)], 1)]


def test_waker_stacks_are_on_with_stacks_and_rate_limited() -> None:
    """The cost guard reaches C: on with stacks, one stack per thread pair per 20 ms by
    default; the counters it keeps line up with bpf/fleetd.h."""
    from fleetd.trace.bpf.bpfsrc import COUNTERS

    on = cflags(ProgramOptions(tracer_pid=1, stacks=True))
    assert "-DFL_WAKE_STACKS=1" in on and "-DFL_WAKE_STACK_NS=20000000ull" in on
    off = cflags(ProgramOptions(tracer_pid=1, stacks=True, wake_stack_ns=None))
    assert "-DFL_WAKE_STACKS=0" in off
    header = (REPO / "bpf" / "fleetd.h").read_text()
    index = {int(n): name for name, n in re.findall(r"#define (FL_C_\w+) (\d+)", header)}
    assert index[COUNTERS.index("wake_stacks")] == "FL_C_WAKE_STACK"
    assert index[COUNTERS.index("wake_stacks_skipped")] == "FL_C_WAKE_STACK_SKIP"
    n = int(re.search(r"#define FL_NCOUNTERS (\d+)", header).group(1))  # type: ignore[union-attr]
    assert len(COUNTERS) <= n and sorted(index) == list(range(len(COUNTERS)))


def _nccl(op: str, **kw: int) -> bytes:
    return _rec(op, a1=kw.pop("a1", -1), **kw)


def test_decoder_nccl_collectives_carry_dtype_redop_seq_and_stream() -> None:
    d = Decoder(lambda mono: mono)
    comm = 0x5555_0000_1000
    b = d.decode([
        _nccl("ncclAllReduce", a0=1000, ret=4, bytes=4000, x0=7 | 2 << 32, x1=comm, x2=3,
              x3=0xABC),
        _nccl("ncclReduce", a0=8, a1=1, x0=9 | 4 << 32, x2=4),
        _nccl("ncclReduceScatter", a0=8, x0=7 | 99 << 32, x2=5),  # a custom op: raw
        _nccl("ncclBroadcast", a0=8, a1=0, x0=42 | 1 << 32, x2=6),  # no redop on broadcast
        _nccl("ncclSend", a0=16, a1=2, x0=0, x2=1),
        _nccl("ncclAllGather", a0=8, x0=7, x2=0),  # the sequence map was full: no seq
    ])
    args = dict(b.args)
    assert args[0] == {"dtype": "float32", "comm": "0x555500001000", "stream": "0xabc",
                       "redop": "max", "seq": 3}
    assert args[1] == {"dtype": "bfloat16", "comm": "0x0", "redop": "avg", "seq": 4}
    assert args[2]["redop"] == 99 and args[3] == {"dtype": 42, "comm": "0x0", "seq": 6}
    assert args[4] == {"dtype": "int8", "comm": "0x0", "seq": 1}
    assert args[5] == {"dtype": "float32", "comm": "0x0"}
    assert b.rows[0][5:10] == (4, 4000, 0, 1000, -1)  # ret, bytes, peer, count, root -1
    assert b.rows[1][9] == 1  # the root in a1


def test_decoder_nccl_communicators_name_their_collectives() -> None:
    d = Decoder(lambda mono: mono)
    comm, h = 0x7F00_0000_2000, 0x0123_4567_89AB_CDEF
    b = d.decode([
        _nccl("ncclCommInitRank", a0=4, a1=2, x0=h, x1=comm),
        _nccl("ncclAllReduce", a0=1, x0=7, x1=comm, x2=1),
        _nccl("ncclAllReduce", pid=8, a0=1, x0=7, x1=comm, x2=1),  # another process
        _nccl("ncclCommInitRankConfig", pid=9, ret=1, a0=4, a1=3, x0=h, x1=0),  # failed
        _nccl("ncclAllReduce", pid=9, a0=1, x0=7, x1=0, x2=1),
        _nccl("ncclCommSplit", a0=1, a1=5, x0=comm, x1=0x9000),
        _nccl("ncclGroupStart"), _nccl("ncclGroupEnd"), _nccl("ncclCommInitAll", a0=8),
        _nccl("ncclCommDestroy", x1=comm),
        _nccl("ncclBroadcast", a0=1, a1=0, x0=7, x1=comm, x2=2),  # after destroy
    ])
    args = dict(b.args)
    assert args[0] == {"comm": "0x7f0000002000", "comm_hash": "0123456789abcdef"}
    assert b.rows[0][8:10] == (4, 2)  # nranks, rank
    assert args[1]["comm_hash"] == "0123456789abcdef" and (args[1]["rank"],
                                                           args[1]["nranks"]) == (2, 4)
    assert "comm_hash" not in args[2]  # the handle is per process
    assert args[3] == {"comm": "0x0", "comm_hash": "0123456789abcdef"}
    assert "comm_hash" not in args[4]  # a failed init creates nothing: NULL is never named
    assert args[5] == {"parent": "0x7f0000002000", "color": 1, "key": 5, "comm": "0x9000"}
    assert 6 not in args and 7 not in args and 8 not in args and b.rows[8][8] == 8
    assert args[9] == {"comm": "0x7f0000002000"}
    assert "comm_hash" not in args[10]
    # An in-progress (non-blocking) init hands out its communicator too.
    b = d.decode([_nccl("ncclCommInitRankConfig", ret=7, a0=2, a1=0, x0=h, x1=0x10),
                  _nccl("ncclSend", a0=1, a1=1, x0=7, x1=0x10, x2=1)])
    assert dict(b.args)[1]["rank"] == 0


def test_nccl_unique_id_hash_is_fixed() -> None:
    # The same function runs in BPF (bpf/nccl.bpf.c): changing either breaks matching
    # of ranks recorded by different fleetd versions.
    assert f"{nccl_id_hash(bytes(range(128))):016x}" == "d9fac8c1b98f6bbd"
    assert f"{nccl_id_hash(bytes(128)):016x}" == "68752350ae1d483f"
    with pytest.raises(ValueError, match="128 bytes"):
        nccl_id_hash(b"short")
    c = " ".join((REPO / "bpf" / "nccl.bpf.c").read_text().split())
    for const in ("0xcbf29ce484222325ull", "0x100000001b3ull", "0xbf58476d1ce4e5b9ull",
                  "0x94d049bb133111ebull", "h ^= h >> 30;", "h ^= h >> 27;", "h ^= h >> 31;"):
        assert const in c


def test_nccl_ops_keep_their_codes() -> None:
    names = ["ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
             "ncclReduceScatter", "ncclSend", "ncclRecv", "ncclCommInitRank",
             "ncclCommInitRankConfig", "ncclCommInitAll", "ncclCommSplit", "ncclGroupStart",
             "ncclGroupEnd", "ncclCommDestroy", "ncclCommAbort"]
    assert [BY_NAME[n].code for n in names] == list(range(400, 415))
    assert (BY_NAME["ncclCommInitRank"].a0, BY_NAME["ncclCommInitRank"].a1) == ("nranks",
                                                                                "rank")
    assert all(s.always for s in probes.SPECS if s.kind == "nccl")
    assert {s.op for s in probes.SPECS_BY_KIND["nccl"]} == set(names)


def test_job_comes_from_the_torchrun_environment() -> None:
    assert procinfo.job_of({"TORCHELASTIC_RUN_ID": "job-7", "MASTER_ADDR": "10.0.0.1",
                            "MASTER_PORT": "29500"}) == "job-7"
    # torchrun's default run id names no job: the rendezvous address does.
    assert procinfo.job_of({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1",
                            "MASTER_PORT": "29500"}) == "10.0.0.1:29500"
    assert procinfo.job_of({"MASTER_ADDR": "10.0.0.1"}) is None
    assert procinfo.job_of({}) is None
    row = procinfo.process_row(os.getpid())
    assert "job" in row and {"rank", "local_rank", "world_size"} <= set(row)


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
    ex = probes.library_symbols(path)  # the entry points the probes want
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


def test_the_nccl_wheel_is_found_like_the_runtime_wheel() -> None:
    nccl = _nccl_ranks().find_nccl()
    assert Path(nccl).name == "libnccl.so.2"
    found = {lib.ino: lib for lib in libs.search_usual_places()}
    lib = found[os.stat(nccl).st_ino]
    assert (lib.kind, lib.found_by) == ("nccl", "venv")
    ex = probes.library_symbols(nccl)
    for spec in probes.SPECS_BY_KIND["nccl"]:
        assert probes.planned_symbols(spec, ex.offsets), spec.op


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


# ---- the multi-rank NCCL workload ----------------------------------------------------------

def test_nccl_workload_ranks_run_in_lockstep_and_report_their_calls() -> None:
    r = subprocess.run([sys.executable, str(NCCL_WORKLOAD), "--spawn", "2", "--steps", "7",
                        "--ops", "allreduce,broadcast", "--extra-ms-rank", "1:2"],
                       capture_output=True, text=True, timeout=60, check=True)
    ranks = {d["rank"]: d for d in map(json.loads, r.stdout.splitlines())}
    assert sorted(ranks) == [0, 1]
    a, b = ranks[0], ranks[1]
    assert a["job"] == b["job"] and a["unique_id"] == b["unique_id"]
    assert len(bytes.fromhex(a["unique_id"])) == 128
    assert a["counts"] == {"ncclCommInitRank": 1, "ncclAllReduce": 4, "ncclBroadcast": 3,
                           "ncclCommDestroy": 1}
    assert a["init"]["ret"] != 0 or a["init"]["comm"] != "0x0"
    colls = [c for c in b["calls"] if c["op"] in ("ncclAllReduce", "ncclBroadcast")]
    assert [c["count"] for c in colls] == [1024 + i for i in range(7)]
    assert [c.get("root") for c in colls if c["op"] == "ncclBroadcast"] == [1, 1, 1]
    assert b["elapsed_s"] >= 7 * 0.002  # the extra compute of rank 1


def test_nccl_workload_rank_without_coordinator_exits_instead_of_hanging() -> None:
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "9", "TORCHELASTIC_RUN_ID": "lonely"}  # nobody listens on 9
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(NCCL_WORKLOAD), "--barrier-timeout", "1"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 3 and time.monotonic() - t0 < 20, r
    s = json.loads(r.stdout)
    assert s["job"] == "lonely" and "coordinator" in s["error"]
