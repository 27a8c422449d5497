"""Facts about traced processes, read from /proc while they are alive.

Rank, local rank and world size come from torchrun's environment variables (RANK,
LOCAL_RANK, WORLD_SIZE) in /proc/PID/environ, and so does the job the rank belongs to
(TORCHELASTIC_RUN_ID, else MASTER_ADDR:MASTER_PORT), as :mod:`fleetd.store.torchrun`
reads them. Every read tolerates the process having exited in the meantime: a missing
fact is None, never an exception. The files are the process's to fill: each is read
through fleetd.security.procfs, bounded per file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fleetd.security.procfs import (
    CMDLINE_MAX,
    COMM_MAX,
    ENVIRON_MAX,
    STAT_MAX,
    STATUS_MAX,
    read_proc_text,
)
from fleetd.store.schema import PLACEMENT_COLUMNS, ProcessFields
from fleetd.store.torchrun import TorchrunRanks, job_of, ranks_of
from fleetd.trace.host.cgroups import process_placement

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def comm(pid: int, tid: int | None = None) -> str | None:
    text = read_proc_text(pid, "comm", COMM_MAX, tid)
    if text is None and tid:
        text = read_proc_text(tid, "comm", COMM_MAX)
    return text.strip() if text else None


def tgid_of(tid: int) -> int | None:
    text = read_proc_text(tid, "status", STATUS_MAX)
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("Tgid:"):
            return int(line.split()[1])
    return None


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name (which may hold spaces)."""
    text = read_proc_text(pid, "stat", STAT_MAX)
    if not text or ")" not in text:
        return None
    return text.rsplit(")", 1)[1].split()


def ppid_of(pid: int) -> int | None:
    f = stat_fields(pid)
    return int(f[1]) if f else None


def _boot_wall_ns() -> int:
    return time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def start_wall_ns(pid: int) -> int | None:
    f = stat_fields(pid)
    if not f:
        return None
    ticks = int(f[19])  # field 22 (starttime), counted from after the comm
    return _boot_wall_ns() + ticks * 1_000_000_000 // _CLK_TCK


def environ(pid: int) -> dict[str, str]:
    """NAME=value entries; an entry without "=" is skipped, a repeated name keeps its last."""
    text = read_proc_text(pid, "environ", ENVIRON_MAX) or ""
    pairs = (item.split("=", 1) for item in text.split("\0") if "=" in item)
    return {key: value for key, value in pairs}


def rank_info(pid: int) -> TorchrunRanks:
    return ranks_of(environ(pid))


def process_row(pid: int) -> ProcessFields:
    """A processes row for the writer; absent facts are None (the writer keeps old ones)."""
    exe: str | None
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = None
    raw = read_proc_text(pid, "cmdline", CMDLINE_MAX)
    cmdline = " ".join(a for a in raw.split("\0") if a) if raw else None
    env = environ(pid)
    ranks = ranks_of(env)
    row: ProcessFields = {
        "pid": pid, "ppid": ppid_of(pid), "comm": comm(pid), "exe": exe,
        "cmdline": cmdline, "start_ns": start_wall_ns(pid), "rank": ranks["rank"],
        "local_rank": ranks["local_rank"], "world_size": ranks["world_size"],
        "job": job_of(env),
    }
    place = process_placement(pid, env)
    for key in PLACEMENT_COLUMNS:
        row[key] = place[key]
    return row


def children_map() -> dict[int, list[int]]:
    """ppid -> pids, for every process visible now."""
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pp = ppid_of(int(entry.name))
        if pp is not None:
            out.setdefault(pp, []).append(int(entry.name))
    return out


def descendants(pids: list[int]) -> list[int]:
    """Every live descendant of ``pids`` (not including them)."""
    kids = children_map()
    out: list[int] = []
    todo = list(pids)
    seen = set(pids)
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                out.append(c)
                todo.append(c)
    return out


def threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def cgroup_id(path: str) -> int:
    """The id BPF's bpf_get_current_cgroup_id() returns: the cgroup v2 dir's inode."""
    return os.stat(path).st_ino
