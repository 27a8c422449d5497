"""``fleetd stacks``: which code paths the slow CUDA calls come from, of one database or
(``--nodes``) of every node; the same grouping as the MCP tool ``get_stacks``."""

from __future__ import annotations

import argparse
from typing import TextIO

from fleetd.analyze.reading.frames import folded, short_frame, top_python_frame
from fleetd.cli.argtypes import positive
from fleetd.cli.fleet_args import add_fleet_args
from fleetd.cli.outfile import add_output_args, output_path, writing
from fleetd.cli.output import FORMATS, check_format, print_notes, table_view, write_rows
from fleetd.cli.questions import ask
from fleetd.cli.window_args import add_window
from fleetd.errors import UsageError
from fleetd.questions.catalog import STACKS
from fleetd.store.timeparse import parse_duration

COLUMNS = ["node", "events", "total_ns", "mean_ns", "max_ns", "ops", "frames"]
FOLDED = "folded"  # flame-graph input: outermost;...;innermost COUNT
FRAME_JOIN = " <- "  # innermost first: the CUDA call, then its callers


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "stacks",
        help="the recorded user stacks of CUDA calls, heaviest first",
        description="Group the window's CUDA calls by their recorded user stack and rank the "
        "groups by total time: which code path the slow calls come from. Frames are "
        "innermost first. With --nodes, every agent groups its own calls and the groups "
        "are merged, heaviest first, each with its node. Python frames read "
        "'function (file.py:line)'. --format folded prints one line per stack, outermost "
        "frame first, joined by ';', then the number of calls: the input of flame-graph "
        "tools (flamegraph.pl, speedscope, inferno).",
    )
    add_window(p)
    p.add_argument("--op", help="only calls of this CUDA op (e.g. cudaStreamSynchronize)")
    p.add_argument("--pid", type=positive("pid"), help="only calls of this process")
    p.add_argument("--min-dur", metavar="DUR",
                   help="only calls at least this long (e.g. 1ms)")
    p.add_argument("--top", type=positive("--top"), default=10, metavar="N",
                   help="stacks to show (default 10)")
    p.add_argument("--frames", type=positive("--frames"), default=16, metavar="N",
                   help="frames per stack, innermost first (default 16)")
    add_fleet_args(p)
    p.add_argument("--format", default="table",
                   help=f"output format: {'|'.join((*FORMATS, FOLDED))}")
    add_output_args(p, "the stacks (e.g. folded lines for a flame graph)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fmt = args.format if args.format == FOLDED else check_format(args.format)
    min_dur = _min_dur(args.min_dur)
    if args.op:
        from fleetd.analyze.stacks import op_code

        op_code(args.op)  # refused once, here, rather than by every node
    path = output_path(args)  # refused before any work is done for it
    asked = ask(args, STACKS, op=args.op, pid=args.pid, top_n=args.top, frames_n=args.frames,
                min_dur_ns=min_dur)
    obj = asked.body()
    if asked.result is not None:
        obj["events_without_stack"] = sum(
            n["events_without_stack"] for n in asked.obj["nodes"]
            if isinstance(n.get("events_without_stack"), int))
    with writing(path) as out:
        got = obj.get("stacks")  # the stacks of the answer, heaviest first
        stacks = [s for s in got if isinstance(s, dict)] if isinstance(got, list) else []
        _write(obj, stacks[: args.top], fmt, out)
    return asked.done(args, fmt in ("json", FOLDED))


def _min_dur(text: str | None) -> int:
    if not text:
        return 0
    try:
        return parse_duration(text)
    except UsageError as exc:
        raise UsageError(f"--min-dur: {exc.message}", exc.hint) from exc


def _write(obj: dict[str, object], found: list[dict[str, object]], fmt: str,
           out: TextIO) -> None:
    """``found``: the stacks to show. Over the fleet a node's answer to stacks has no
    wire reader (only its numbers are checked), so a stack's values stay ``object``,
    each read with a fallback."""
    if fmt == FOLDED:
        for s in found:
            events = s.get("events")
            out.write(folded(_frame_list(s), events if isinstance(events, int) else 0)
                      + "\n")
        return
    rows = [[s.get("node"), s.get("events"), s.get("total_ns"), s.get("mean_ns"),
             s.get("max_ns"), ",".join(map(str, _list(s.get("ops")))),
             _frames(s, fmt)] for s in found]
    extra = {k: v for k, v in obj.items() if k != "stacks"}
    shown, values = table_view(COLUMNS, rows, fmt)  # durations in human units in tables
    write_rows(shown, values, fmt, out, extra)
    print_notes(obj, bool(found), fmt)


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _frame_list(s: dict[str, object]) -> list[str]:
    return [str(f) for f in _list(s.get("frames"))]


def _frames(s: dict[str, object], fmt: str) -> str | list[str]:
    frames = _frame_list(s)
    if fmt == "table":  # the user's line first: it is what the reader looks for
        top = top_python_frame(frames)
        text = FRAME_JOIN.join(short_frame(f) for f in frames)
        return f"[{top}] {text}" if top else text
    return FRAME_JOIN.join(frames) if fmt == "csv" else frames
