"""Building and compiling the BPF program: sources, parameters, header route.

All layers compile into one BCC module, so the target set, histograms and counters
are shared maps. Sources are package data (``fleetd.bpf``); their ``#include "x"``
lines are inlined here so that the package works from a wheel or a zip as well.
Parameters travel as ``-D`` flags; op codes come from the catalog, so C and Python
cannot drift, and the record sizes are asserted at compile time.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import platform
import re
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fleetd.errors import TraceError
from fleetd.store.catalog import c_defines
from fleetd.trace.bpf.probes import RING_NUMBER, SPECS
from fleetd.trace.host.headers import HeaderRoute, applied, candidate_routes
from fleetd.trace.host.memory import tracepoints as memory_tracepoints

log = logging.getLogger("fleetd.trace.bpf.bpfsrc")

# struct fl_rec (bpf/fleetd.h), little-endian, no padding.
REC = struct.Struct("<QQIIIiQIIqqiI4QQQ16s")
# A stacked record goes on with struct fl_pystack: frame count, status, then per frame
# (code object, instruction pointer).
PY_FRAMES = 32  # FL_PY_FRAMES: a power of two (the BPF side masks the index with it)
PYSTACK_HEAD = struct.Struct("<II")
PYFRAME = struct.Struct("<QQ")
# struct fl_cpu_sample (bpf/oncpu.bpf.c): ts, pid, tid, stack, flags, cpu, pad, then a
# struct fl_pystack.
CPU_SAMPLE = struct.Struct("<QIIiIIIQ")  # ts pid tid stack flags cpu pad kip
CPU_SAMPLE_SIZE = CPU_SAMPLE.size + PYSTACK_HEAD.size + PY_FRAMES * PYFRAME.size
# Why a record reached user space (fl_rec.flags): FL_WHY_<NAME> in C, defined from here.
WHY_SAMPLE = 1  # the 1-in-N sample of ordinary calls
WHY_SLOW = 2  # latency above k x the running median
WHY_ERROR = 4  # a call that returned an error (rate-limited per pid+op)
WHY_ALWAYS = 8  # sync, graph, allocation, NCCL and lifecycle events
WHY: dict[str, int] = {"SAMPLE": WHY_SAMPLE, "SLOW": WHY_SLOW, "ERROR": WHY_ERROR,
                       "ALWAYS": WHY_ALWAYS}
NBUCKETS = 40
HIST_SIZE = 6 * 8 + 2 * 8 * NBUCKETS

COUNTERS = (
    "lost_cuda", "lost_driver", "lost_nccl", "lost_sched", "lost_sys", "calls_full",
    "hist_full", "sampled_out", "stack_lost", "emitted", "sample_tick", "state_full",
    "wake_tick", "stack_tick", "py_stack_lost", "wake_stacks", "wake_stacks_skipped",
    "lost_cpu",
)
LAYERS = ("cuda", "driver", "nccl", "host")
HOST_PARTS = ("sched", "mem", "block", "irq", "syscall")
# Which ring buffer each layer writes (proc/block/irq/syscall share fl_rb_sys).
RINGS: dict[str, str] = {
    "cuda": "fl_rb_cuda", "driver": "fl_rb_driver", "nccl": "fl_rb_nccl",
    "sched": "fl_rb_sched", "sys": "fl_rb_sys",
}
_FILES = {"cuda": "cuda.bpf.c", "driver": "driver.bpf.c", "nccl": "nccl.bpf.c",
          "host": "host.bpf.c"}


@dataclass
class ProgramOptions:
    tracer_pid: int
    layers: frozenset[str] = frozenset(LAYERS)
    host_parts: frozenset[str] = frozenset(HOST_PARTS)
    system_wide: bool = False
    cgroups: bool = False
    sample_n: int = 1
    slow_k: int = 8
    slow_min_ns: int = 20_000
    err_burst: int = 10
    stacks: bool = False
    stack_sample: int = 100  # 1 in N kept calls carries a stack (0: only slow ones)
    stack_slow_ns: int = 1_000_000  # ... and every call at least this long
    # With stacks: a wakeup by a followed Python thread carries the waker's stack, at most
    # once per (waker, woken) thread pair per this many ns (None: never).
    wake_stack_ns: int | None = 20_000_000
    ring_pages: int = 256  # per ring buffer; a power of two
    thresholds_ns: dict[str, int] = field(default_factory=lambda: {
        "offcpu": 50_000, "runq": 50_000, "irq": 20_000, "syscall": 1_000_000,
        "block": 10_000_000,
    })
    cpu_sample_hz: int = 0  # on-CPU samples per second per CPU (oncpu.bpf.c); 0: off
    cpu_ring_pages: int = 64

    def rings(self) -> list[str]:
        """Ring buffers that carry records with these options."""
        out: list[str] = [r for r in ("cuda", "driver", "nccl") if r in self.layers]
        if "host" in self.layers and "sched" in self.host_parts:
            out.append("sched")
        out.append("sys")  # proc is always on
        return out


def source_text(layers: Iterable[str], oncpu: bool = False, per_symbol: bool = True) -> str:
    """The program: the chosen layers, then proc (which needs host's thread cleanup),
    the on-CPU sampler if asked, then the attachable uprobe programs generated from the
    probe specs (the per-op ones only with ``per_symbol``: see per_symbol_first)."""
    wanted = set(layers)
    chosen = [_FILES[name] for name in LAYERS if name in wanted]
    files = [*chosen, "proc.bpf.c", *(["oncpu.bpf.c"] if oncpu else [])]
    text = _inline("\n".join(f'#include "{f}"' for f in files) + "\n")
    return text + probe_wrappers(wanted, per_symbol)


def probe_wrappers(layers: set[str], per_symbol: bool = True) -> str:
    """Per-op entry/return programs (with ``per_symbol``), and the two uprobe_multi
    dispatchers.

    Generated from probes.SPECS, so the set of ops, whether each is always emitted
    and which ring it writes are defined once, in Python.
    """
    specs = [s for s in SPECS if s.layer in layers]
    out = ["/* ---- generated by fleetd/trace/bpf/bpfsrc.py from probes.SPECS ---- */"]
    for spec in specs if per_symbol else ():
        name = spec.op.upper()
        out.append(f"int {spec.entry_fn}(struct pt_regs *ctx) {{ return fl_enter_{name}(ctx); }}")
        out.append(
            f"int {spec.return_fn}(struct pt_regs *ctx) {{ return fl_call_exit(ctx, OP_{name}, "
            f"{int(spec.always)}, {RING_NUMBER[spec.layer]}, 0); }}")
    if not specs:
        return "\n".join(out) + "\n"
    out.append("static u64 (*fl_get_attach_cookie)(void *ctx) =\n"
               "    (void *)BPF_FUNC_get_attach_cookie;")
    out.append("int fl_in_multi(struct pt_regs *ctx)\n{\n    u64 c = fl_get_attach_cookie(ctx);")
    out.append("    switch ((u32)c) {")
    for spec in specs:
        name = spec.op.upper()
        out.append(f"    case OP_{name}: return fl_enter_{name}(ctx);")
    out.append("    }\n    return 0;\n}")
    out.append("int fl_out_multi(struct pt_regs *ctx)\n{\n    u64 c = fl_get_attach_cookie(ctx);")
    out.append("    return fl_call_exit(ctx, (u32)c, (c >> 32) & 1, (c >> 40) & 0xff, 0);\n}")
    out += _session_program([s for s in specs if s.entry_only])
    return "\n".join(out) + "\n"


def _session_program(specs: list[Any]) -> list[str]:
    """fl_sess_multi: the one program of a uprobe session link (entry-only launches,
    common.bpf.c's fl_launch_entry). It runs at the entry and, when that returned 0, at
    the return; at the return the registers hold the caller's address, not the
    function's (bpf_get_func_ip gives the function's at both ends)."""
    if not specs:
        return []
    out = ["static u64 (*fl_get_func_ip)(void *ctx) = (void *)BPF_FUNC_get_func_ip;",
           "int fl_sess_multi(struct pt_regs *ctx)\n{\n    u64 c = fl_get_attach_cookie(ctx);",
           "    if (PT_REGS_IP(ctx) != fl_get_func_ip(ctx))",
           "        return fl_call_exit(ctx, (u32)c, (c >> 32) & 1, (c >> 40) & 0xff, 1);",
           "    int pick = fl_launch_pick((u32)c);",
           "    if (pick <= 0)",
           "        return 1;",
           "    switch ((u32)c) {"]
    for spec in specs:
        name = spec.op.upper()
        out.append(f"    case OP_{name}: fl_enter_{name}(ctx); break;")
    out.append("    default: return 1;\n    }\n    return fl_launch_entry((u32)c, pick);\n}")
    return out


def _inline(text: str, seen: set[str] | None = None) -> str:
    seen = set() if seen is None else seen
    root = importlib.resources.files("fleetd.bpf")

    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in seen:
            return f"/* {name}: already included */"
        seen.add(name)
        body = root.joinpath(name).read_text()
        return f"/* ---- {name} ---- */\n" + _inline(body, seen)

    return re.sub(r'^#include "([^"]+)"\s*$', repl, text, flags=re.M)


# Slots of the target filter in front of fl_targets (bpf/common.bpf.c); a power of two.
# The tracer writes slot pid % TARGET_SLOTS after the hash entry.
TARGET_SLOTS = 65536


# The uretprobe syscall (x86_64, Linux 6.11+): a uretprobe's trampoline returns through
# it instead of a trap, so every traced call that returns makes one. sys_enter skips it
# first thing, so sys_exit finds no entry for it; elsewhere there is no such syscall
# (-1 never matches).
NR_URETPROBE = 335 if platform.machine() == "x86_64" else -1


def cflags(opts: ProgramOptions) -> list[str]:
    th = opts.thresholds_ns
    flags = [f"-D{define}" for define in c_defines()]
    flags += [f"-DFL_WHY_{name}={bit}u" for name, bit in WHY.items()]
    flags += [
        f"-DFL_REC_SIZE={REC.size}",
        f"-DFL_HIST_SIZE={HIST_SIZE}",
        f"-DFL_TRACER_PID={opts.tracer_pid}",
        f"-DFL_SLOTS={TARGET_SLOTS}",
        f"-DFL_SYSTEM_WIDE={int(opts.system_wide)}",
        f"-DFL_CGROUPS={int(opts.cgroups)}",
        f"-DFL_SAMPLE_N={opts.sample_n}",
        f"-DFL_SLOW_K={opts.slow_k}",
        f"-DFL_SLOW_MIN_NS={opts.slow_min_ns}ull",
        f"-DFL_ERR_BURST={opts.err_burst}",
        f"-DFL_STACKS={int(opts.stacks)}",
        f"-DFL_STACK_SAMPLE_N={opts.stack_sample}",
        f"-DFL_STACK_SLOW_NS={opts.stack_slow_ns}ull",
        f"-DFL_PY_FRAMES={PY_FRAMES}",
        f"-DFL_WAKE_STACKS={int(opts.wake_stack_ns is not None)}",
        f"-DFL_WAKE_STACK_NS={opts.wake_stack_ns or 0}ull",
        f"-DFL_RB_PAGES={opts.ring_pages}",
        f"-DFL_OFFCPU_MIN_NS={th['offcpu']}ull",
        f"-DFL_RUNQ_MIN_NS={th['runq']}ull",
        f"-DFL_IRQ_MIN_NS={th['irq']}ull",
        f"-DFL_SYSCALL_MIN_NS={th['syscall']}ull",
        f"-DFL_BLOCK_MIN_NS={th['block']}ull",
        f"-DFL_NR_URETPROBE={NR_URETPROBE}",
        f"-DFL_ONCPU={int(opts.cpu_sample_hz > 0)}",
        f"-DFL_CPU_RB_PAGES={opts.cpu_ring_pages}",
        f"-DFL_CPU_SAMPLE_SIZE={CPU_SAMPLE_SIZE}",
    ]
    flags += [f"-DFL_{part.upper()}={int(part in opts.host_parts)}" for part in HOST_PARTS]
    # Reclaim and compaction stalls come with the mem part, where the kernel has them.
    mem = "mem" in opts.host_parts
    flags += [f"-D{flag}={int(mem and ok)}" for flag, ok in memory_tracepoints().items()]
    # Headers of another kernel version can warn about things we never use.
    flags += ["-Wno-macro-redefined", "-Wno-unknown-warning-option"]
    return flags


@contextmanager
def low_priority(nice: int, grace_s: float) -> Iterator[None]:
    """The calling thread (only it: Linux keeps a nice value per thread) at ``nice`` for
    its first ``grace_s`` seconds, then back at its own priority. A compile of our
    programs takes seconds of CPU: where a core is idle it runs there at full speed
    whatever its nice value; where every core is busy it first yields to the job, and
    is not starved for longer than the grace period."""
    tid = threading.get_native_id()
    try:
        old = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(old, nice))
    except OSError as exc:
        log.debug("compile priority unchanged: %s", exc)
        yield
        return

    def restore() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, old)
        except OSError as exc:  # raising it again needs CAP_SYS_NICE
            log.debug("thread %d left at nice %d: %s", tid, nice, exc)

    timer = threading.Timer(grace_s, restore)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        restore()


def _looks_like_header_problem(text: str) -> bool:
    return any(s in text for s in (
        "kernel headers", "file not found", "Failed to compile BPF module",
        "unknown type name", "kconfig.h",
    ))


# uprobe_multi links (Linux 6.6+) carry all of a library's probes, the op in each one's
# cookie, to the two dispatchers. The per-op programs (fl_in_<OP>, fl_out_<OP>) serve
# only the per-symbol ladder of probes.py: older kernels, or a library whose link
# fails. They are 60% of the module's instructions (the entry and exit paths inlined
# once per op) and so of a cold compile's CPU: where the kernel has uprobe_multi they
# are left out of the start's compile, and compiled (and cached) when first loaded.
MULTI_SINCE = (6, 6)


def per_symbol_first(release: str | None = None) -> bool:
    """Whether the start's compile includes the per-op programs: on a kernel release
    older than MULTI_SINCE (or one that does not parse as a version)."""
    nums = re.findall(r"\d+", release or platform.release())[:2]
    return len(nums) < 2 or (int(nums[0]), int(nums[1])) < MULTI_SINCE


def compile_program(opts: ProgramOptions, say: Callable[[str], None] | None = None
                    ) -> tuple[Any, HeaderRoute]:
    """Load fleetd's programs (from the cache, or compiled); TraceError if no header
    route works. The tracer's pid changes on every start: it is a load-time parameter,
    so one cache entry serves them all. ``say`` hears which of the two it is."""
    oncpu = opts.cpu_sample_hz > 0
    complete = source_text(opts.layers, oncpu)
    lean = complete if per_symbol_first() else source_text(opts.layers, oncpu, per_symbol=False)
    return compile_source(lean, cflags(opts), params={"FL_TRACER_PID": opts.tracer_pid},
                          say=say, complete=complete if lean != complete else None)


# What a start says it is doing: a compile takes seconds to minutes, a cached load well
# under one, and a user waiting should know which it is.
COMPILING = "compiling the BPF programs (the first start with these programs and kernel)"
CACHED = "loading the BPF programs from the compiled-program cache"
COMPILING_MORE = ("compiling the per-symbol probe programs (a library is probed per symbol: "
                  "no uprobe_multi link); seconds, once per kernel")

# Stand-ins for the load-time parameters while compiling: above any pid (pid_max is at
# most 2^22) and positive as a 32-bit immediate, so the compiler keeps each as it is.
_SENTINEL_BASE = 0x3F1D_5A00
# A cold compile's thread runs at this nice value for its first COMPILE_GRACE_S
# seconds (low_priority): it takes no CPU from a job that wants it, then none is
# starved for longer.
COMPILE_NICE = 19
COMPILE_GRACE_S = 5.0


def compile_source(text: str, flags: list[str] | None = None,
                   params: dict[str, int] | None = None,
                   say: Callable[[str], None] | None = None,
                   complete: str | None = None) -> tuple[Any, HeaderRoute]:
    """Load BPF C: from the compiled-program cache when it holds this source, flags and
    kernel, else compiled (at low priority) with the first header route that works,
    then kept. ``params``: -D values given at load instead of compile time (small
    non-negative ints). ``complete``: the same program with functions ``text`` leaves
    out, loaded from the cache or compiled only when one of them is first asked for
    (where the cache cannot serve, it is what is compiled). TraceError if no route
    compiles it."""
    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        raise TraceError(
            f"the BCC Python module is not importable ({exc})",
            "install Debian's python3-bpfcc and libbpfcc, then re-run scripts/setup.sh "
            "(never `pip install bcc`: that PyPI name is an unrelated package)",
        ) from exc
    flags, params = list(flags or []), params or {}
    tell = say or (lambda _msg: None)
    whole = complete or text
    if os.environ.get("FLEETD_BPF_CACHE", "").lower() in ("0", "off", "no"):
        tell(COMPILING)
        return _compile(whole, _with_values(flags, params), autoload=True)
    from fleetd.trace.bpf.bpfload import load_or_compile

    sentinels = {name: _SENTINEL_BASE + i for i, name in enumerate(sorted(params))}
    values = {sentinels[name]: value for name, value in params.items()}
    compiled = _with_values(flags, sentinels)
    real = _with_values(flags, params)
    more = None if complete is None else _entry_of(complete, compiled, sentinels, tell)
    return load_or_compile(text, compiled, sentinels, values,
                           lambda: _compile(text, compiled, autoload=False),
                           lambda: _compile(whole, real, autoload=True),
                           lambda cached: tell(CACHED if cached else COMPILING), more)


def _entry_of(text: str, flags: list[str], sentinels: dict[str, int],
              tell: Callable[[str], None]) -> Callable[[], Any]:
    """What gives the cache entry of ``text`` (kept, or compiled and kept) when called;
    ``tell`` hears when that is a compile."""
    from fleetd.trace.bpf.bpfload import kept_entry

    def stage(cached: bool) -> None:
        if not cached:
            tell(COMPILING_MORE)

    def entry() -> Any:
        return kept_entry(text, flags, sentinels, lambda: _compile(text, flags, autoload=False),
                          stage)
    return entry


def _with_values(flags: list[str], values: dict[str, int]) -> list[str]:
    """The flags with each -DNAME=... of ``values`` replaced (or added)."""
    out = [f for f in flags if not any(f.startswith(f"-D{n}=") for n in values)]
    return out + [f"-D{name}={value}" for name, value in sorted(values.items())]


def _compile(text: str, flags: list[str], autoload: bool) -> tuple[Any, HeaderRoute]:
    """BCC's compile with the first header route that works. Without ``autoload`` the
    tracepoint programs are compiled but not loaded or attached (the cache loads them)."""
    from bcc import BPF

    class CompileOnly(BPF):  # type: ignore[misc]  # bcc has no type information
        def _trace_autoload(self) -> None:
            if autoload:
                super()._trace_autoload()

    tried: list[str] = []
    for route in candidate_routes():
        with applied(route), low_priority(COMPILE_NICE, COMPILE_GRACE_S):
            try:
                bpf = CompileOnly(text=text.encode(), cflags=flags)
            except Exception as exc:  # bcc raises bare Exception for compile errors
                msg = str(exc)
                tried.append(f"{route.name}: {msg.splitlines()[0] if msg else 'failed'}")
                log.info("header route %s failed: %s", route.describe(), msg)
                if not _looks_like_header_problem(msg):
                    break
                continue
        log.info("BPF program compiled with kernel headers from %s", route.describe())
        return bpf, route
    raise TraceError(
        "could not compile the BPF programs (" + ("; ".join(tried) or "no header route") + ")",
        "install kernel headers (apt-get install linux-headers-$(uname -r), or Debian's "
        "linux-headers-amd64 as a fallback) or set BCC_KERNEL_SOURCE; `fleetd check` "
        "shows which routes were tried",
    )


def detach_all(bpf: Any, workers: int = 32) -> None:
    """Detach every probe, then free the module.

    Each detach waits for an RCU grace period in the kernel (~0.1 s on our VMs), so
    BCC's sequential cleanup() of 60 uprobes and 18 tracepoints takes seconds.
    Detaching from many threads at once lets those waits overlap (the ctypes calls
    release the GIL); cleanup() then only closes what is left.
    """
    from concurrent.futures import ThreadPoolExecutor

    jobs: list[tuple[Any, Any]] = [(bpf.detach_uprobe_event, k) for k in list(bpf.uprobe_fds)]
    jobs += [(bpf.detach_tracepoint, k) for k in list(bpf.tracepoint_fds)]
    jobs += [(bpf.detach_raw_tracepoint, k) for k in list(bpf.raw_tracepoint_fds)]

    def one(job: tuple[Any, Any]) -> None:
        fn, key = job
        try:
            fn(key)
        except Exception as exc:  # leave it to cleanup(), which retries and reports
            log.debug("parallel detach of %r failed: %s", key, exc)

    if jobs:
        with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            list(pool.map(one, jobs))
    bpf.cleanup()
