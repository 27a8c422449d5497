"""Memory pressure of the traced processes: reclaim stalls, limits and PSI.

A process at its cgroup's memory limit (a Kubernetes memory limit) pays for every new
page it charges: the kernel first reclaims from the cgroup, in the allocating thread,
on its own time. Without swap only file-backed pages (page cache, lazily freed memory)
can be reclaimed, so a feeding thread that reads its data through the page cache, or
whose allocator hands memory back with MADV_FREE, stalls in reclaim over and over while
the limit holds, and the GPU waits.

Three sources, each exact in its own terms:

* The kernel's vmscan and compaction tracepoints (bpf/host.bpf.c): the thread's own
  direct reclaim, memcg reclaim and direct compaction stalls, summed per thread in the
  kernel into runs (``direct_reclaim``, ``memcg_reclaim``, ``direct_compaction``).
  :func:`tracepoints` says which the kernel has; :func:`leftover_runs` reads the runs
  not yet sent when tracing stops.
* The cgroup's own accounting, sampled about once a second (:class:`MemorySampler`,
  ``mem_cgroup`` events): the limit that applies (v1 ``hierarchical_memory_limit``, v2
  the smallest ``memory.max`` on the way to the root), usage, peak, how often the limit
  was hit, page cache and anonymous memory.
* Pressure stall information where the kernel provides it: the process's cgroup v2
  ``memory.pressure`` (PSI is kept per v2 cgroup even on machines that mount the memory
  controller on v1) and the machine's ``/proc/pressure/memory``: the time some task
  of the group stalled on memory, as the kernel counts it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetd.store.catalog import RECLAIM_RUNS_BY_KIND, op_code
from fleetd.trace.host.cgroups import (
    CGROUP_ROOT,
    groups_by_path,
    members_of,
    placement_args,
    v2_root,
)

TRACEFS = (Path("/sys/kernel/tracing/events"), Path("/sys/kernel/debug/tracing/events"))
# -D flag -> the tracepoints it attaches, all of which must exist to compile: a stall's
# begin and end, or (FL_KWORK) the one that counts kernel work, named twice.
TRACEPOINTS: dict[str, tuple[str, str]] = {
    "FL_VMSCAN": ("vmscan/mm_vmscan_direct_reclaim_begin",
                  "vmscan/mm_vmscan_direct_reclaim_end"),
    "FL_MEMCG_RECLAIM": ("vmscan/mm_vmscan_memcg_reclaim_begin",
                         "vmscan/mm_vmscan_memcg_reclaim_end"),
    "FL_COMPACTION": ("compaction/mm_compaction_begin", "compaction/mm_compaction_end"),
    "FL_KWORK": ("workqueue/workqueue_queue_work", "workqueue/workqueue_queue_work"),
}
# The ops of a run, by the kind the kernel side keeps (0, 1, 2).
RUN_OPS = RECLAIM_RUNS_BY_KIND
NO_LIMIT = 1 << 60  # v1 writes "unlimited" as 2^63 rounded down to a page
PSI_SYSTEM = Path("/proc/pressure/memory")


def tracepoints(roots: Iterable[Path] = TRACEFS) -> dict[str, bool]:
    """Which reclaim/compaction tracepoint pairs this kernel has (the BPF program
    compiles only the ones it has: a missing one would fail the whole compile)."""
    base = next((r for r in roots if r.is_dir()), None)
    return {flag: base is not None and all((base / tp / "format").exists() for tp in pair)
            for flag, pair in TRACEPOINTS.items()}


def leftover_runs(table: Any, to_wall: Callable[[int], int]) -> list[tuple[int, ...]]:
    """Event rows for the stall runs still in the kernel's ``fl_reclaim`` map (the
    kernel sends a run once it spans 10 ms; the rest is read here when tracing stops)."""
    rows: list[tuple[int, ...]] = []
    for k, v in table.items():
        kind = int(v.kind)
        if not int(v.stalls) or not 0 <= kind < len(RUN_OPS):
            continue
        first, last = int(v.first), int(v.last)
        rows.append((to_wall(first), max(0, last - first), int(v.pid), int(k.value),
                     op_code(RUN_OPS[kind]), 0, int(v.stall_ns), 0, int(v.stalls),
                     int(v.pages), 0))
    return rows


class KernelWork:
    """Kernel work the traced threads queued, per (thread, work function), from the
    kernel's cumulative counts in ``fl_kwork``: each read gives the counts since the
    last one as ``kwork_queued`` rows over that interval, the function named."""

    def __init__(self, op: int, ksym: Callable[[int], bytes]) -> None:
        self.op = op
        self._ksym = ksym
        self._seen: dict[tuple[int, int, int], int] = {}
        self._names: dict[int, str] = {}

    def rows(self, table: Any, start_wall: int, end_wall: int
             ) -> list[tuple[tuple[int, ...], dict[str, object]]]:
        out: list[tuple[tuple[int, ...], dict[str, object]]] = []
        for k, v in table.items():
            key = (int(k.tid), int(k.pid), int(k.func))
            n = int(v.value) - self._seen.get(key, 0)
            self._seen[key] = int(v.value)
            if n <= 0:
                continue
            tid, pid, func = key
            # A kernel address is above 2**63: stored as the signed 64-bit a1 holds.
            signed = func - (1 << 64) if func >= 1 << 63 else func
            out.append(((start_wall, max(0, end_wall - start_wall), pid, tid, self.op, 0, 0,
                         0, n, signed, 0), {"function": self._name(func)}))
        return out

    def _name(self, func: int) -> str:
        if func not in self._names:
            try:
                self._names[func] = self._ksym(func).decode(errors="replace")
            except Exception:  # BCC raises its own errors for an address it cannot name
                self._names[func] = hex(func)
        return self._names[func]


# ---- the cgroup's accounting ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemoryState:
    """A memory cgroup at one moment; byte counts, counters since it was made."""

    limit: int | None  # None: no limit on the way to the root
    usage: int
    peak: int | None
    limit_hits: int  # v1 failcnt, v2 memory.events "max": charges that hit the limit
    # On the file LRU lists: page cache and lazily freed (MADV_FREE) memory, what
    # reclaim can drop without swap.
    file: int | None
    anon: int | None
    psi_some_us: int | None  # the v2 cgroup's memory.pressure "some" total
    psi_full_us: int | None


def parse_psi(text: str) -> dict[str, int]:
    """``some avg10=.. total=N`` / ``full ...`` -> {"some": N, "full": N} (us)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        for field in rest.split():
            key, _, value = field.partition("=")
            if key == "total" and value.isdigit():
                out[kind] = int(value)
    return out


def _stat(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _read(p: Path) -> str | None:
    try:
        return p.read_text()
    except OSError:
        return None


def _psi(groups: dict[str, str], root: Path) -> dict[str, int]:
    v2 = v2_root(root)
    path = groups.get("", "/")
    if v2 is None or path == "/":  # the root's is the machine's, not the cgroup's
        return {}
    text = _read(v2 / path.lstrip("/") / "memory.pressure")
    return parse_psi(text) if text else {}


def memory_state(groups: dict[str, str], root: Path = CGROUP_ROOT) -> MemoryState | None:
    """The memory cgroup of a process (v1 ``memory`` controller, else v2); None when
    its files cannot be read (another mount namespace, no memory controller)."""
    psi = _psi(groups, root)
    if "memory" in groups:
        base = root / "memory" / groups["memory"].lstrip("/")
        texts = [_read(base / f) for f in ("memory.stat", "memory.usage_in_bytes",
                                           "memory.max_usage_in_bytes", "memory.failcnt")]
        if any(t is None for t in texts):
            return None
        stat = _stat(texts[0] or "")
        limit = stat.get("hierarchical_memory_limit", NO_LIMIT)
        return MemoryState(None if limit >= NO_LIMIT else limit, int(texts[1] or 0),
                           int(texts[2] or 0), int(texts[3] or 0),
                           _lru_file(stat, "total_"), stat.get("total_rss"),
                           psi.get("some"), psi.get("full"))
    v2 = v2_root(root)
    if v2 is None:
        return None
    base = v2 / groups.get("", "/").lstrip("/")
    current = _read(base / "memory.current")
    if current is None:
        return None
    stat = _stat(_read(base / "memory.stat") or "")
    events = _stat(_read(base / "memory.events") or "")
    peak = _read(base / "memory.peak")
    return MemoryState(_v2_limit(base, v2), int(current), int(peak) if peak else None,
                       events.get("max", 0), _lru_file(stat, ""), stat.get("anon"),
                       psi.get("some"), psi.get("full"))


def _lru_file(stat: dict[str, int], prefix: str) -> int | None:
    a, i = stat.get(f"{prefix}active_file"), stat.get(f"{prefix}inactive_file")
    return None if a is None or i is None else a + i


def _v2_limit(base: Path, v2: Path) -> int | None:
    """The smallest ``memory.max`` from the cgroup up to the root: a pod's limit sits
    on the pod's cgroup, above its containers'."""
    best: int | None = None
    p = base
    while p != v2 and v2 in p.parents:
        text = (_read(p / "memory.max") or "max").strip()
        if text.isdigit():
            best = int(text) if best is None else min(best, int(text))
        p = p.parent
    return best


def memory_path(groups: dict[str, str]) -> str:
    return groups.get("memory") or groups.get("", "/")


@dataclass(slots=True)
class _Last:
    ts_ns: int
    state: MemoryState
    system_some_us: int | None
    args: dict[str, object]


class MemorySampler:
    """Each memory-limited cgroup of the traced processes, sampled about once a second:
    one ``mem_cgroup`` interval per cgroup per sample with its limit, usage, peak, the
    limit hits and the pressure stall time since the last sample, and its container and
    pod in the args."""

    def __init__(self, code: int, environ: Callable[[int], dict[str, str]],
                 root: Path = CGROUP_ROOT, psi_system: Path = PSI_SYSTEM) -> None:
        self.code = code
        self._environ = environ
        self._root = root
        self._psi_system = psi_system
        self._groups: dict[int, dict[str, str] | None] = {}
        self._last: dict[str, _Last] = {}

    def sample(self, pids: Iterable[int], now_ns: int
               ) -> list[tuple[tuple[int, ...], dict[str, object]]]:
        by_path = groups_by_path(self._groups, pids, memory_path)
        system = parse_psi(_read(self._psi_system) or "").get("some")
        out: list[tuple[tuple[int, ...], dict[str, object]]] = []
        for path, (pid, groups) in by_path.items():
            state = memory_state(groups, self._root)
            if state is None or state.limit is None:
                continue
            last = self._last.get(path)
            args = last.args if last else placement_args(path, pid, groups, self._environ)
            self._last[path] = _Last(now_ns, state, system, args)
            if last is not None:
                out.append(self._row(path, pid, groups, last, state, system, now_ns))
        return out

    def _row(self, path: str, pid: int, groups: dict[str, str], last: _Last,
             state: MemoryState, system: int | None, now_ns: int
             ) -> tuple[tuple[int, ...], dict[str, object]]:
        some = _delta(state.psi_some_us, last.state.psi_some_us)
        row = (last.ts_ns, now_ns - last.ts_ns, pid, pid, self.code, 0, state.usage, 0,
               state.limit if state.limit is not None else -1,
               some if some is not None else -1, 0)
        args: dict[str, object] = {
            **last.args, "cgroup": path, "limit_bytes": state.limit,
            "usage_bytes": state.usage, "peak_bytes": state.peak,
            "limit_hits": max(0, state.limit_hits - last.state.limit_hits),
            "file_bytes": state.file, "anon_bytes": state.anon,
            "psi_some_us": some,
            "psi_full_us": _delta(state.psi_full_us, last.state.psi_full_us),
            "psi_system_some_us": _delta(system, last.system_some_us),
            "pids": members_of(groups, "memory", self._root)}
        return row, {k: v for k, v in args.items() if v is not None}


def _delta(now: int | None, before: int | None) -> int | None:
    return None if now is None or before is None else max(0, now - before)
