"""Which container, pod and CPU limit a process runs under, read from the kernel alone.

GPU jobs mostly run in containers, and a Kubernetes CPU limit is a CFS quota: the
kernel lets the cgroup run ``quota`` of every ``period`` and then keeps its threads off
the CPU, runnable, while the CPU may sit idle. Users think in pods, not pids, so each
traced process is named by its cgroup, container and pod, without the Kubernetes API:

* ``/proc/PID/cgroup`` gives the cgroup path per hierarchy (v2's unified ``0::`` line,
  v1 lines per controller, both on machines that mount them side by side).
* The container id and pod uid are in that path, as the container runtimes write it:
  cgroupfs driver ``/kubepods/burstable/pod<uid>/<id>``, systemd driver
  ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/
  cri-containerd-<id>.scope`` (``crio-<id>.scope`` for CRI-O, ``docker-<id>.scope`` for
  Docker), plain Docker ``/docker/<id>``.
* The pod's name is its hostname (``HOSTNAME`` in the process's environment, which the
  kubelet sets to the pod name); its namespace is the service-account file the kubelet
  mounts into the pod (``/proc/PID/root/var/run/secrets/kubernetes.io/serviceaccount/
  namespace``), when the pod has one. What cannot be read is left None and shown so.
  Both are the process's to write: the file is read inside the process's root, as a
  regular file of at most 64 bytes (fleetd.security.procfs), and kept only when it is a
  namespace name (a DNS label of at most 63 characters).
* The CPU limit: v2 ``cpu.max`` (``max 100000`` = none), v1 ``cpu.cfs_quota_us`` and
  ``cpu.cfs_period_us`` (-1 = none); throttling from ``cpu.stat`` (``nr_periods``,
  ``nr_throttled``, ``throttled_usec`` on v2, ``throttled_time`` in ns on v1).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

from fleetd.errors import FleetdError
from fleetd.security.private_dir import read_regular
from fleetd.security.procfs import CGROUP_MAX, read_in_root, read_proc_text
from fleetd.store.schema import PlacementColumn, ProcessPlacement

CGROUP_ROOT = Path("/sys/fs/cgroup")
_ID = r"([0-9a-f]{64})"
# (runtime, pattern) in the order tried; each captures the container id.
_RUNTIMES = (
    ("containerd", re.compile(rf"cri-containerd-{_ID}\.scope")),
    # CRI-O: crio-<id>.scope (systemd driver), crio-<id> (cgroupfs driver).
    ("cri-o", re.compile(rf"crio-(?:conmon-)?{_ID}(?:\.scope)?(?:/|$)")),
    ("docker", re.compile(rf"docker-{_ID}\.scope")),
    ("docker", re.compile(rf"/docker/{_ID}(?:/|$)")),
    ("kubernetes", re.compile(rf"/pod[0-9a-f_-]{{36}}(?:\.slice)?/{_ID}(?:/|$)")),
)
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_]"
                      r"[0-9a-f]{12})")
_QOS = re.compile(r"kubepods[-/.](?:slice/kubepods-)?(besteffort|burstable)")
SA_NAMESPACE = "var/run/secrets/kubernetes.io/serviceaccount/namespace"
NAMESPACE_READ = 64  # bytes: a namespace is a DNS label of at most 63, plus a newline
_NAMESPACE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a process runs: its cgroup and, when the path says so, container and pod."""

    cgroup: str  # the path that carries the CPU controller (v2's, else v1 cpu's)
    runtime: str | None = None  # containerd, cri-o, docker, kubernetes (cgroupfs)
    container_id: str | None = None
    pod_uid: str | None = None
    qos: str | None = None  # besteffort, burstable, guaranteed (Kubernetes QoS class)


@dataclass(frozen=True, slots=True)
class CpuLimit:
    quota_us: int | None  # None: no limit
    period_us: int
    periods: int = 0  # cpu.stat: enforcement periods elapsed
    throttled_periods: int = 0  # periods in which the cgroup ran out of quota
    throttled_ns: int = 0  # time its threads were kept off the CPU for it

    @property
    def cpus(self) -> float | None:
        """The limit in CPUs (Kubernetes' 250m is 0.25)."""
        return None if self.quota_us is None else self.quota_us / self.period_us


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/PID/cgroup`` as controller -> path; v2's unified line is the key ``""``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out.setdefault("", path)
        for c in controllers.split(","):
            if c:
                out[c.removeprefix("name=")] = path
    return out


def placement_of_path(path: str) -> Placement:
    """Runtime, container id, pod uid and QoS class as the cgroup path spells them."""
    runtime = container = None
    for name, pattern in _RUNTIMES:
        m = pattern.search(path)
        if m:
            runtime, container = name, m.group(1)
            break
    pod = _POD_UID.search(path)
    qos = _QOS.search(path)
    qos_class = qos.group(1) if qos else ("guaranteed" if pod and "kubepods" in path
                                           else None)
    return Placement(cgroup=path, runtime=runtime, container_id=container,
                     pod_uid=pod.group(1).replace("_", "-") if pod else None, qos=qos_class)


def cpu_path(groups: dict[str, str]) -> str:
    """The cgroup path whose CPU controller limits the process (v1 ``cpu``, else v2)."""
    return groups.get("cpu") or groups.get("", "/")


def v2_root(root: Path = CGROUP_ROOT) -> Path | None:
    """Where the unified (v2) hierarchy is mounted: the root itself on a v2-only
    machine, ``unified`` beside the v1 controllers on a hybrid one."""
    for p in (root, root / "unified"):
        if (p / "cgroup.procs").exists() and (p / "cgroup.controllers").exists():
            return p
    return None


def parse_cpu_max(text: str) -> tuple[int | None, int]:
    """v2 ``cpu.max``: ``"max 100000"`` or ``"25000 100000"`` -> (quota_us, period_us)."""
    quota, _, period = text.strip().partition(" ")
    return (None if quota == "max" else int(quota)), int(period or 100000)


def parse_cpu_stat(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def cpu_limit(groups: dict[str, str], root: Path = CGROUP_ROOT) -> CpuLimit | None:
    """The CPU quota and throttling counters of the process's cgroup; None when the
    cgroup's files cannot be read (another mount namespace, no CPU controller)."""
    try:
        if "cpu" in groups:
            base = root / "cpu" / cpu_path(groups).lstrip("/")
            quota = int((base / "cpu.cfs_quota_us").read_text())
            period = int((base / "cpu.cfs_period_us").read_text())
            stat = parse_cpu_stat((base / "cpu.stat").read_text())
            throttled = stat.get("throttled_time", 0)  # v1: nanoseconds
            return CpuLimit(None if quota < 0 else quota, period, stat.get("nr_periods", 0),
                            stat.get("nr_throttled", 0), throttled)
        v2 = v2_root(root)
        if v2 is None:
            return None
        base = v2 / groups.get("", "/").lstrip("/")
        q, period = parse_cpu_max((base / "cpu.max").read_text())
        stat = parse_cpu_stat((base / "cpu.stat").read_text())
        return CpuLimit(q, period, stat.get("nr_periods", 0), stat.get("nr_throttled", 0),
                        stat.get("throttled_usec", 0) * 1000)
    except (OSError, ValueError):
        return None


def pod_name_and_namespace(pid: int, env: dict[str, str]) -> tuple[str | None, str | None]:
    """The pod's name (its hostname) and namespace (its service-account file)."""
    name = env.get("HOSTNAME") or None
    raw = read_in_root(pid, SA_NAMESPACE, NAMESPACE_READ)
    text = raw.decode(errors="replace").strip() if raw else ""
    return name, text if _NAMESPACE.fullmatch(text) else None


MAX_MEMBERS = 64  # processes of one cgroup listed with each sample


def members(groups: dict[str, str], root: Path = CGROUP_ROOT, *, subtree: bool = False
            ) -> list[int]:
    """The processes sharing the cgroup's CPU quota (traced or not: a neighbour inside
    the quota takes from it), at most MAX_MEMBERS, smallest pids first; ``subtree``: those
    of every cgroup below it too (a quota set above the process's own cgroup)."""
    return members_of(groups, "cpu", root, subtree=subtree)


def members_of(groups: dict[str, str], controller: str, root: Path = CGROUP_ROOT, *,
               subtree: bool = False) -> list[int]:
    """The processes in the process's cgroup of ``controller`` (its v1 hierarchy where
    mounted, else the v2 one), at most MAX_MEMBERS, smallest pids first; ``subtree``:
    and in the cgroups below it (read until MAX_MEMBERS are found)."""
    if controller in groups:
        base = root / controller / groups[controller].lstrip("/")
    else:
        base = (v2_root(root) or root) / groups.get("", "/").lstrip("/")
    found: set[int] = set()
    dirs = [base]
    while dirs and len(found) < MAX_MEMBERS:
        d = dirs.pop()
        try:
            found.update(int(x) for x in (d / "cgroup.procs").read_text().split()
                         if x.isdigit())
            if subtree:
                dirs += sorted((c for c in d.iterdir() if c.is_dir()), reverse=True)
        except OSError:
            continue
    return sorted(found)[:MAX_MEMBERS]


def groups_by_path(cache: dict[int, dict[str, str] | None], pids: Iterable[int],
                   path_of: Callable[[dict[str, str]], str]
                   ) -> dict[str, tuple[int, dict[str, str]]]:
    """The live ``pids``' cgroups by the path ``path_of`` picks (one pid each), reading
    only pids the ``cache`` does not hold; the cache keeps live pids only, so an exited
    pid leaves and a reused one is read again."""
    fresh = {p: cache[p] if p in cache else read_groups(p) for p in sorted(pids)}
    cache.clear()
    cache.update(fresh)
    out: dict[str, tuple[int, dict[str, str]]] = {}
    for pid, groups in fresh.items():
        if groups is not None:
            out.setdefault(path_of(groups), (pid, groups))
    return out


def read_groups(pid: int) -> dict[str, str] | None:
    host_cgroup_view()
    text = read_proc_text(pid, "cgroup", CGROUP_MAX)
    return None if text is None else parse_proc_cgroup(text)


_CLONE_NEWCGROUP = 0x02000000
HOST_PID = 1  # a process in the host's cgroup namespace: its init
_joined = threading.local()


def host_cgroup_view() -> bool:
    """Read other processes' cgroups as the host names them; True when this thread
    joined the host's cgroup namespace now.

    An agent in a container with a cgroup namespace of its own (containers on cgroup
    v2 get one) sees every other process's cgroup relative to its own root
    (``0::/../../kubepods.slice/...``), which names no file under the host's
    /sys/fs/cgroup. With hostPID and the privilege to trace, it can join the namespace of
    the host's init (pid 1) instead; namespaces belong to threads, so each thread that
    reads does so once. Elsewhere (the host itself, no privilege) nothing changes: the
    container ids and pod uids in a relative path are still found."""
    if getattr(_joined, "tried", False):
        return False
    _joined.tried = True
    try:
        host = f"/proc/{HOST_PID}/ns/cgroup"
        if os.stat("/proc/thread-self/ns/cgroup").st_ino == os.stat(host).st_ino:
            return False
        fd = os.open(host, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return int(ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWCGROUP)) == 0
    finally:
        os.close(fd)


@dataclass(slots=True)
class _Seen:
    ts_ns: int
    limit: CpuLimit
    args: dict[str, object]


def ancestors(path: str) -> list[str]:
    """The cgroup ``path`` and each cgroup above it, innermost first, the root left out
    (it has no quota); none above a path that climbs out of its namespace (``..``)."""
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        return [path]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts), 0, -1)]


def limited_cgroups(by_path: dict[str, tuple[int, dict[str, str]]]
                    ) -> dict[str, tuple[int, dict[str, str], CpuLimit, bool]]:
    """Every cgroup with a CPU quota that holds a traced process, its own or one above it
    (a quota on a pod's or a slice's cgroup throttles the processes of every cgroup below,
    which have none of their own): path -> (a traced pid below it, that pid's cgroups
    with the CPU path set to it, its limit, whether it is that pid's own)."""
    out: dict[str, tuple[int, dict[str, str], CpuLimit, bool]] = {}
    unlimited: set[str] = set()
    for own, (pid, groups) in by_path.items():
        key = "cpu" if "cpu" in groups else ""
        for path in ancestors(own):
            if path in out or path in unlimited:
                continue
            at = {**groups, key: path}
            limit = cpu_limit(at)
            if limit is None or limit.quota_us is None:
                unlimited.add(path)
            else:
                out[path] = (pid, at, limit, path == own)
    return out


class ThrottleSampler:
    """Each limited cgroup of the traced processes (their own, or one above their own),
    sampled about once a second: one ``cpu_throttle`` interval per cgroup per sample with
    the throttled time and periods since the last one (the cgroup's own accounting,
    exact however the scheduler events were sampled), and the quota, period, container
    and pod in its args; ``pids``, the processes sharing the quota (below it, for a
    cgroup above the process's own)."""

    def __init__(self, code: int, environ: Callable[[int], dict[str, str]]) -> None:
        self.code = code
        self._environ = environ
        self._groups: dict[int, dict[str, str] | None] = {}  # pid -> its cgroups (cached)
        self._seen: dict[str, _Seen] = {}  # cpu cgroup path -> last sample

    def sample(self, pids: Iterable[int], now_ns: int
               ) -> list[tuple[tuple[int, ...], dict[str, object]]]:
        by_path = groups_by_path(self._groups, pids, cpu_path)
        out: list[tuple[tuple[int, ...], dict[str, object]]] = []
        for path, (pid, groups, limit, own) in limited_cgroups(by_path).items():
            last = self._seen.get(path)
            self._seen[path] = _Seen(now_ns, limit,
                                     last.args if last else
                                     placement_args(path, pid, groups, self._environ))
            if last is None:
                continue
            row = (last.ts_ns, now_ns - last.ts_ns, pid, pid, self.code, 0,
                   max(0, limit.throttled_ns - last.limit.throttled_ns), 0,
                   max(0, limit.throttled_periods - last.limit.throttled_periods),
                   max(0, limit.periods - last.limit.periods), 0)
            out.append((row, {**self._seen[path].args, "quota_us": limit.quota_us,
                              "period_us": limit.period_us,
                              "pids": members(groups, subtree=not own)}))
        return out


def placement_args(path: str, pid: int, groups: dict[str, str],
                   environ: Callable[[int], dict[str, str]]) -> dict[str, object]:
    """An event's args naming the cgroup ``path`` and, where known, the container and
    pod it belongs to (:func:`placement_of_groups`: the path, the runtime's files, the
    process itself) and the pod's QoS class."""
    args: dict[str, object] = {"cgroup": path}
    found = placement_of_groups(pid, groups, environ(pid))
    args.update({k: v for k, v in found.items() if v is not None and k != "cgroup"})
    qos = placement_of_path(path).qos or placement_of_path(groups.get("", path)).qos
    if qos and found.get("pod_uid"):
        args["qos"] = qos
    return args


# ---- a process's placement, stored once per process ------------------------------

# Where each runtime keeps a container's configuration on the host, by container id:
# the OCI bundle's config.json (containerd's CRI plugin, CRI-O), Docker's config.v2.json.
# A cgroupfs-driver path does not say which runtime made it: all are tried.
RUNTIME_FILES: dict[str, tuple[str, ...]] = {
    "containerd": ("/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",),
    "cri-o": ("/run/containers/storage/overlay-containers/{id}/userdata/config.json",
              "/var/lib/containers/storage/overlay-containers/{id}/userdata/config.json"),
    "docker": ("/var/lib/docker/containers/{id}/config.v2.json",),
}
RUNTIME_FILES["kubernetes"] = tuple(p for v in RUNTIME_FILES.values() for p in v)
RUNTIME_FILE_MAX = 4 << 20  # bytes: a container's config is tens of kB
# The labels (Docker) or OCI annotations the kubelet's runtimes write, per fact.
_LABELS: dict[PlacementColumn, tuple[str, ...]] = {
    "container_name": ("io.kubernetes.cri.container-name", "io.kubernetes.container.name"),
    "pod": ("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"),
    "namespace": ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"),
    "pod_uid": ("io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"),
}


def runtime_labels(config: dict[str, object]) -> dict[str, str]:
    """Container name, pod, namespace and pod uid from a container's configuration:
    an OCI config's ``annotations`` or Docker's ``Config.Labels``. The configuration is
    the runtime's file as parsed, unchecked: each value is tested before it is used."""
    found: dict[str, str] = {}
    docker = config.get("Config")
    for where in (config.get("annotations"),
                  docker.get("Labels") if isinstance(docker, dict) else None):
        if not isinstance(where, dict):
            continue
        for fact, keys in _LABELS.items():
            value = next((where[k] for k in keys if isinstance(where.get(k), str)), None)
            if value and fact not in found:
                found[fact] = value
    return found


def read_runtime_labels(runtime: str, container_id: str, host: Path = Path("/")
                        ) -> dict[str, str]:
    """The runtime's labels of a container, read from its files on the host (the agent
    sees them where the DaemonSet mounts them); {} when none can be read."""
    for template in RUNTIME_FILES.get(runtime, ()):
        path = host / template.format(id=container_id).lstrip("/")
        try:
            config = orjson.loads(read_regular(path, RUNTIME_FILE_MAX))
        except (OSError, FleetdError, orjson.JSONDecodeError):
            continue
        if isinstance(config, dict):
            return runtime_labels(config)
    return {}


def process_placement(pid: int, env: dict[str, str], host: Path = Path("/")
                      ) -> ProcessPlacement:
    """A process row's placement columns (fleetd.store.schema.PLACEMENT_COLUMNS): the
    cgroup carrying its CPU controller, and the container and pod its cgroup path names,
    completed from the runtime's files, then from the process itself (HOSTNAME, the
    service-account namespace). All None when /proc/PID/cgroup cannot be read."""
    groups = read_groups(pid)
    if groups is None:
        return _unplaced()
    return placement_of_groups(pid, groups, env, host)


def _unplaced() -> ProcessPlacement:
    return {"cgroup": None, "runtime": None, "container": None, "container_name": None,
            "pod": None, "namespace": None, "pod_uid": None}


def placement_of_groups(pid: int, groups: dict[str, str], env: dict[str, str],
                        host: Path = Path("/")) -> ProcessPlacement:
    """:func:`process_placement` of a process whose cgroups are already read."""
    out = _unplaced()
    out["cgroup"] = cpu_path(groups)
    place = next((pl for pl in map(placement_of_path, (groups.get("", ""), *groups.values()))
                  if pl.container_id), None)
    if place is None:
        return out
    assert place.container_id is not None
    out["runtime"], out["container"] = place.runtime, place.container_id[:12]
    out["pod_uid"] = place.pod_uid
    labels = read_runtime_labels(place.runtime or "kubernetes", place.container_id, host)
    for key in _LABELS:
        if labels.get(key):
            out[key] = labels[key]
    if place.pod_uid and not (out["pod"] and out["namespace"]):
        name, ns = pod_name_and_namespace(pid, env)
        out["pod"] = out["pod"] or name
        out["namespace"] = out["namespace"] or ns
    return out
