"""What tracing needs of the machine before anything is compiled: root and tracefs
(mounted here when it is missing), each refused with the fix; and whether the on-CPU
sampler's perf events can be had (``fleetd check``)."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct
from pathlib import Path

from fleetd.checks import OK, WARN, Check
from fleetd.errors import TraceError

log = logging.getLogger("fleetd.trace.host.preflight")


def preflight() -> None:
    """Root, tracefs (mounted if missing), and the BPF syscall: fail with a fix."""
    if os.geteuid() != 0:
        raise TraceError(
            "fleetd trace needs root (BPF programs and uprobes are privileged)",
            "run it with sudo, or as root in a privileged container",
        )
    ensure_tracefs()
    if not Path("/sys/kernel/btf/vmlinux").exists() and not Path("/proc/config.gz").exists():
        log.info("no BTF and no /proc/config.gz; relying on installed kernel headers")


def ensure_tracefs() -> str:
    """Mount tracefs at /sys/kernel/tracing if missing; the path, or TraceError."""
    path = Path("/sys/kernel/tracing")
    if (path / "events").is_dir():
        return str(path)
    legacy = Path("/sys/kernel/debug/tracing")
    if (legacy / "events").is_dir():
        return str(legacy)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(b"tracefs", str(path).encode(), b"tracefs", 0, None)
    if rc != 0 or not (path / "events").is_dir():
        err = os.strerror(ctypes.get_errno())
        raise TraceError(
            f"tracefs is not mounted at {path} and mounting it failed ({err})",
            "mount -t tracefs tracefs /sys/kernel/tracing (in a container: run privileged "
            "or bind-mount the host's /sys/kernel/tracing)",
        )
    log.info("mounted tracefs at %s", path)
    return str(path)


# perf_event_open(2): the syscall number, and the attribute fields the check sets.
_SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
_PERF_TYPE_SOFTWARE, _PERF_COUNT_SW_CPU_CLOCK = 1, 0
_PERF_ATTR_SIZE = 128  # PERF_ATTR_SIZE_VER7; the kernel accepts any known size
_PERF_FLAG_DISABLED, _PERF_FLAG_FREQ = 1, 1 << 10


def cpu_clock_check(hz: int = 49) -> Check:
    """Whether the on-CPU sampler's perf event (a software CPU clock on every CPU, at
    ``hz`` samples a second) can be opened here: one, disabled, on CPU 0, then closed."""
    nr = _SYS_PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        return Check("cpu-samples", WARN,
                     f"unknown perf_event_open syscall number on {platform.machine()}")
    attr = (ctypes.c_uint8 * _PERF_ATTR_SIZE)()
    struct.pack_into("<IIQQQQQ", attr, 0, _PERF_TYPE_SOFTWARE, _PERF_ATTR_SIZE,
                     _PERF_COUNT_SW_CPU_CLOCK, hz, 0, 0,
                     _PERF_FLAG_DISABLED | _PERF_FLAG_FREQ)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, ctypes.byref(attr), -1, 0, -1, 0)
    if fd >= 0:
        os.close(fd)
        return Check("cpu-samples", OK,
                     f"CPU-clock perf events open ({hz} Hz default, --cpu-sample-hz)")
    err = os.strerror(ctypes.get_errno())
    return Check("cpu-samples", WARN, f"perf_event_open of a CPU clock failed: {err}; "
                 "traces go on without on-CPU samples (fleetd profile, gc_pause, "
                 "host_cpu_bound)",
                 "run as root or with CAP_PERFMON, lower kernel.perf_event_paranoid, or in "
                 "a container allow perf_event_open (seccomp, --privileged)")
