"""``fleetd stacks``: which code paths the slow CUDA calls come from, of one database or
(``--nodes``) of every node; the same grouping as the MCP tool ``get_stacks``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fleetd.cli.explain_cmd import add_window, open_analysis, positive
from fleetd.cli.fleet_args import add_fleet_args, fleet_mode, fleet_options, report
from fleetd.cli.output import FORMATS, check_format, print_notes, write_rows

COLUMNS = ["node", "events", "total_ns", "mean_ns", "max_ns", "ops", "frames"]
FRAME_JOIN = " <- "  # innermost first: the CUDA call, then its callers


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "stacks",
        help="the recorded user stacks of CUDA calls, heaviest first",
        description="Group the window's CUDA calls by their recorded user stack and rank the "
        "groups by total time: which code path the slow calls come from. Frames are "
        "innermost first. With --nodes, every agent groups its own calls and the groups "
        "are merged, heaviest first, each with its node.",
    )
    add_window(p)
    p.add_argument("--op", help="only calls of this CUDA op (e.g. cudaStreamSynchronize)")
    p.add_argument("--pid", type=positive("pid"), help="only calls of this process")
    p.add_argument("--top", type=positive("--top"), default=10, metavar="N",
                   help="stacks to show (default 10)")
    p.add_argument("--frames", type=positive("--frames"), default=16, metavar="N",
                   help="frames per stack, innermost first (default 16)")
    add_fleet_args(p)
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fmt = check_format(args.format)
    if fleet_mode(args):
        return _run_fleet(args, fmt)
    with open_analysis(args) as (_, analysis):
        got = analysis.stacks(args.op, args.pid, args.top, args.frames)
    _write(got, got["stacks"][: args.top], fmt)
    return 0


def _run_fleet(args: argparse.Namespace, fmt: str) -> int:
    from fleetd.analyze.stacks import op_code
    from fleetd.analyze.window import WindowSpec
    from fleetd.fleet.queries import stacks

    if args.op:
        op_code(args.op)  # refused once, here, rather than by every node
    result = stacks(fleet_options(args), WindowSpec(args.since, args.from_, args.to),
                    args.op, args.pid, args.top, args.frames)
    obj = {k: v for k, v in result.obj.items() if k != "nodes"}
    obj["events_without_stack"] = sum(
        n["events_without_stack"] for n in result.obj["nodes"]
        if isinstance(n.get("events_without_stack"), int))
    _write(obj, result.obj["stacks"][: args.top], fmt)
    if fmt != "json" or args.show_skew:
        report(result.answer, args.show_skew)
    return result.exit_code


def _write(obj: dict[str, Any], found: list[dict[str, Any]], fmt: str) -> None:
    rows = [[s.get("node"), s.get("events"), s.get("total_ns"), s.get("mean_ns"),
             s.get("max_ns"), ",".join(map(str, s.get("ops") or [])),
             _frames(s, fmt)] for s in found]
    extra = {k: v for k, v in obj.items() if k != "stacks"}
    write_rows(COLUMNS, rows, fmt, sys.stdout, extra)
    print_notes(obj, bool(found), fmt)


def _frames(s: dict[str, Any], fmt: str) -> Any:
    frames = [str(f) for f in s.get("frames") or []]
    return FRAME_JOIN.join(frames) if fmt in ("table", "csv") else frames
