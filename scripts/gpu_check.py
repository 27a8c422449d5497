"""The one-command check of fleetd on a GPU machine, from the offline bundle (issue 30).

Run by ``scripts/gpu-check.sh`` through the bundle's launcher (``fleetd-bundle/bin/
fleetd-python``), so that everything fleetd needs comes from the bundle and the node's
own python3. It writes ``OUT/gpu-check.json`` and ``OUT/gpu-check.db`` and exits 1
naming every item that does not hold.

GPU mode (a GPU and torch in that python3): a small model trains on the GPU, eager and
as a captured CUDA graph replayed, in one process that fleetd attaches to and detaches
from between phases: untraced, traced (default settings), untraced again, then traced
with every call kept (``--sample 1``) and stacks of slow calls while the PyTorch profiler
records the same steps; its trace is imported into the same database. A torch.distributed
NCCL job (world size 1: NCCL refuses two ranks on one GPU) runs traced, then untraced.

Dry-run mode (no GPU, or no torch): the project's reference workloads shipped in the
bundle (``train_loop.py`` over the real CUDA runtime, which fails fast without a device
while the probes still fire; ``nccl_ranks.py`` over the real libnccl, two ranks) stand in
for torch, with the libraries of ``--workload-libs``. The call counts are checked against
the workload's own; what only a GPU can show is reported as ``skipped: no GPU``.

Sub-commands ``torch-job`` and ``nccl-job`` are the GPU workloads themselves, run by the
node's python3 with the bundle's paths taken out of the environment.

For tests only: ``FLEETD_GPU_CHECK_SIMULATE=1`` runs the GPU mode's orchestration (phases,
attaching and detaching, the profiler's trace imported and compared in its window) on a
machine without a GPU, with ``sim-torch-job`` standing in for the torch job: the reference
workload's CUDA calls, and a Kineto file of exactly the calls it made in the profiled
window. The NCCL part is then the dry run's. Its report says ``gpu-simulated``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import json
import os
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OK, FAIL = "ok", "fail"
NO_GPU = "skipped: no GPU"
TOLERANCE_PCT = 1.0  # calls counted by fleetd vs the profiler, per group
NODE = "gpu-check"
PROFILER_NODE = "gpu-check-profiler"
LAUNCH_OPS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
              "cuGraphLaunch")
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
            "cuCtxSynchronize", "cuStreamSynchronize")
COPY_OPS = ("cudaMemcpy", "cudaMemcpyAsync", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
            "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2")
GROUPS = {"launches": LAUNCH_OPS, "syncs": SYNC_OPS, "copies": COPY_OPS}


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the environment of the workloads ------------------------------------------------------

def clean_env(bundle: Path) -> dict[str, str]:
    """This environment without what the bundle's launcher added: a workload must run
    with the node's own libraries and packages, not the bundle's LLVM or aiohttp."""
    env = dict(os.environ)
    for var in ("LD_LIBRARY_PATH", "PYTHONPATH"):
        kept = [p for p in env.get(var, "").split(":") if p and not p.startswith(str(bundle))]
        if kept:
            env[var] = ":".join(kept)
        else:
            env.pop(var, None)
    for var in ("FLEETD_BUNDLE", "FLEETD_UAPI_INCLUDE"):
        if env.get(var, "").startswith(str(bundle)):
            env.pop(var)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Item(dict[str, Any]):
    """One line of the report: ``status`` ok / fail / skipped: ..., and its figures."""

    def __init__(self, status: str = OK, **kw: Any) -> None:
        super().__init__(status=status, **kw)

    def fail(self, why: str) -> Item:
        self["status"] = FAIL
        self.setdefault("why", []).append(why)
        return self


class Check:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.bundle = Path(os.environ.get("FLEETD_BUNDLE") or HERE.parent).resolve()
        self.fleetd_bin = self.bundle / "bin" / "fleetd"
        self.out = Path(a.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.db = self.out / "gpu-check.db"
        for suffix in ("", "-wal", "-shm"):
            Path(str(self.db) + suffix).unlink(missing_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="fleetd-gpu-check-"))
        self.env = clean_env(self.bundle)
        self.py = sys.executable
        self.deadline = time.monotonic() + a.budget_s
        self.items: dict[str, Item] = {}
        self.report: dict[str, Any] = {"format": "fleetd-gpu-check", "version": 1,
                                       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                time.gmtime())}
        self.t0 = time.monotonic()

    # ---- running things ---------------------------------------------------------------

    def left(self, want: float) -> float:
        return max(5.0, min(want, self.deadline - time.monotonic()))

    def fleetd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.fleetd_bin), *args], capture_output=True, text=True,
                              env=self.env, timeout=self.left(timeout))

    def fleetd_json(self, *args: str, timeout: float = 120) -> tuple[int, Any, str]:
        r = self.fleetd(*args, "--format", "json", timeout=timeout)
        try:
            return r.returncode, json.loads(r.stdout), r.stderr
        except json.JSONDecodeError:
            return r.returncode, None, (r.stderr or r.stdout)[-2000:]

    def q(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with contextlib.closing(sqlite3.connect(self.db)) as c:
            return c.execute(sql, params).fetchall()

    # ---- the parts ------------------------------------------------------------------------

    def run(self) -> int:
        mode = self.a.mode
        self.simulated = os.environ.get("FLEETD_GPU_CHECK_SIMULATE") == "1"
        if self.simulated:
            mode = "gpu"
        self.report["machine"] = machine = self.machine()
        if mode == "auto" and not self.simulated:
            mode = "gpu" if machine.get("cuda_available") else "dry"
        self.mode = mode
        self.report["mode"] = ("gpu-simulated" if self.simulated else "gpu") if mode == "gpu" \
            else "dry-run"
        log(f"mode: {self.report['mode']}; bundle {self.bundle}; python {self.py}")
        steps: list[tuple[str, Any]] = [("bundle", self.check_bundle),
                                        ("check", self.check_fleetd_check)]
        if mode == "gpu":
            steps += [("torch", self.gpu_training),
                      ("nccl", self.dry_nccl if self.simulated else self.gpu_nccl)]
        else:
            self.report["dry_run_note"] = (
                "no GPU here (or no torch in this python3): the reference workloads "
                "train_loop.py (the real CUDA runtime, which fails fast without a device; "
                "the probes still fire) and nccl_ranks.py (the real libnccl, 2 ranks) "
                "stand in for the PyTorch jobs; calls are checked against the workload's "
                "own counts, and what needs a GPU is reported as 'skipped: no GPU'")
            steps += [("train_loop", self.dry_training), ("nccl", self.dry_nccl)]
        steps += [("verdicts", self.verdicts)]
        for name, fn in steps:
            try:
                fn()
            except Exception as exc:  # a part that broke is a failed item, the rest runs
                import traceback
                log(f"{name}: {type(exc).__name__}: {exc}")
                self.items.setdefault(f"{name}_error", Item()).fail(
                    f"{type(exc).__name__}: {exc}: {traceback.format_exc(limit=3)[-800:]}")
        return self.finish()

    def machine(self) -> dict[str, Any]:
        import platform
        m: dict[str, Any] = {"kernel": platform.release(), "arch": platform.machine(),
                             "python": platform.python_version(),
                             "python_path": self.py, "cpus": os.cpu_count()}
        m["header_sources"] = {
            "/proc/config.gz": os.path.exists("/proc/config.gz"),
            "/usr/include/linux": os.path.isdir("/usr/include/linux"),
            f"/lib/modules/{m['kernel']}/build": os.path.isdir(
                f"/lib/modules/{m['kernel']}/build/include"),
            "/usr/src/linux-headers-*": sorted(glob.glob("/usr/src/linux-headers-*"))[:4]}
        if shutil.which("nvidia-smi"):
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True)
            m["gpus"] = [line.strip() for line in r.stdout.splitlines() if line.strip()]
        code = ("import json; import torch; ok = torch.cuda.is_available(); print(json.dumps("
                "{'torch': torch.__version__, 'cuda': torch.version.cuda, 'cuda_available': ok, "
                "'nccl': str(torch.cuda.nccl.version()) if ok else None, "
                "'device': torch.cuda.get_device_name() if ok else None}))")
        with contextlib.suppress(Exception):
            r = subprocess.run([self.py, "-c", code], env=self.env, capture_output=True,
                               text=True, timeout=120)
            if r.returncode == 0:
                m.update(json.loads(r.stdout.strip().splitlines()[-1]))
            else:
                m["torch"] = None
        return m

    # ---- 1. the bundle ------------------------------------------------------------------

    def check_bundle(self) -> None:
        item = Item(path=str(self.bundle))
        info = self.bundle / "BUNDLE.json"
        if info.exists():
            meta = json.loads(info.read_text())
            item["built_for"] = meta.get("python")
            item["fleetd_revision"] = meta.get("fleetd_revision")
        if self.a.unpack_s is not None:
            item["unpack_s"] = self.a.unpack_s
        if self.a.archive and os.path.exists(self.a.archive):
            item["archive"] = {"name": os.path.basename(self.a.archive),
                               "bytes": os.path.getsize(self.a.archive)}
        # Start-up: the launcher, the interpreter and fleetd's CLI. The first run after
        # unpacking also writes the bytecode caches.
        times = []
        for _ in range(4):
            t = time.monotonic()
            r = self.fleetd("--version", timeout=60)
            times.append(time.monotonic() - t)
            if r.returncode != 0:
                item.fail(f"fleetd --version exited {r.returncode}: {r.stderr.strip()[-300:]}")
                break
        item["startup_s"] = {"first": round(times[0], 3),
                             "warm_median": round(statistics.median(times[1:] or times), 3)}
        item["version"] = r.stdout.strip()
        # Where this process (the launcher's python) found the native libraries and the
        # packages: the bundle's, not the node's.
        import bcc  # noqa: F401  (loads libbcc, libclang-cpp, libLLVM)

        maps = Path("/proc/self/maps").read_text().splitlines()
        libs = {}
        for want in ("libbcc.so", "libclang-cpp.so", "libLLVM-14.so", "libz3.so",
                     "libxml2.so", "libelf.so", "libbpf.so", "libffi.so", "libedit.so",
                     "libtinfo.so", "libz.so"):
            paths = {ln.split(None, 5)[5] for ln in maps
                     if len(ln.split(None, 5)) == 6 and f"/{want}" in ln}
            if paths:
                libs[want] = sorted(paths)[0]
        item["native_libraries"] = libs
        for want in ("libbcc.so", "libclang-cpp.so", "libLLVM-14.so"):
            if not libs.get(want, "").startswith(str(self.bundle)):
                item.fail(f"{want} loaded from {libs.get(want)}, not from the bundle")
        mods = {}
        for name in ("fleetd", "bcc", "orjson", "cryptography", "aiohttp", "yaml", "uvloop",
                     "prometheus_client", "elftools"):
            try:
                mod = __import__(name)
                mods[name] = str(Path(mod.__file__ or "").parent)
            except ImportError as exc:
                mods[name] = f"missing: {exc}"
        item["python_modules"] = mods
        for name in ("fleetd", "bcc"):
            if not mods[name].startswith(str(self.bundle)):
                item.fail(f"{name} imported from {mods[name]}, not from the bundle")
        for name, where in mods.items():
            if where.startswith("missing"):
                item.fail(f"python module {name} {where}")
        self.items["bundle"] = item

    # ---- 2. fleetd check --------------------------------------------------------------------

    def check_fleetd_check(self) -> None:
        args = ["check", "--only", "host,cuda"]
        for lib in self.dry_libs() if self.mode == "dry" or self.simulated else []:
            args += ["--cuda-lib", lib]
        t = time.monotonic()
        code, data, err = self.fleetd_json(*args, timeout=240)
        item = Item(exit=code, seconds=round(time.monotonic() - t, 1))
        if data is None:
            self.items["check"] = item.fail(f"no JSON from fleetd check: {err[-500:]}")
            return
        checks = data.get("checks", [])
        item["failed"] = [f"{c['name']}: {c['detail']}" for c in checks if c["status"] == "fail"]
        item["warnings"] = [f"{c['name']}: {c['detail']}" for c in checks if c["status"] == "warn"]
        byname = {c["name"]: c for c in checks}
        item["headers"] = byname.get("headers", {}).get("detail")
        item["python_stacks"] = byname.get("python stacks", {}).get("detail")
        item["libraries"] = byname.get("cuda-libraries", {}).get("detail")
        per_lib: dict[str, dict[str, str]] = {}
        for c in checks:
            for prefix in ("symbols ", "probes "):
                if c["name"].startswith(prefix):
                    lib = c["name"][len(prefix):]
                    per_lib.setdefault(lib, {})[prefix.strip()] = f"{c['status']}: {c['detail']}"
        item["per_library"] = per_lib
        item["programs"] = byname.get("programs", {}).get("detail")
        if code != 0 or item["failed"]:
            item.fail(f"fleetd check exited {code}: {'; '.join(item['failed'])[:600]}")
        if not any(k.startswith("libcudart") for k in per_lib):
            item.fail("no libcudart found to probe")
        for lib, got in per_lib.items():
            if not got.get("probes", "").startswith("ok"):
                item.fail(f"probes {lib}: {got.get('probes', 'not attached')}")
        self.items["check"] = item

    # ---- tracing ------------------------------------------------------------------------------

    def trace(self, pids: list[int], *extra: str) -> Tracing:
        return Tracing(self, pids, list(extra))

    # ---- 3. GPU: the training job -----------------------------------------------------------

    def gpu_training(self) -> None:
        ctl = self.work / "torch-ctl"
        ctl.mkdir()
        job = subprocess.Popen([self.py, str(HERE / "gpu_check.py"),
                                "sim-torch-job" if self.simulated else "torch-job", "--ctl",
                                str(ctl), "--steps", str(self.a.steps),
                                "--profiled-steps", str(self.a.profiled_steps)],
                               env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        jl = _Pump(job)
        tj: dict[str, Any] = {}  # filled as the phases end: a later failure keeps them
        self.report["torch_job"] = tj
        try:
            ready = tj["ready"] = wait_json(ctl / "ready.json", job, self.left(240), jl)
            log(f"torch job ready: pid {job.pid}, {ready.get('device')}")
            (ctl / "go-1").touch()
            p1 = tj["p1"] = wait_json(ctl / "p1.json", job, self.left(180), jl)
            with self.trace([job.pid]) as s1:
                (ctl / "go-2").touch()
                p2 = tj["p2"] = wait_json(ctl / "p2.json", job, self.left(180), jl)
            tj["trace_default"] = s1.summary
            (ctl / "go-3").touch()
            p3 = tj["p3"] = wait_json(ctl / "p3.json", job, self.left(180), jl)
            self.items["overhead"] = overhead_item(
                {k: (statistics.mean([p1[k], p3[k]]), p2[k])
                 for k in ("eager_steps_per_s", "graph_steps_per_s")},
                note="untraced = mean of the phases before and after the default trace; "
                     "traced: fleetd trace --pid with default settings")
            log(f"overhead: {self.items['overhead']['runs']}")
            with self.trace([job.pid], "--sample", "1", "--stacks", "--stack-sample", "0",
                            "--stack-slow", self.a.stack_slow) as s2:
                (ctl / "go-4").touch()
                p4 = tj["p4"] = wait_json(ctl / "p4.json", job, self.left(240), jl)
                job.wait(self.left(60))
            tj["trace_full"] = s2.summary
            if job.returncode != 0:
                raise RuntimeError(f"torch job exited {job.returncode}: {jl.text()[-800:]}")
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
            tj["log_tail"] = jl.text()[-1500:]
        self.items["overhead"]["trace_ready_s"] = {"default": s1.ready_s, "full": s2.ready_s}
        # The profiler's trace, into the same database, beside the traced calls.
        trace_file = Path(p4["trace"])
        r = self.fleetd("import", str(trace_file), "--db", str(self.db), "--node", PROFILER_NODE,
                        timeout=180)
        imp = Item(file=trace_file.name, bytes=trace_file.stat().st_size, exit=r.returncode)
        if r.returncode != 0:
            imp.fail(f"fleetd import exited {r.returncode}: {r.stderr[-500:]}")
        else:
            imp["kernels"] = self.q("SELECT count(*) FROM gpu_kernels WHERE node = ?",
                                    PROFILER_NODE)[0][0]
            imp["calls"] = self.q("SELECT count(*) FROM events WHERE node = ?",
                                  PROFILER_NODE)[0][0]
            if not imp["kernels"]:
                imp.fail("no kernels imported from the profiler's trace")
        with contextlib.suppress(OSError), open(trace_file, "rb") as src, \
                gzip.open(self.out / "profiler-trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        self.items["profiler_import"] = imp
        window = (p4["t0_ns"], p4["t1_ns"])
        self.compare_with_profiler(job.pid, window)
        self.kernel_names(job.pid, window)
        self.launch_kinds(job.pid, window)
        self.python_frames(job.pid, "gpu_check.py", slow_ns=_ns(self.a.stack_slow))
        self.items["calls_vs_workload"] = Item(
            "skipped: the torch job keeps no call counts of its own (calls_vs_profiler does)")

    def compare_with_profiler(self, pid: int, window: tuple[int, int]) -> None:
        lo, hi = window
        ours = dict(self.q("SELECT op, count(*) FROM events WHERE node = ? AND pid = ? AND "
                           "ts_ns BETWEEN ? AND ? AND source IN ('cuda', 'graph', 'driver') "
                           "GROUP BY op", NODE, pid, lo, hi))
        theirs = dict(self.q("SELECT op, count(*) FROM events WHERE node = ? AND "
                             "ts_ns BETWEEN ? AND ? GROUP BY op", PROFILER_NODE, lo, hi))
        unprobed = dict(self.q(
            "SELECT json_extract(args, '$.name'), count(*) FROM events WHERE node = ? AND "
            "op = 'cuda_api' AND ts_ns BETWEEN ? AND ? GROUP BY 1 ORDER BY 2 DESC LIMIT 15",
            PROFILER_NODE, lo, hi))
        item = Item(window_ns=[lo, hi], tolerance_pct=TOLERANCE_PCT, groups={}, ops={},
                    profiler_calls_fleetd_does_not_probe=unprobed)
        for op in sorted(set(ours) | set(theirs)):
            if op in ("cuda_api",):
                continue
            item["ops"][op] = {"fleetd": ours.get(op, 0), "profiler": theirs.get(op, 0)}
        # Runtime and driver apart. The profiler's cuda_driver events are the driver calls
        # libraries make themselves (cuBLAS, Triton); whether fleetd's driver probes also
        # see the runtime's own calls into the driver, or the profiler's cuda_runtime
        # events calls of runtimes linked statically into cuBLAS, is what the figures say.
        for group, ops in GROUPS.items():
            for layer, prefix in (("runtime", "cuda"), ("driver", "cu")):
                sel = [o for o in ops if o.startswith(prefix) and
                       (layer == "driver") != o.startswith("cuda")]
                a = sum(ours.get(o, 0) for o in sel)
                b = sum(theirs.get(o, 0) for o in sel)
                if not a and not b:
                    continue
                diff = abs(a - b) / max(b, 1) * 100
                key = f"{group}/{layer}"
                item["groups"][key] = {"fleetd": a, "profiler": b, "diff_pct": round(diff, 2)}
                if diff > TOLERANCE_PCT:
                    item.fail(f"{key}: fleetd {a} vs profiler {b} ({diff:.2f}%)")
        if not item["groups"].get("launches/runtime"):
            item.fail("no runtime launches on either side in the profiled window")
        # Per thread (backward runs on autograd's device thread): where a difference lies.
        marks = ",".join("?" * len(LAUNCH_OPS + SYNC_OPS + COPY_OPS))
        for side, node, extra, params in (("fleetd", NODE, " AND pid = ?", [pid]),
                                          ("profiler", PROFILER_NODE, "", [])):
            rows = self.q(f"SELECT tid, op, count(*) FROM events WHERE node = ?{extra} AND "
                          f"ts_ns BETWEEN ? AND ? AND op IN ({marks}) GROUP BY tid, op",
                          node, *params, lo, hi, *LAUNCH_OPS, *SYNC_OPS, *COPY_OPS)
            per: dict[str, dict[str, int]] = {}
            for tid, op, n in rows:
                per.setdefault(str(tid), {})[op] = n
            item.setdefault("by_thread", {})[side] = per
        self.items["calls_vs_profiler"] = item

    def kernel_names(self, pid: int, window: tuple[int, int]) -> None:
        lo, hi = window
        ours = {n for (n,) in self.q(
            "SELECT DISTINCT json_extract(args, '$.kernel') FROM events WHERE node = ? AND "
            "pid = ? AND ts_ns BETWEEN ? AND ? AND op IN ('cudaLaunchKernel', 'cuLaunchKernel',"
            " 'cuLaunchKernelEx') AND args IS NOT NULL", NODE, pid, lo, hi) if n}
        theirs = dict(self.q(
            "SELECT kernel, count(*) FROM gpu_kernels WHERE node = ? AND ts_ns BETWEEN ? AND ? "
            "GROUP BY kernel", PROFILER_NODE, lo - 10**9, hi + 10**9))
        norm = {_norm(n): n for n in ours}
        matched = {k for k in theirs if _norm(k) in norm}
        total = sum(theirs.values())
        by_count = sum(theirs[k] for k in matched)
        item = Item(fleetd_names=len(ours), profiler_names=len(theirs),
                    matched_names=len(matched),
                    matched_share_of_kernels=round(by_count / total, 3) if total else None,
                    examples_matched=sorted(matched)[:5],
                    examples_unmatched_profiler=sorted(set(theirs) - matched,
                                                      key=lambda k: -theirs[k])[:8],
                    examples_unmatched_fleetd=sorted(set(norm) - {_norm(k) for k in matched})[:8])
        if not matched:
            item.fail("no kernel name fleetd recorded matches one the profiler saw")
        self.items["kernel_names"] = item

    def launch_kinds(self, pid: int, window: tuple[int, int] | None) -> None:
        cond, params = "", []
        if window:
            cond, params = " AND ts_ns BETWEEN ? AND ?", list(window)
        rows = dict(self.q(f"SELECT op, count(*) FROM events WHERE node = ? AND pid = ?{cond} "
                           "AND op IN ('cuLaunchKernel', 'cuLaunchKernelEx', 'cudaGraphLaunch', "
                           "'cuGraphLaunch') GROUP BY op", NODE, pid, *params))
        drv = {k: v for k, v in rows.items() if k.startswith("cuLaunch")}
        item = Item(fleetd=drv)
        if window:
            item["profiler"] = dict(self.q(
                "SELECT op, count(*) FROM events WHERE node = ? AND ts_ns BETWEEN ? AND ? AND "
                "op IN ('cuLaunchKernel', 'cuLaunchKernelEx') GROUP BY op", PROFILER_NODE,
                *window))
        if not drv:
            item.fail("no driver-API launch (cuLaunchKernel/cuLaunchKernelEx) recorded")
        self.items["driver_launches"] = item
        g = Item(fleetd={k: v for k, v in rows.items() if "Graph" in k})
        if window:
            g["profiler"] = dict(self.q(
                "SELECT op, count(*) FROM events WHERE node = ? AND ts_ns BETWEEN ? AND ? AND "
                "op IN ('cudaGraphLaunch', 'cuGraphLaunch') GROUP BY op", PROFILER_NODE,
                *window))
        if not rows.get("cudaGraphLaunch"):
            g.fail("no cudaGraphLaunch recorded")
        self.items["graph_launches"] = g

    def python_frames(self, pid: int, source_file: str, slow_ns: int) -> None:
        rows = self.q("SELECT e.op, e.dur_ns, s.frames FROM events e JOIN stacks s ON "
                      "s.hash = e.stack WHERE e.node = ? AND e.pid = ? AND e.stack != 0 AND "
                      "e.dur_ns >= ? ORDER BY e.dur_ns DESC", NODE, pid, slow_ns)
        with_py = [(op, d, json.loads(f)) for op, d, f in rows
                   if any(".py:" in fr for fr in json.loads(f))]
        ours = [r for r in with_py if any(f"{source_file}:" in fr for fr in r[2])]
        item = Item(slow_calls_with_stack=len(rows), with_python_frames=len(with_py),
                    with_frames_of_the_workload=len(ours), slow_ns=slow_ns,
                    examples=[{"op": op, "dur_ms": round(d / 1e6, 3), "frames": fr[:8]}
                              for op, d, fr in (ours or with_py or
                                                [(o, d, json.loads(f)) for o, d, f in rows])[:3]])
        py = self.items.get("check", Item()).get("python_stacks")
        if py:
            item["fleetd_check_python_stacks"] = py
        if not ours:
            item.fail(f"no slow call (>= {slow_ns / 1e6:g} ms) has a Python frame of "
                      f"{source_file}" + (f" ({py})" if py else ""))
        self.items["python_frames"] = item

    # ---- 4. GPU: NCCL ----------------------------------------------------------------------

    def gpu_nccl(self) -> None:
        ctl = self.work / "nccl-ctl"
        ctl.mkdir()
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        env = dict(self.env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                   WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   TORCHELASTIC_RUN_ID="fleetd-gpu-check")
        job = subprocess.Popen([self.py, str(HERE / "gpu_check.py"), "nccl-job", "--ctl",
                                str(ctl), "--steps", str(self.a.nccl_steps)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        jl = _Pump(job)
        nj: dict[str, Any] = {}
        self.report["nccl_job"] = nj
        try:
            nj["ready"] = wait_json(ctl / "ready.json", job, self.left(240), jl)
            with self.trace([job.pid]) as s3:
                (ctl / "go-1").touch()
                p1 = nj["p1"] = wait_json(ctl / "p1.json", job, self.left(180), jl)
            nj["trace"] = s3.summary
            (ctl / "go-2").touch()
            p2 = nj["p2"] = wait_json(ctl / "p2.json", job, self.left(180), jl)
            self.items.setdefault("overhead", Item(runs={}))["runs"]["nccl"] = _ratio(
                p2["steps_per_s"], p1["steps_per_s"])
            job.wait(self.left(60))
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
            nj["log_tail"] = jl.text()[-1500:]
        self.nccl_item(pids=[job.pid], gpu=True)

    def nccl_item(self, pids: list[int], gpu: bool) -> None:
        marks = ",".join("?" * len(pids))
        inits = self.q("SELECT pid, op, ret, a0, a1, args FROM events WHERE node = ? AND "
                       f"pid IN ({marks}) AND op LIKE 'ncclCommInit%'", NODE, *pids)
        coll = self.q("SELECT op, count(*), sum(ret != 0), "
                      "count(DISTINCT json_extract(args, '$.comm_hash')), "
                      "min(json_extract(args, '$.rank')), max(json_extract(args, '$.nranks')), "
                      "sum(json_extract(args, '$.comm_hash') IS NOT NULL) FROM events "
                      f"WHERE node = ? AND pid IN ({marks}) AND source = 'nccl' AND op NOT LIKE "
                      "'ncclComm%' AND op NOT LIKE 'ncclGroup%' GROUP BY op", NODE, *pids)
        others = dict(self.q("SELECT op, count(*) FROM events WHERE node = ? AND source = 'nccl'"
                             f" AND pid IN ({marks}) GROUP BY op", NODE, *pids))
        comms = []
        for pid, op, ret, nranks, rank, args in inits:
            a = json.loads(args) if args else {}
            comms.append({"pid": pid, "op": op, "ret": ret, "nranks": nranks, "rank": rank,
                          "comm": a.get("comm"), "comm_hash": a.get("comm_hash")})
        item = Item(communicators=comms, ops=others,
                    collectives={op: {"calls": n, "failed": f, "comm_hashes": h,
                                      "rank": r, "nranks": nr, "with_comm_hash": w}
                                 for op, n, f, h, r, nr, w in coll})
        if not comms:
            item.fail("no ncclCommInitRank/ncclCommInitRankConfig recorded: "
                      f"NCCL calls seen: {others or 'none'}")
        elif len({c['comm_hash'] for c in comms}) != 1 or not comms[0]["comm_hash"]:
            item.fail(f"the ranks' init records do not carry one comm_hash: {comms}")
        if not coll:
            item.fail("no collective recorded")
        if gpu:
            for op, c in item["collectives"].items():
                if c["with_comm_hash"] < c["calls"] or c["failed"]:
                    item.fail(f"{op}: {c['with_comm_hash']}/{c['calls']} calls carry a "
                              f"comm_hash, {c['failed']} failed")
        else:
            item["collectives_comm_hash"] = NO_GPU + " (without a device no communicator " \
                "is created: collectives carry comm 0x0 and fail with 4)"
        self.items["nccl"] = item

    # ---- 3'. dry run: the reference workloads ------------------------------------------------

    def dry_libs(self) -> list[str]:
        d = Path(self.a.workload_libs) if self.a.workload_libs else None
        if d is None:
            return []
        return sorted(str(p) for pat in ("libcudart.so*", "libnccl.so*", "libcuda.so*")
                      for p in d.glob(pat))[:3]

    def dry_lib(self, pattern: str) -> str | None:
        d = Path(self.a.workload_libs) if self.a.workload_libs else None
        hits = sorted(d.glob(pattern)) if d else []
        return str(hits[0]) if hits else None

    def dry_training(self) -> None:
        cudart, libcuda = self.dry_lib("libcudart.so*"), self.dry_lib("libcuda.so*")
        if cudart is None:
            raise RuntimeError("dry run: no libcudart in --workload-libs (the "
                               "nvidia-cuda-runtime-cu12 wheel's libcudart.so.12)")
        wl = [self.py, str(HERE / "train_loop.py"), "--cudart", cudart, "--launches", "20",
              "--memcpy", "2", "--host-syncs", "1", "--graph", "--grid", "64,2,1",
              "--kernel", f"{_libc()}:abs"]
        if libcuda:
            wl += ["--driver", "--libcuda", libcuda]
        runs = {}
        # Untraced and traced with the default settings: the overhead; then every call kept
        # with stacks: counts, names, frames.
        # The full run sleeps 5 ms a step: without a GPU its steps take a fraction of a
        # second, and kernel names and Python frames are read from the process while it
        # lives (the tracer drains its rings every few tens of milliseconds; each name is
        # read once, from the first batch that needs it). Every call of it is a record
        # with a Python stack (about 700 bytes): 4,000 a second, so the default 1 MiB
        # ring holds a third of a second of them. On two busy cores the tracer stalls
        # longer than that now and then (a database commit, a new frame to read) and
        # the ring overflowed: 1,195 runtime records lost, counted, in a 3,000-launch run
        # (the driver ring, five calls a step, kept up). The check is of counts, not of
        # a small ring under a burst: the full run's ring holds the whole run.
        for name, trace_args, more in (
                ("untraced", None, []), ("traced", [], []),
                ("full", ["--sample", "1", "--stacks", "--stack-sample", "0",
                          "--stack-slow", "1us", "--ring-mb", "8"], ["--sleep-ms", "5"])):
            runs[name] = self.run_train_loop(wl + ["--steps", str(self.a.dry_steps), *more],
                                             trace_args)
        self.report["train_loop"] = {k: {kk: vv for kk, vv in v.items() if kk != "trace"}
                                     | {"trace": v.get("trace")} for k, v in runs.items()}
        self.items["overhead"] = overhead_item(
            {"train_loop_steps_per_s": (runs["untraced"]["steps_per_s"],
                                        runs["traced"]["steps_per_s"])},
            note="dry run: the reference workload, whose CUDA calls fail fast; "
                 "the overhead of a real training step needs a GPU")
        full = runs["full"]
        pid = full["pid"]
        got = dict(self.q("SELECT op, count(*) FROM events WHERE node = ? AND pid = ? AND "
                          "source IN ('cuda', 'graph', 'driver') GROUP BY op", NODE, pid))
        made = {k: v for k, v in full["calls"].items() if k != "cuInit"}
        item = Item(reference="the workload's own counts (train_loop.py summary)",
                    ops={op: {"fleetd": got.get(op, 0), "workload": n} for op, n in made.items()})
        for op, n in made.items():
            if got.get(op, 0) != n:
                item.fail(f"{op}: fleetd {got.get(op, 0)} vs workload {n}")
        lost = (full.get("trace") or {}).get("lost") or {}
        if any(lost.values()):
            # Say where the missing records went: a full ring, not missing probes.
            item["lost_by_the_tracer"] = {k: v for k, v in lost.items() if v}
        extra = set(got) - set(made)
        if extra:
            item.fail(f"recorded but not made: {sorted(extra)}")
        self.items["calls_vs_workload"] = item
        self.items["calls_vs_profiler"] = Item(NO_GPU + " (no PyTorch profiler without torch)")
        names = dict(self.q("SELECT json_extract(args, '$.kernel'), count(*) FROM events WHERE "
                            "node = ? AND pid = ? AND op = 'cudaLaunchKernel' GROUP BY 1",
                            NODE, pid))
        kn = Item(runtime_launch_names=names, expected="abs",
                  against_profiler=NO_GPU)
        if "abs" not in names:
            kn.fail(f"the launched function (libc's abs) was not named: {names}")
        self.items["kernel_names"] = kn
        self.launch_kinds(pid, None)
        if not libcuda:
            self.items["driver_launches"] = Item(
                "skipped: no libcuda.so.1 in --workload-libs (scripts/fetch-libcuda.sh)")
        self.python_frames(pid, "train_loop.py", slow_ns=1_000)
        self.items["python_frames"]["note"] = ("dry run: no call is slow without a GPU, so "
                                               "every call of 1 us or more got a stack")
        self.synthetic_profiler(pid, full)

    def run_train_loop(self, cmd: list[str], trace_args: list[str] | None) -> dict[str, Any]:
        go = self.work / f"go-{time.monotonic_ns()}"
        wl = subprocess.Popen([*cmd, "--go-file", str(go)], env=self.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_mapped(wl.pid, "libcudart", 60)
            if trace_args is None:
                go.touch()
                out, err = wl.communicate(timeout=self.left(120))
                summary = None
            else:
                with self.trace([wl.pid], *trace_args) as tr:
                    go.touch()
                    out, err = wl.communicate(timeout=self.left(120))
                summary = tr.summary
            if wl.returncode != 0:
                raise RuntimeError(f"train_loop exited {wl.returncode}: {err[-600:]}")
            res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
            res["trace"] = summary
            return res
        finally:
            if wl.poll() is None:
                wl.kill()
                wl.wait()

    def synthetic_profiler(self, pid: int, run: dict[str, Any]) -> None:
        """Without torch there is no profiler: a small Kineto file in its format, placed
        in the traced run's window, so the import and `fleetd gpu` are exercised from the
        bundle. Its contents are made up; no comparison is drawn from it."""
        t0_us = int(time.time() * 1e6) - 5_000_000
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}}]
        t = t0_us
        corr = 1
        for step in range(20):
            events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}",
                           "pid": pid, "tid": pid, "ts": t, "dur": 900})
            for k in range(3):
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                               "pid": pid, "tid": pid, "ts": t + 10 + 100 * k, "dur": 8,
                               "args": {"correlation": corr}})
                events.append({"ph": "X", "cat": "kernel", "name": f"synthetic_kernel_{k}",
                               "pid": 0, "tid": 7, "ts": t + 30 + 100 * k, "dur": 60,
                               "args": {"correlation": corr, "device": 0, "stream": 7,
                                        "grid": [64, 1, 1], "block": [128, 1, 1]}})
                corr += 1
            t += 1000
        path = self.work / "synthetic-kineto.json"
        path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
        r = self.fleetd("import", str(path), "--db", str(self.db), "--node", PROFILER_NODE,
                        timeout=120)
        item = Item(synthetic=True, note="dry run: no PyTorch profiler; a made-up Kineto file "
                    "exercises fleetd import and gpu from the bundle", exit=r.returncode,
                    against_the_trace=NO_GPU)
        if r.returncode != 0:
            item.fail(f"fleetd import exited {r.returncode}: {r.stderr[-500:]}")
        else:
            item["kernels"] = self.q("SELECT count(*) FROM gpu_kernels WHERE node = ?",
                                     PROFILER_NODE)[0][0]
            if item["kernels"] != 60:
                item.fail(f"{item['kernels']} kernels imported, 60 written")
        self.items["profiler_import"] = item

    def dry_nccl(self) -> None:
        nccl = self.dry_lib("libnccl.so*")
        if nccl is None:
            self.items["nccl"] = Item("skipped: no libnccl.so in --workload-libs")
            return
        cmd = [self.py, str(HERE / "nccl_ranks.py"), "--spawn", "2", "--nccl", nccl,
               "--steps", str(self.a.dry_nccl_steps), "--barrier-timeout", "60"]
        cudart = self.dry_lib("libcudart.so*")
        if cudart:
            cmd += ["--cudart", cudart]
        secs = {}
        pids: list[int] = []
        for traced in (False, True):
            go = self.work / f"nccl-go-{int(traced)}"
            wl = subprocess.Popen([*cmd, "--go-file", str(go)], env=self.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
            try:
                assert wl.stdout is not None
                ready = json.loads(wl.stdout.readline())
                if traced:
                    with self.trace([wl.pid], "--no-host") as tr:
                        t = time.monotonic()
                        go.touch()
                        out, err = wl.communicate(timeout=self.left(120))
                        secs["traced"] = time.monotonic() - t
                    self.report["nccl_ranks"] = {"trace": tr.summary}
                    pids = list(ready.get("pids", []))
                else:
                    t = time.monotonic()
                    go.touch()
                    out, err = wl.communicate(timeout=self.left(120))
                    secs["untraced"] = time.monotonic() - t
                if wl.returncode != 0:
                    raise RuntimeError(f"nccl_ranks exited {wl.returncode}: {err[-600:]}")
            finally:
                if wl.poll() is None:
                    os.killpg(wl.pid, signal.SIGKILL)
                    wl.wait()
        steps = self.a.dry_nccl_steps
        self.items.setdefault("overhead", Item(runs={}))["runs"]["nccl_ranks"] = _ratio(
            steps / secs["untraced"], steps / secs["traced"])
        self.nccl_item(pids=pids, gpu=False)

    # ---- 5. verdicts ------------------------------------------------------------------------

    def verdicts(self) -> None:
        item = Item()
        code, data, err = self.fleetd_json("explain", "--db", str(self.db), timeout=180)
        if data is None:
            item.fail(f"explain: exit {code}: {err[-400:]}")
        else:
            item["explain"] = {"exit": code, "verdict": data.get("verdict"),
                               "chains": [{k: c.get(k) for k in ("severity", "root_cause",
                                                                 "summary")}
                                          for c in data.get("chains", [])[:5]]}
        code, data, err = self.fleetd_json("gpu", "--db", str(self.db), timeout=180)
        if data is None:
            item.fail(f"gpu: exit {code}: {err[-400:]}")
        else:
            item["gpu"] = {"exit": code, "note": data.get("note"),
                           "ranks": [{k: r.get(k) for k in ("node", "pid", "device", "idle_pct",
                                                            "compute_pct", "comm_pct",
                                                            "tklqt_reading")}
                                     | {"host_overhead": r.get("verdict", {}).get(
                                         "host_overhead")}
                                     for r in data.get("ranks", [])],
                           "top_kernels": [k.get("name") for k in data.get("kernels", [])[:5]]}
            if not data.get("ranks"):
                item.fail("gpu: no rank with GPU activity")
        code, data, err = self.fleetd_json("collectives", "--db", str(self.db), timeout=180)
        if data is None:
            item.fail(f"collectives: exit {code}: {err[-400:]}")
        else:
            item["collectives"] = {"exit": code, "verdict": data.get("verdict"),
                                   "matching": data.get("matching"),
                                   "communicators": [{k: c.get(k) for k in (
                                       "key", "matching", "nranks", "instances", "judged",
                                       "verdict")} for c in data.get("communicators", [])],
                                   "notes": data.get("notes", [])[:3]}
            if not data.get("communicators") and self.mode == "dry":
                item.fail("collectives: no communicator of the two ranks")
        self.items["verdicts"] = item

    # ---- the report ---------------------------------------------------------------------------

    def finish(self) -> int:
        self.report["duration_s"] = round(time.monotonic() - self.t0, 1)
        self.report["items"] = self.items
        failed = [k for k, v in self.items.items() if v["status"] == FAIL]
        self.report["failed"] = failed
        self.report["status"] = FAIL if failed else OK
        with contextlib.suppress(sqlite3.Error), \
                contextlib.closing(sqlite3.connect(self.db)) as c:  # one file: WAL folded in
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = self.db.stat().st_size if self.db.exists() else 0
        self.report["db_bytes"] = size
        if size > 15 * 2**20:  # what comes back from a device machine: 16 MiB a file
            with open(self.db, "rb") as src, gzip.open(self.out / "gpu-check.db.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            self.report["db_note"] = "gpu-check.db is over 15 MiB: gpu-check.db.gz beside it"
        (self.out / "gpu-check.json").write_text(json.dumps(self.report, indent=1,
                                                            default=str) + "\n")
        for k, v in self.items.items():
            extra = f": {'; '.join(v.get('why', []))[:400]}" if v["status"] == FAIL else ""
            log(f"{k:<20} {v['status']}{extra}")
        log(f"{self.report['mode']} finished in {self.report['duration_s']} s: "
            f"{self.out / 'gpu-check.json'}")
        shutil.rmtree(self.work, ignore_errors=True)
        if failed:
            print(f"gpu-check: FAIL: {', '.join(failed)}", file=sys.stderr)
            return 1
        print("gpu-check: ok", file=sys.stderr)
        return 0


# ---- helpers -------------------------------------------------------------------------------

class _Pump:
    """A child's stdout and stderr read on threads, kept (the pipes never fill)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.parts: list[str] = []
        self.threads = [threading.Thread(target=self._read, args=(s,), daemon=True)
                        for s in (proc.stdout, proc.stderr) if s is not None]
        for t in self.threads:
            t.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.parts.append(line)

    def text(self) -> str:
        return "".join(self.parts)


class Tracing:
    """``fleetd trace --pid ...`` for a ``with`` block: attached when the block starts
    (the tracer said it is tracing), stopped (SIGINT, which flushes) when it ends unless
    the traced processes ended first."""

    MARKER = "fleetd: tracing"

    def __init__(self, check: Check, pids: list[int], extra: list[str]) -> None:
        self.check, self.pids, self.extra = check, pids, extra
        self.summary: dict[str, Any] | None = None
        self.ready_s = 0.0

    def __enter__(self) -> Tracing:
        cmd = [str(self.check.fleetd_bin), "trace", "--db", str(self.check.db), "--node", NODE,
               "--summary-json", *self.extra]
        for pid in self.pids:
            cmd += ["--pid", str(pid)]
        t = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=self.check.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.seen = threading.Event()
        self.out: list[str] = []
        threading.Thread(target=self._err, daemon=True).start()
        threading.Thread(target=self._out, daemon=True).start()
        self.seen.wait(self.check.left(120))
        if not any(self.MARKER in ln for ln in self.lines):
            self.proc.kill()
            raise RuntimeError(f"fleetd trace did not start: {''.join(self.lines)[-1000:]}")
        self.ready_s = round(time.monotonic() - t, 2)
        return self

    def _err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if self.MARKER in line:
                self.seen.set()
        self.seen.set()

    def _out(self) -> None:
        assert self.proc.stdout is not None
        self.out.append(self.proc.stdout.read())

    def __exit__(self, *exc: object) -> None:
        # Traced processes that ended stop the tracer by themselves (a SIGINT then could
        # land in its shutdown); live ones are detached from with SIGINT, which flushes.
        if any(_alive(pid) for pid in self.pids):
            time.sleep(0.2)  # the last records reach the rings
            self.proc.send_signal(signal.SIGINT)
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.check.left(60))
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(self.check.left(120))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        time.sleep(0.05)
        text = "".join(self.out).strip()
        with contextlib.suppress(json.JSONDecodeError, IndexError):
            self.summary = json.loads(text.splitlines()[-1])
        if self.proc.returncode != 0 and exc[0] is None:
            raise RuntimeError(f"fleetd trace exited {self.proc.returncode}: "
                               f"{''.join(self.lines)[-1000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie has ended
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def wait_json(path: Path, proc: subprocess.Popen[str], timeout: float,
              pump: _Pump | None = None) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        if proc.poll() is not None:
            raise RuntimeError(f"{path.stem}: the job exited {proc.returncode}: "
                               f"{pump.text()[-1500:] if pump else ''}")
        time.sleep(0.05)
    raise RuntimeError(f"{path.stem}: not reached in {timeout:.0f} s: "
                       f"{pump.text()[-1500:] if pump else ''}")


def wait_mapped(pid: int, name: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            if name in Path(f"/proc/{pid}/maps").read_text():
                return
        time.sleep(0.02)
    raise RuntimeError(f"pid {pid} did not map {name} in {timeout} s")


def _ratio(untraced: float, traced: float) -> dict[str, Any]:
    return {"untraced_steps_per_s": round(untraced, 2), "traced_steps_per_s": round(traced, 2),
            "overhead_pct": round((untraced / traced - 1) * 100, 2) if traced else None}


def overhead_item(pairs: dict[str, tuple[float, float]], note: str) -> Item:
    """Steps per second untraced vs traced; reported, not judged (no bound was set)."""
    return Item(note=note, runs={k: _ratio(u, t) for k, (u, t) in pairs.items()})


def _version(v: Any) -> str:
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def _norm(name: str) -> str:
    return " ".join(name.split())


def _libc() -> str:
    for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6",
              "/lib64/libc.so.6", "/usr/lib64/libc.so.6"):
        if os.path.exists(p):
            return p
    return "libc.so.6"


# ---- the GPU jobs (run by the node's python3, torch imported) ---------------------------------

class Ctl:
    def __init__(self, d: str) -> None:
        self.d = Path(d)

    def wait(self, name: str, timeout: float = 600) -> None:
        end = time.monotonic() + timeout
        while not (self.d / name).exists():
            if time.monotonic() > end:
                raise SystemExit(f"{name}: not given in {timeout} s")
            time.sleep(0.01)

    def done(self, name: str, data: dict[str, Any]) -> None:
        tmp = self.d / f".{name}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.d / f"{name}.json")


def torch_job(a: argparse.Namespace) -> int:
    """A small MLP trained on the GPU: eager steps (host-to-device copies, forward,
    backward, SGD, a loss.item() every 25 steps), the same step captured as one CUDA
    graph and replayed, and (when Triton is there) a Triton kernel per eager step, which
    Triton launches through the driver API. Phases are started by the orchestrator."""
    import torch

    ctl = Ctl(a.ctl)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    width, batch = 1024, 256
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
        torch.nn.Linear(2 * width, 2 * width), torch.nn.GELU(),
        torch.nn.Linear(2 * width, width)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_fn = torch.nn.MSELoss()
    host_x = torch.randn(batch, width).pin_memory()
    host_y = torch.randn(batch, width).pin_memory()
    x = host_x.to(dev)
    y = host_y.to(dev)
    scale = _triton_scale(a.ctl)
    big = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def eager_step(i: int) -> None:
        x.copy_(host_x, non_blocking=True)
        y.copy_(host_y, non_blocking=True)
        inp = scale(x) if scale is not None else x
        loss = loss_fn(model(inp), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i % 25 == 24:
            loss.item()

    # Whole-step capture (PyTorch's CUDA graphs notes): warm up on a side stream first.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model(x), y)
        static_loss.backward()
        opt.step()

    def graph_step(i: int) -> None:
        x.copy_(host_x, non_blocking=True)
        y.copy_(host_y, non_blocking=True)
        graph.replay()
        if i % 25 == 24:
            static_loss.item()

    def slow_sync() -> None:
        """Seconds' worth of queued matrix products, then a sync that waits for them:
        a slow call whose stack must show this function."""
        z = big
        for _ in range(16):
            z = z @ big
        torch.cuda.synchronize()

    def timed(step: Any, n: int, slow_every: int = 0) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(n):
            step(i)
            if slow_every and i % slow_every == slow_every - 1:
                slow_sync()
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t)

    for i in range(20):
        eager_step(i)
        graph_step(i)
    slow_sync()
    ctl.done("ready", {"pid": os.getpid(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
                       "triton_kernel": scale is not None})
    n = a.steps
    for phase in ("p1", "p2", "p3"):
        ctl.wait(f"go-{phase[1]}")
        ctl.done(phase, {"eager_steps_per_s": timed(eager_step, n),
                         "graph_steps_per_s": timed(graph_step, n)})
    ctl.wait("go-4")
    from torch.profiler import ProfilerActivity, profile

    trace = Path(a.ctl) / "profiler-trace.json"
    m = a.profiled_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        time.sleep(0.2)  # nothing near the window's edges
        t0 = time.time_ns()
        eager = timed(eager_step, m, slow_every=25)
        graphs = timed(graph_step, m, slow_every=25)
        t1 = time.time_ns()
        time.sleep(0.2)
    prof.export_chrome_trace(str(trace))
    ctl.done("p4", {"t0_ns": t0, "t1_ns": t1, "trace": str(trace), "steps": m,
                    "eager_steps_per_s": eager, "graph_steps_per_s": graphs})
    return 0


# A Triton kernel, which Triton launches through the driver API (cuLaunchKernel). Its own
# module, written beside the control files: Triton reads a kernel's source and globals,
# and this file's annotations are strings (from __future__ import annotations).
_TRITON_SRC = """
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 0.5, mask=mask)
"""


def _triton_scale(where: str) -> Any:
    import importlib.util

    import torch

    try:
        path = Path(where) / "fl_triton_scale.py"
        path.write_text(_TRITON_SRC)
        spec = importlib.util.spec_from_file_location("fl_triton_scale", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)

        def scale(t: Any) -> Any:
            out = torch.empty_like(t)
            n = t.numel()
            mod.scale_kernel[(mod.triton.cdiv(n, 1024),)](t, out, n, BLOCK=1024)
            return out

        scale(torch.ones(8, device="cuda"))
    except Exception as exc:  # no Triton, or one that cannot compile here: run without
        print(f"triton kernel unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return scale


def nccl_job(a: argparse.Namespace) -> int:
    """torch.distributed over NCCL, world size 1 (NCCL refuses two ranks on one GPU):
    per step a matrix product and an all-reduce of its result. The communicator is
    created lazily by the first collective, so the tracer (attached before phase 1)
    sees its init and each collective can carry the communicator's hash."""
    import torch
    import torch.distributed as dist

    # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...) is set by the orchestrator:
    # fleetd reads a rank's identity from /proc/PID/environ, the one the process began with.
    ctl = Ctl(a.ctl)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    w = torch.randn(2048, 2048, device="cuda")

    def step() -> None:
        g = w @ w
        dist.all_reduce(g)
        dist.broadcast(g, 0)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t)

    ctl.done("ready", {"pid": os.getpid(), "nccl": _version(torch.cuda.nccl.version())})
    ctl.wait("go-1")
    for _ in range(5):  # the first collective creates the communicator: traced
        step()
    ctl.done("p1", {"steps_per_s": timed(a.steps)})
    ctl.wait("go-2")
    ctl.done("p2", {"steps_per_s": timed(a.steps)})
    dist.destroy_process_group()
    return 0


def sim_torch_job(a: argparse.Namespace) -> int:
    """The torch job's stand-in for FLEETD_GPU_CHECK_SIMULATE=1 (tests, no GPU): the same
    phases and control files, over the reference workload's real CUDA runtime (calls fail
    fast), launching libc's abs as the kernel; the profiled phase writes a Kineto file of
    exactly the calls it made in its window, each launch with a kernel named abs."""

    sys.path.insert(0, str(HERE))
    from train_loop import Config, Workload

    libs = Path(os.environ["FLEETD_CHECK_WORKLOAD_LIBS"])
    cudart = sorted(libs.glob("libcudart.so*"))
    libcuda = sorted(libs.glob("libcuda.so*"))
    w = Workload(Config(cudart=str(cudart[0]), driver=bool(libcuda),
                        libcuda=str(libcuda[0]) if libcuda else "",
                        kernel=f"{_libc()}:abs"))
    if w.cu is not None:
        w.cu.cuInit(0)
    rec: list[tuple[str, str, int, int]] | None = None
    ctl = Ctl(a.ctl)

    def call(cat: str, op: str, fn: Any, *args: Any) -> None:
        t = time.time_ns()
        fn(*args)
        if rec is not None:
            rec.append((cat, op, t, time.time_ns() - t))

    def eager_step(i: int) -> None:
        for _ in range(2):
            call("cuda_runtime", "cudaMemcpyAsync", w.rt.cudaMemcpyAsync, None, w._host, 4096,
                 1, None)
        for _ in range(6):
            call("cuda_runtime", "cudaLaunchKernel", w.launch)
        if w.cu is not None:
            call("cuda_driver", "cuLaunchKernel", w.cu.cuLaunchKernel, w._func, 8, 1, 1, 32, 1,
                 1, 0, None, None, None)
        if i % 25 == 24:
            call("cuda_runtime", "cudaMemcpy", w.rt.cudaMemcpy, w._host, None, 4, 2)
            call("cuda_runtime", "cudaStreamSynchronize", w.rt.cudaStreamSynchronize, None)
        time.sleep(0.001)

    def graph_step(i: int) -> None:
        call("cuda_runtime", "cudaMemcpyAsync", w.rt.cudaMemcpyAsync, None, w._host, 4096, 1,
             None)
        call("cuda_runtime", "cudaGraphLaunch", w.rt.cudaGraphLaunch, None, None)
        time.sleep(0.001)

    def slow_sync() -> None:
        call("cuda_runtime", "cudaDeviceSynchronize", w.rt.cudaDeviceSynchronize)

    def timed(step: Any, n: int, slow_every: int = 0) -> float:
        t = time.perf_counter()
        for i in range(n):
            step(i)
            if slow_every and i % slow_every == slow_every - 1:
                slow_sync()
        return n / (time.perf_counter() - t)

    ctl.done("ready", {"pid": os.getpid(), "simulated": True, "device": "none (simulated)"})
    for phase in ("p1", "p2", "p3"):
        ctl.wait(f"go-{phase[1]}")
        ctl.done(phase, {"eager_steps_per_s": timed(eager_step, a.steps),
                         "graph_steps_per_s": timed(graph_step, a.steps)})
    ctl.wait("go-4")
    rec = []
    time.sleep(0.2)
    t0 = time.time_ns()
    eager = timed(eager_step, a.profiled_steps, slow_every=25)
    graphs = timed(graph_step, a.profiled_steps, slow_every=25)
    t1 = time.time_ns()
    time.sleep(0.2)
    pid, tid = os.getpid(), threading.get_native_id()
    events: list[dict[str, Any]] = []
    for k, (cat, op, t, d) in enumerate(rec, 1):
        events.append({"ph": "X", "cat": cat, "name": op, "pid": pid, "tid": tid,
                       "ts": t / 1000, "dur": max(d / 1000, 0.001), "args": {"correlation": k}})
        if op in ("cudaLaunchKernel", "cuLaunchKernel"):
            events.append({"ph": "X", "cat": "kernel", "name": "abs", "pid": 0, "tid": 7,
                           "ts": t / 1000 + 5, "dur": 3.0,
                           "args": {"correlation": k, "device": 0, "stream": 7}})
    trace = Path(a.ctl) / "profiler-trace.json"
    trace.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    ctl.done("p4", {"t0_ns": t0, "t1_ns": t1, "trace": str(trace), "steps": a.profiled_steps,
                    "eager_steps_per_s": eager, "graph_steps_per_s": graphs})
    return 0


def _ns(text: str) -> int:
    units = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}
    for unit in ("ns", "us", "ms", "s"):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * units[unit])
    return int(float(text) * 1_000_000_000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("check", help="the whole check (the default)")
    for q in (p, c):
        q.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
        q.add_argument("--mode", choices=("auto", "gpu", "dry"), default="auto")
        q.add_argument("--workload-libs", default=os.environ.get("FLEETD_CHECK_WORKLOAD_LIBS"),
                       help="dry run: a directory with libcudart.so.12, libnccl.so.2 and "
                       "optionally libcuda.so.1 for the reference workloads")
        q.add_argument("--steps", type=int, default=300, help="GPU: steps per timed phase")
        q.add_argument("--profiled-steps", type=int, default=100)
        q.add_argument("--nccl-steps", type=int, default=200)
        q.add_argument("--dry-steps", type=int, default=150)
        q.add_argument("--dry-nccl-steps", type=int, default=30)
        q.add_argument("--budget-s", type=float, default=420.0)
        q.add_argument("--stack-slow", default="1ms",
                       help="GPU: calls at least this slow get stacks (the frames item)")
        q.add_argument("--unpack-s", type=float, default=None)
        q.add_argument("--archive", default=None, help="the archive unpacked (its size)")
    for name, fn in (("torch-job", torch_job), ("nccl-job", nccl_job),
                     ("sim-torch-job", sim_torch_job)):
        j = sub.add_parser(name)
        j.add_argument("--ctl", required=True)
        j.add_argument("--steps", type=int, default=300)
        j.add_argument("--profiled-steps", type=int, default=100)
        j.set_defaults(job=fn)
    a = p.parse_args(argv)
    if getattr(a, "job", None):
        return int(a.job(a))
    return Check(a).run()


if __name__ == "__main__":
    raise SystemExit(main())
