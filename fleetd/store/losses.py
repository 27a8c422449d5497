"""What a node's sessions lost, as the store recorded it: sessions ended by a crash
(closed at their last commit by the next writer, fleetd.store.writer) and events the
writer dropped because the disk was full.

Read by ``fleetd check --only db`` and by the agent at start (its log and
``GET /api/v1/health``), so an operator sees a kill -9 or a full disk without querying.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, TypedDict

from fleetd.store.timeparse import format_ns

# The crashes named one by one (the newest); older ones are only counted.
SHOWN = 5


class CrashReport(TypedDict):
    session: int
    node: str
    last_commit_ns: int  # the session's last committed write: nothing after it is stored
    last_commit: str  # the same, as UTC text
    lost_events: int  # emitted by the kernel after that commit, so never stored
    gap_s: float | None  # untraced: from the last commit to the next session's start


class SessionLosses(TypedDict):
    sessions: int
    crashed: int
    crashes: list[CrashReport]  # the newest SHOWN, oldest first
    write_failed: int  # events the writer could not store (a full disk, an I/O error)
    newest_crashed: bool  # the newest closed session ended by a crash


_SESSIONS_SQL = """
SELECT s.seq, n.name, s.started_ns, s.ended_ns, coalesce(s.end_reason, ''),
       coalesce(s.lost_events, 0), coalesce(json_extract(s.drops, '$.writer_failed'), 0),
       s.updated_ns, coalesce(s.emitted_events - s.accounted_events, 0), s.boot_id,
       json_extract(s.targets, '$.tracer_pid')
FROM session_data s JOIN nodes n ON n.id = s.node
ORDER BY s.node, s.started_ns, s.seq
"""
Row = tuple[int, str, int, int | None, str, int, int]


def _as_closed(raw: tuple[Any, ...]) -> Row:
    """A session still open whose tracer is gone, read as the next writer will close it
    (fleetd.store.writer): ended at its last commit, losing what was emitted after it."""
    seq, name, started, ended, reason, lost, failed, updated, unaccounted, boot, pid = raw
    if ended is None and tracer_gone(boot, started, pid):
        return (seq, name, started, updated or started, "crashed",
                lost + max(0, unaccounted), failed)
    return (seq, name, started, ended, reason, lost, failed)


def session_losses(conn: sqlite3.Connection, node: str | None = None) -> SessionLosses:
    """The crashes and disk-full drops recorded in ``conn``'s sessions (of ``node``, or
    all nodes)."""
    rows = [_as_closed(r) for r in conn.execute(_SESSIONS_SQL).fetchall()
            if node in (None, r[1])]
    crashes: list[CrashReport] = []
    dropped = 0
    for i, (seq, name, _started, ended, reason, lost, failed) in enumerate(rows):
        dropped += int(failed or 0)
        if reason != "crashed" or ended is None:
            continue
        following = rows[i + 1] if i + 1 < len(rows) and rows[i + 1][1] == name else None
        gap = None if following is None else round((following[2] - ended) / 1e9, 3)
        crashes.append(CrashReport(session=int(seq), node=str(name),
                                   last_commit_ns=int(ended), last_commit=format_ns(ended),
                                   lost_events=int(lost), gap_s=gap))
    closed = [r for r in rows if r[3] is not None]
    return SessionLosses(sessions=len(rows), crashed=len(crashes), crashes=crashes[-SHOWN:],
                         write_failed=dropped,
                         newest_crashed=bool(closed) and closed[-1][4] == "crashed")


def describe_crash(c: CrashReport) -> str:
    gap = "" if c["gap_s"] is None else f", {c['gap_s']:.1f} s untraced until the next began"
    return (f"session {c['session']} of {c['node']} was killed: its last commit was at "
            f"{c['last_commit']}, {c['lost_events']} events emitted after it were lost{gap}")


def tracer_gone(boot_id: str | None, started_ns: int | None, pid: Any) -> bool:
    """Whether the tracer of an open session is no longer running: another boot, or no
    process with its pid that started before the session. A session that does not say
    which process traced it (files from other writers) is never judged."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    if boot_id and boot_id != _boot_id():
        return True
    start = _process_start_ns(pid)
    # btime is whole seconds: a second of margin keeps a live tracer from looking new.
    return start is None or (started_ns is not None and start > started_ns + 10**9)


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start_ns(pid: int) -> int | None:
    """A process's start on the wall clock (to the clock tick), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text()
                     .splitlines() if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return btime * 10**9 + ticks * 10**9 // os.sysconf("SC_CLK_TCK")
