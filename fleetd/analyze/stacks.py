"""Where in the program the time went: the recorded user stacks of slow calls, grouped.

The tracer stores a stack once per distinct hash (``stacks``) and each event refers to
it by hash, so grouping by hash groups identical call paths. Groups are ranked by the
total time of their events; the frames come innermost first. A Python frame reads
``qualname (/path/file.py:line)``, a native one ``function (lib.so)``
(fleetd/trace/enrich/stacks.py writes them).
"""

from __future__ import annotations

import difflib
from typing import Any, TypedDict

from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.answers import StackGroup, StackProcess
from fleetd.analyze.reading.data import in_list, json_or_text, name_of
from fleetd.errors import UsageError
from fleetd.store.catalog import BY_NAME, ON_CPU

NOTE_NO_STACKS = ("no stack was recorded for these events: the tracer stores stacks only "
                  "with --stacks (every call past --stack-slow, 1 in --stack-sample kept "
                  "calls); try another op or pid, or drop the filters")


def op_code(op: str) -> int:
    """The code of a CUDA op named by a user or a peer; a close match as the hint."""
    found = BY_NAME.get(op)
    if found is None:
        close = difflib.get_close_matches(op, BY_NAME, n=3)
        hint = (f"did you mean {', '.join(close)}?" if close
                else "CUDA ops are named like cudaLaunchKernel, cuLaunchKernel, "
                "cudaStreamSynchronize; SELECT name FROM ops lists them all")
        raise UsageError(f"unknown op {op!r}", hint)
    return found.code


def stack_groups(sl: NodeSlice, op_code: int | None, pid: int | None, top_n: int,
                 frames_n: int, min_dur_ns: int = 0) -> tuple[list[StackGroup], int]:
    """The ``top_n`` heaviest stacks of the slice's events (of one op / process, at
    least ``min_dur_ns`` long), and the number of those events that have no stack."""
    where, params = _event_filter(sl, op_code, pid, min_dur_ns)
    rows = sl.conn.execute(
        "SELECT stack, count(*), sum(dur_ns), max(dur_ns), group_concat(DISTINCT op), "
        f"group_concat(DISTINCT pid) FROM event_data WHERE {where} AND stack != 0 "
        "GROUP BY stack ORDER BY sum(dur_ns) DESC LIMIT ?", [*params, top_n]).fetchall()
    frames = stack_frames(sl, [int(r[0]) for r in rows])
    groups = [_group(sl, row, frames.get(int(row[0]), []), frames_n) for row in rows]
    bare = sl.conn.execute(f"SELECT count(*) FROM event_data WHERE {where} AND stack = 0",
                           params).fetchone()[0]
    return groups, int(bare)


def stack_frames(sl: NodeSlice, hashes: list[int]) -> dict[int, list[str]]:
    """hash -> frames, innermost first (a frames value that is not a JSON list is one
    frame of text: the row may come from an older or foreign writer)."""
    if not hashes:
        return {}
    out: dict[int, list[str]] = {}
    for h, text in sl.conn.execute(f"SELECT hash, frames FROM stacks WHERE hash IN "
                                   f"{in_list(hashes)}"):
        value = json_or_text(text)
        out[int(h)] = [str(f) for f in value] if isinstance(value, list) else [str(value)]
    return out


class _Omitted(TypedDict, total=False):
    frames_omitted: int


def _group(sl: NodeSlice, row: tuple[Any, ...], frames: list[str], frames_n: int
           ) -> StackGroup:
    h, count, total, mx, ops, pids = row
    omitted: _Omitted = ({"frames_omitted": len(frames) - frames_n} if len(frames) > frames_n
                         else {})
    return {
        "stack": f"{int(h) & (2**64 - 1):016x}", "events": count, "total_ns": total,
        "mean_ns": total // count if count else None, "max_ns": mx,
        "ops": sorted({name_of(int(x)) for x in str(ops).split(",") if x}),
        "processes": [StackProcess(pid=p, comm=sl.names.get(p))
                      for p in sorted(int(x) for x in str(pids).split(",") if x)[:10]],
        "frames": frames[:frames_n], **omitted, "node": sl.name}


BY_SOURCE_CPU = ON_CPU.codes  # cpu_sample, gc_pause


def _event_filter(sl: NodeSlice, op_code: int | None, pid: int | None, min_dur_ns: int = 0
                  ) -> tuple[str, list[int]]:
    where = "ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ?"
    params = [sl.window.start_ns, sl.window.end_ns, sl.node.lo, sl.node.hi]
    if min_dur_ns > 0:
        where += " AND dur_ns >= ?"
        params.append(min_dur_ns)
    if op_code is not None:
        where += " AND op = ?"
        params.append(op_code)
    else:  # on-CPU samples and GC pauses have stacks too: `fleetd profile` reads them
        where += f" AND op NOT IN {in_list(BY_SOURCE_CPU)}"
    if pid is not None:
        where += " AND pid = ?"
        params.append(pid)
    return where, params
