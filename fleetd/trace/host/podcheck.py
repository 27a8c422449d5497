"""``fleetd check``'s ``containers`` and ``memory-stalls`` rows: whether traced processes
will be named with their pods, and whether reclaim stalls can be measured here.

A DaemonSet agent that cannot join the host's cgroup namespace, or that lacks the
container runtime's records, still traces; its processes are named less (a pod uid
instead of a name, nothing at all from a relative path). These rows say which, and what
to mount, before anyone wonders why explain shows no pod names.
"""

from __future__ import annotations

import os
from pathlib import Path

from fleetd.checks import OK, WARN, Check
from fleetd.security.procfs import CGROUP_MAX, read_proc_text
from fleetd.trace.host.cgroups import HOST_PID, RUNTIME_FILES
from fleetd.trace.host.memory import TRACEPOINTS, tracepoints

_KUBEPODS = "kubepods"


def _cgroup_namespace() -> tuple[bool, bool]:
    """(this process sees cgroups as the host names them, it could join the host's
    cgroup namespace). Where the namespace link of pid 1 cannot be opened (some
    sandboxes), its cgroup file tells: in a namespace of our own it reads ``/..``."""
    try:
        own = os.stat("/proc/self/ns/cgroup").st_ino
        host = os.stat(f"/proc/{HOST_PID}/ns/cgroup").st_ino
        return own == host, os.geteuid() == 0
    except OSError:
        pass
    text = read_proc_text(HOST_PID, "cgroup", CGROUP_MAX)
    if text is None:
        return False, False
    return "/.." not in text, False


def _pods_here() -> int:
    """How many visible processes run in a Kubernetes pod (kubepods in the path)."""
    return sum(_KUBEPODS in (read_proc_text(int(e.name), "cgroup", CGROUP_MAX) or "")
               for e in os.scandir("/proc") if e.name.isdigit())


def runtime_dirs(host: Path = Path("/")) -> dict[str, str]:
    """Runtime -> the directory of its container records, where one exists here."""
    out: dict[str, str] = {}
    for runtime, templates in RUNTIME_FILES.items():
        if runtime == "kubernetes":
            continue
        for t in templates:
            d = host / t.split("{id}", 1)[0].lstrip("/")
            if d.is_dir():
                out.setdefault(runtime, str(d))
    return out


def containers_check() -> Check:
    in_host, can_join = _cgroup_namespace()
    pods = _pods_here()
    dirs = runtime_dirs()
    data = {"host_cgroup_namespace": in_host, "pod_processes": pods, "runtime_records": dirs}
    where = ", ".join(f"{r} at {d}" for r, d in dirs.items()) or "none"
    if not in_host and not can_join:
        return Check("containers", WARN, "in a cgroup namespace of its own and cannot join "
                     "the host's: other processes' cgroups read relative to it",
                     "run the agent privileged with hostPID (configs/daemonset.yaml)",
                     data=data)
    if pods and not dirs:
        return Check("containers", WARN, f"{pods} process(es) in Kubernetes pods, no "
                     "container runtime records: pods are named from HOSTNAME only and may "
                     "lack their namespace", "mount the runtime's records read-only "
                     "(/run/containerd, or CRI-O's /run/containers/storage, or Docker's "
                     "/var/lib/docker/containers; docs/deploy.md)", data=data)
    view = "host cgroup namespace" if in_host else "joins the host's cgroup namespace"
    return Check("containers", OK, f"{view}; {pods} process(es) in Kubernetes pods; "
                 f"runtime records: {where}", data=data)


def memory_stalls_check() -> Check:
    """Which reclaim and compaction tracepoints this kernel has (the memory_reclaim
    cause measures the stalls they bracket; a missing pair is left out of the program)."""
    found = tracepoints()
    missing = [TRACEPOINTS[f][0] for f, ok in found.items() if not ok]
    if not missing:
        return Check("memory-stalls", OK, "reclaim, compaction and kernel-work tracepoints "
                     "present", data=found)
    return Check("memory-stalls", WARN, f"missing: {', '.join(missing)}",
                 "those stalls will not be measured (kernel built without them); "
                 "memory_reclaim still reads the cgroups' limits and pressure", data=found)
