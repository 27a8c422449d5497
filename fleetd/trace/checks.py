"""Host and CUDA checks for ``fleetd check``: can this machine trace, and how?

Each check says ok / warn / fail / skip, what it found, and for anything short of ok,
the fix (:class:`fleetd.checks.Check`). The probe check is real: it compiles the
programs and attaches every probe to every CUDA library found, then detaches, so "can
attach" means it did attach.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
from collections.abc import Callable, Collection
from pathlib import Path

from fleetd.checks import FAIL, OK, SKIP, WARN, Check
from fleetd.trace.bpf.probes import SPECS_BY_KIND, library_symbols, planned_symbols
from fleetd.trace.host import clock
from fleetd.trace.host.headers import ROUTES, HeaderRoute, prepare_route
from fleetd.trace.host.libs import (
    Library,
    all_mapped_libraries,
    kind_of,
    search_usual_places,
)
from fleetd.trace.host.podcheck import containers_check, memory_stalls_check
from fleetd.trace.host.preflight import cpu_clock_check

log = logging.getLogger("fleetd.trace.checks")

__all__ = ["FAIL", "OK", "SKIP", "WARN", "Check", "run_checks"]

TRACEPOINTS = (
    "sched/sched_switch", "sched/sched_waking", "sched/sched_process_fork",
    "sched/sched_process_exec", "sched/sched_process_exit", "kmem/mm_page_alloc",
    "block/block_rq_issue", "block/block_rq_complete", "irq/irq_handler_entry",
    "irq/softirq_entry", "raw_syscalls/sys_enter", "syscalls/sys_enter_clone3",
)
_BPF_MAP_CREATE = 0
_SYS_BPF = {"x86_64": 321, "aarch64": 280}
# Capability bits (linux/capability.h). CAP_BPF and CAP_PERFMON split off
# CAP_SYS_ADMIN in 5.8; an older kernel needs CAP_SYS_ADMIN itself.
CAPS = {"CAP_SYS_ADMIN": 21, "CAP_PERFMON": 38, "CAP_BPF": 39}
# Attaching needs these to have passed: without them compiling is bound to fail.
_NEEDED_TO_ATTACH = ("root", "capabilities", "bpf", "tracefs", "bcc", "headers")


def run_checks(cuda_libs: list[str] | None = None, *, attach: bool = True,
               groups: Collection[str] = ("host", "cuda"), skips: bool = False
               ) -> list[Check]:
    """The ``host`` checks (kernel, privileges, BPF, tracefs, bcc, headers, clock) and
    the ``cuda`` ones (libraries, symbols, programs and probes); ``groups`` picks which
    are reported. The host checks always run: attaching depends on them. ``skips``:
    say so (status skip) when the programs were not compiled, instead of leaving the
    row out."""
    host, route = _host_checks()
    out = host if "host" in groups else []
    if "cuda" in groups:
        out += _cuda_checks(cuda_libs or [], attach, host, route, skips)
    return out


def _needs_root(name: str, exc: OSError) -> Check:
    """A check this user may not make (tracefs, a root-only file): a finding that says
    so, never a traceback, so `fleetd check` works as any user (#44.1)."""
    where = exc.filename or "a file it reads"
    return Check(name, FAIL, f"not permitted to read {where} as this user ({exc.strerror})",
                 "run it as root (sudo fleetd check): tracing needs root")


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    try:
        return check()
    except PermissionError as exc:
        return _needs_root(name, exc)


def _guarded_list(name: str, checks: Callable[[], list[Check]]) -> list[Check]:
    try:
        return checks()
    except PermissionError as exc:
        return [_needs_root(name, exc)]


def _host_checks() -> tuple[list[Check], HeaderRoute | None]:
    checks = [
        Check("kernel", OK, f"{platform.release()} ({platform.machine()})"),
        _guarded("root", _root),
        _guarded("capabilities", _capabilities),
        _guarded("bpf", _bpf_syscall),
        _guarded("btf", _btf),
        _guarded("tracefs", _tracefs),
        _guarded("kprobes", _kprobes),
        _guarded("bcc", _bcc),
    ]
    try:
        route_check, route = _headers()
    except PermissionError as exc:
        route_check, route = _needs_root("headers", exc), None
    checks.append(route_check)
    checks += _guarded_list("tracepoints", _tracepoints)
    # #35: pods and memory stalls; #34: the on-CPU sampler's perf events
    checks += [_guarded("memory-stalls", memory_stalls_check),
               _guarded("containers", containers_check),
               _guarded("cpu-samples", cpu_clock_check), _guarded("clock", _clock)]
    return checks, route


def _cuda_checks(overrides: list[str], attach: bool, host: list[Check],
                 route: HeaderRoute | None, skips: bool) -> list[Check]:
    try:
        libs = _libraries(overrides)
        found = _libs_check(libs)
    except PermissionError as exc:  # the processes' maps of other users
        libs, found = [], _needs_root("cuda-libraries", exc)
    checks = [found, *(_symbols_check(lib) for lib in libs),
              _guarded("mapping hook", _mapping_check), _guarded("python stacks", _python_check)]
    failed = [c.name for c in host if c.name in _NEEDED_TO_ATTACH and c.status == FAIL]
    if attach and not failed and route is not None:
        checks += _attach_check(libs)
    elif skips and not attach:
        checks.append(Check("programs", SKIP, "not compiled, probes not attached (--no-attach)",
                            "run without --no-attach to compile and attach for real"))
    elif skips:
        checks.append(Check("programs", SKIP, "not compiled, probes not attached: "
                            f"{', '.join(failed or ['headers'])} failed",
                            "fix the failed host checks first (fleetd check --only host)"))
    for c in checks:
        c.group = "cuda"
    return checks


# The mapping hook's tracepoints (bpf/proc.bpf.c): a library mapped after a session
# started is probed before its first call only where they exist.
MAPPING_TRACEPOINTS = ("syscalls/sys_enter_openat", "syscalls/sys_exit_openat",
                       "syscalls/sys_enter_close", "syscalls/sys_enter_mmap",
                       "syscalls/sys_exit_mmap", "sched/sched_process_exec")


def _mapping_check() -> Check:
    base = next((Path(p) for p in ("/sys/kernel/tracing/events",
                                   "/sys/kernel/debug/tracing/events") if Path(p).is_dir()),
                None)
    missing = [tp for tp in MAPPING_TRACEPOINTS
               if base is None or not (base / tp / "format").exists()]
    if missing:
        return Check("mapping hook", WARN, f"tracepoints missing: {', '.join(missing)}",
                     "libraries mapped after a session starts are found by the maps scan "
                     "(up to 2 s late): their first calls can be missed; sessions count "
                     "them in targets.mapping.late")
    if os.environ.get("FLEETD_NO_HOLD"):
        return Check("mapping hook", WARN, "FLEETD_NO_HOLD is set: a process that maps an "
                     "unknown CUDA library is not held until its probes are attached",
                     "unset FLEETD_NO_HOLD; the window of each late library is still "
                     "measured (targets.mapping.late_windows)")
    return Check("mapping hook", OK, "a library mapped after a session starts is probed "
                 "before its first call (the mapping process is held until then)")


def _python_check() -> Check:
    """Which installed CPythons `fleetd trace --stacks` reads Python frames of, and of
    each running Python process: its version and whether its frames are read (and why
    not). Interpreters older than the oldest supported version are listed, not warned
    about: no layout is planned for them. A running process that cannot be read warns."""
    from fleetd.trace.enrich import pyframes

    found = {p: pyframes.support_of(p) for p in pyframes.installed_interpreters()}
    running = pyframes.running_interpreters() if os.geteuid() == 0 else {}
    data = {"supported": pyframes.SUPPORTED,
            "interpreters": {p: why or "ok" for p, why in found.items()},
            "processes": {str(pid): pyframes.describe(i) for pid, i in sorted(running.items())}}
    old = {p: why for p, why in found.items() if why and _too_old(p)}
    bad = {p: why for p, why in found.items() if why and p not in old}
    bad.update({f"pid {pid}": i.problem for pid, i in running.items() if i.problem})
    ok = [p for p, why in found.items() if not why]
    procs = ", ".join(f"pid {pid} {pyframes.brief(i)}" for pid, i in sorted(running.items()))
    parts = [f"Python frames readable for {', '.join(ok) or 'none installed'}"]
    if old:
        parts.append(f"native stacks only for {', '.join(old)} (before 3.10)")
    if procs:
        parts.append(f"running: {procs}")
    if not bad:
        return Check("python stacks", OK, "; ".join(parts), data=data)
    return Check("python stacks", WARN,
                 "; ".join([*(f"{p}: {why}" for p, why in bad.items()), *parts[-1:] * bool(procs)]),
                 f"stacks of these interpreters are native only; Python frames are read for "
                 f"CPython {pyframes.SUPPORTED}", data=data)


def _too_old(path: str) -> bool:
    m = re.search(r"python(\d)\.(\d+)", os.path.basename(path))
    return m is not None and (int(m.group(1)), int(m.group(2))) < (3, 10)


def _root() -> Check:
    if os.geteuid() == 0:
        return Check("root", OK, "running as root")
    return Check("root", FAIL, f"running as uid {os.geteuid()}",
                 "run fleetd trace/check with sudo (BPF and uprobes need root)")


def _capabilities() -> Check:
    """CapEff of this process: root in a container can still lack them."""
    eff = _effective_caps()
    if eff is None:
        return Check("capabilities", WARN, "cannot read CapEff from /proc/self/status",
                     "is /proc mounted? fleetd needs CAP_BPF + CAP_PERFMON or CAP_SYS_ADMIN")
    have = [name for name, bit in CAPS.items() if eff >> bit & 1]
    shown = f"CapEff {eff:016x}: {', '.join(have) or 'none of ' + ', '.join(CAPS)}"
    if "CAP_SYS_ADMIN" in have or {"CAP_BPF", "CAP_PERFMON"} <= set(have):
        return Check("capabilities", OK, shown)
    return Check("capabilities", FAIL, shown,
                 "run as root with full capabilities; in a container add --privileged, or "
                 "--cap-add BPF --cap-add PERFMON --cap-add SYS_ADMIN")


def _effective_caps() -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split(":", 1)[1].strip(), 16)
    return None


def _bpf_syscall() -> Check:
    """Create and close a one-entry array map: proves the bpf() syscall works here."""
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        return Check("bpf", WARN, f"unknown bpf syscall number on {platform.machine()}")
    attr = (ctypes.c_uint32 * 32)()
    attr[0], attr[1], attr[2], attr[3] = 2, 4, 8, 1  # ARRAY, key 4, value 8, 1 entry
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, _BPF_MAP_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd >= 0:
        os.close(fd)
        return Check("bpf", OK, "bpf() syscall works (map created)")
    err = os.strerror(ctypes.get_errno())
    return Check("bpf", FAIL, f"bpf() failed: {err}",
                 "run as root on a kernel with CONFIG_BPF_SYSCALL; in a container add "
                 "CAP_BPF/CAP_PERFMON (or --privileged)")


def _btf() -> Check:
    if Path("/sys/kernel/btf/vmlinux").exists():
        return Check("btf", OK, "/sys/kernel/btf/vmlinux present (not required by BCC)")
    return Check("btf", WARN, "no /sys/kernel/btf/vmlinux",
                 "not needed for fleetd's BCC programs; needed only by the libbpf fallback")


def _tracefs() -> Check:
    for p in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if Path(p, "events").is_dir():
            return Check("tracefs", OK, f"mounted at {p}")
    status = FAIL if os.geteuid() != 0 else WARN
    return Check("tracefs", status, "tracefs not mounted",
                 "mount -t tracefs tracefs /sys/kernel/tracing (fleetd trace mounts it "
                 "itself when run as root)")


def _kprobes() -> Check:
    if Path("/sys/kernel/tracing/kprobe_events").exists():
        return Check("kprobes", OK, "available (fleetd does not need them)")
    return Check("kprobes", OK, "not available; fleetd uses only tracepoints and uprobes")


def _bcc() -> Check:
    try:
        import bcc
    except ImportError as exc:
        return Check("bcc", FAIL, f"python module not importable: {exc}",
                     "apt-get install python3-bpfcc libbpfcc, then re-run scripts/setup.sh "
                     "(not `pip install bcc`: an unrelated package)")
    except OSError as exc:  # the module is there, its libbcc (or what it links) is not
        return Check("bcc", FAIL, f"libbcc could not be loaded: {exc}",
                     "install libbcc from the OS (apt-get install libbpfcc), or use a bundle "
                     "built for this machine's glibc (docs/deploy.md)")
    version = getattr(bcc, "__version__", None) or _bcc_version_from_dpkg()
    return Check("bcc", OK, f"bcc {version or '(version unknown)'} at {Path(bcc.__file__).parent}")


def _bcc_version_from_dpkg() -> str | None:
    status = Path("/var/lib/dpkg/status")
    try:
        text = status.read_text(errors="replace")
    except OSError:
        return None
    for block in text.split("\n\n"):
        if block.startswith("Package: python3-bpfcc\n") or "\nPackage: python3-bpfcc\n" in block:
            for line in block.splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


def _headers() -> tuple[Check, HeaderRoute | None]:
    """The first route that prepares and compiles a tiny program."""
    tried = []
    forced = os.environ.get("FLEETD_HEADERS")
    if forced and forced not in ROUTES:
        return Check("headers", FAIL, f"FLEETD_HEADERS={forced!r} names no header route",
                     f"unset FLEETD_HEADERS, or set it to one of: {', '.join(ROUTES)}"), None
    for name in (forced,) if forced else ROUTES:
        route = prepare_route(name)
        if route is None:
            tried.append(f"{name}: not available")
            continue
        err = _compile_probe(route)
        if err is None:
            return Check("headers", OK, f"route {route.describe()}"
                         + (f" (tried: {'; '.join(tried)})" if tried else "")), route
        tried.append(f"{name}: {err}")
    return Check("headers", FAIL, "; ".join(tried) or "no route",
                 "apt-get install linux-headers-$(uname -r) (or Debian's linux-headers-amd64 "
                 "as a fallback), or set BCC_KERNEL_SOURCE to a kernel header tree"), None


def _compile_probe(route: HeaderRoute) -> str | None:
    try:
        from bcc import BPF
    except ImportError as exc:
        return f"bcc missing ({exc})"
    from fleetd.trace.host.headers import applied

    with applied(route):
        try:
            b = BPF(text=b"int fl_probe(void *ctx) { return 0; }")
            b.cleanup()
        except Exception as exc:  # bcc raises bare Exception
            return str(exc).splitlines()[0] if str(exc) else "compile failed"
    return None


def _tracepoints() -> list[Check]:
    base = next((Path(p) for p in ("/sys/kernel/tracing/events",
                                   "/sys/kernel/debug/tracing/events") if Path(p).is_dir()),
                None)
    if base is None:
        return [Check("tracepoints", FAIL, "tracefs not mounted, cannot list tracepoints",
                      "mount tracefs (see above)")]
    missing = [tp for tp in TRACEPOINTS if not (base / tp / "format").exists()]
    if not missing:
        return [Check("tracepoints", OK, f"all {len(TRACEPOINTS)} host tracepoints present")]
    return [Check("tracepoints", WARN, f"missing: {', '.join(missing)}",
                  "those host event groups will not be traced (kernel built without them)")]


def _libraries(overrides: list[str]) -> list[Library]:
    from fleetd.trace.host.libs import override_libraries

    if overrides:
        return override_libraries(overrides)
    found: dict[tuple[int, int, str], Library] = {}
    for lib in [*all_mapped_libraries(), *search_usual_places()]:
        found.setdefault(lib.key, lib)
    return list(found.values())


def _libs_check(libs: list[Library]) -> Check:
    kinds = sorted({lib.kind for lib in libs})
    if not libs:
        return Check("cuda-libraries", WARN, "no libcudart/libcuda/libnccl found",
                     "fleetd trace --pid PID finds what the process maps; or pass "
                     "--cuda-lib PATH; or pip install nvidia-cuda-runtime-cu12 "
                     "nvidia-nccl-cu12 for tests")
    status = OK if "cudart" in kinds else WARN
    fix = "" if status == OK else "no CUDA runtime found: runtime probes will not attach"
    return Check("cuda-libraries", status,
                 f"{len(libs)} found ({', '.join(kinds)}): "
                 + ", ".join(f"{lib.path} [{lib.found_by}{_kind_note(lib)}]" for lib in libs), fix)


def _kind_note(lib: Library) -> str:
    return "" if kind_of(lib.path) == lib.kind else f", {lib.kind} inside"


def _label(lib: Library) -> str:
    """A library's file name, and the kind when its name does not say it (the runtime
    that libnccl links in, an executable built with the static runtime)."""
    name = Path(lib.path).name
    return name if kind_of(name) == lib.kind else f"{name} [{lib.kind}]"


def _vanished(lib: Library, what: str) -> Check | None:
    """A SKIP for a library seen through a process that has exited since it was found.

    CUDA processes come and go on a real node; one that ends during the check took its
    /proc/PID/root view with it, which says nothing about whether probes attach.
    """
    m = re.match(r"/proc/(\d+)/", lib.path)
    if m is None or os.path.exists(lib.path):
        return None
    return Check(f"{what} {_label(lib)}", SKIP,
                 f"process {m.group(1)} exited during the check; its mapping of "
                 f"{Path(lib.path).name} is gone", "")


def _symbols_check(lib: Library) -> Check:
    try:
        exports = library_symbols(lib)
    except (OSError, ValueError) as exc:
        if (gone := _vanished(lib, "symbols")) is not None:
            return gone
        return Check(f"symbols {_label(lib)}", FAIL, f"cannot read: {exc}",
                     "is the file a complete shared library?")
    specs = SPECS_BY_KIND[lib.kind]
    absent = [s.op for s in specs if not planned_symbols(s, exports.offsets)]
    detail = f"{len(specs) - len(absent)}/{len(specs)} ops exported by {lib.path}"
    if absent:
        return Check(f"symbols {_label(lib)}", WARN,
                     detail + f"; absent: {', '.join(absent)}",
                     "an older library version: those ops cannot be traced")
    return Check(f"symbols {_label(lib)}", OK, detail)


def _attach_check(libs: list[Library]) -> list[Check]:
    """Compile the real programs and attach every probe; report per library."""
    from fleetd.errors import TraceError
    from fleetd.trace.bpf.bpfsrc import ProgramOptions, compile_program, detach_all
    from fleetd.trace.bpf.probes import Attacher

    try:
        bpf, route = compile_program(ProgramOptions(tracer_pid=os.getpid()))
    except TraceError as exc:
        return [Check("programs", FAIL, exc.message, exc.hint or "")]
    out = [Check("programs", OK, f"all layers compiled, loaded; tracepoints attached "
                 f"(headers: {route.name})")]
    attacher = Attacher(bpf)
    try:
        for lib in libs:
            rep = attacher.attach(lib, ("cuda", "driver", "nccl"))
            ok = len(rep.attached.get(lib.path, []))
            failed = rep.failed.get(lib.path, [])
            name = f"probes {_label(lib)}"
            if failed and not ok and (gone := _vanished(lib, "probes")) is not None:
                out.append(gone)
            elif failed:
                out.append(Check(name, WARN if ok else FAIL,
                                 f"{ok} attached, {len(failed)} failed: {'; '.join(failed[:3])}",
                                 "check that tracefs is mounted and the file is not on a "
                                 "filesystem that forbids uprobes (e.g. overlay upper layer)"))
            else:
                via = rep.mechanism.get(lib.path, "-")
                out.append(Check(name, OK, f"{ok} entry points attached, with returns "
                                 f"(via {via})"))
    finally:
        attacher.close()
        detach_all(bpf)
    return out


def _clock() -> Check:
    s = clock.sample()
    if s.synced is None:
        return Check("clock", WARN, f"offset sampled (window {s.window_ns} ns); adjtimex "
                     "unavailable, clock error unknown")
    detail = (f"offset window {s.window_ns} ns, kernel max error "
              f"{(s.error_ns - s.window_ns // 2) / 1e6:.3f} ms")
    if not s.synced:
        return Check("clock", WARN, detail + "; system clock NOT synchronized",
                     "run an NTP/PTP client (chrony, systemd-timesyncd) so cross-node "
                     "timelines line up")
    return Check("clock", OK, detail + "; synchronized")
