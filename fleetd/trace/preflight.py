"""What tracing needs of the machine before anything is compiled: root and tracefs
(mounted here when it is missing), each refused with the fix."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from fleetd.errors import TraceError

log = logging.getLogger("fleetd.trace.preflight")


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
