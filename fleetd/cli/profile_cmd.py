"""``fleetd profile``: where the traced threads spent the time they ran on a CPU, from
the tracer's on-CPU samples (``--cpu-sample-hz``), as top frames, folded flame-graph
lines or a speedscope file."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from orjson import dumps

from fleetd.cli.argtypes import positive
from fleetd.cli.fleet_args import add_fleet_args
from fleetd.cli.outfile import add_output_args, output_path, writing
from fleetd.cli.output import write_rows
from fleetd.cli.questions import ask
from fleetd.cli.window_args import add_window
from fleetd.errors import UsageError
from fleetd.questions.catalog import CPU_STACKS

PROFILE_FORMATS = ("table", "json", "folded", "speedscope")
COLUMNS = ["frame", "self", "self_share", "total", "total_share"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "profile",
        help="on-CPU profile of the traced threads: top frames, flame graphs",
        description="Where the traced threads spent their time on a CPU, from the tracer's "
        "on-CPU samples (fleetd trace --cpu-sample-hz, default 49 per second per CPU): "
        "native frames above the interpreter, then Python frames 'function (file.py:line)'; "
        "a sample taken while the interpreter collected garbage starts with "
        "'[garbage collection]'. The table lists the frames with the most samples: self "
        "(the innermost frame) and total (anywhere on the stack), as counts and shares of "
        "all samples; one sample stands for one period of CPU time. --format folded prints "
        "one line per stack, outermost frame first, joined by ';', then its samples (the "
        "input of flamegraph.pl, speedscope and inferno); --format speedscope writes a "
        "file https://www.speedscope.app opens. With --nodes (or a fleet config), every "
        "agent answers its samples and the profile is merged per stack across nodes.",
    )
    add_window(p)
    p.add_argument("--pid", type=positive("pid"), help="only this process")
    p.add_argument("--tid", type=positive("tid"), help="only this thread")
    p.add_argument("--node", help="only this node of a merged database")
    p.add_argument("--top", type=positive("--top"), default=20, metavar="N",
                   help="frames in the table (default 20)")
    add_fleet_args(p)
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(PROFILE_FORMATS)}")
    add_output_args(p, "the profile (folded lines, a speedscope file...)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.analyze.reading.profile import StackCount

    if args.format not in PROFILE_FORMATS:
        raise UsageError(f"unknown format {args.format!r}",
                         f"use one of: {', '.join(PROFILE_FORMATS)}")
    path = output_path(args)  # refused before any work is done for it
    asked = ask(args, CPU_STACKS, pid=args.pid, tid=args.tid)
    names = asked.obj.get("names")
    if asked.result is None and args.node is not None and args.node not in (names or []):
        raise UsageError(f"no node {args.node!r} in this database",
                         f"nodes: {', '.join(names or []) or 'none'}")
    stacks = [StackCount(s["node"], s["pid"], s["tid"], tuple(s["frames"]), s["samples"],
                         s["gc"]) for s in asked.obj["stacks"] if args.node in (None, s["node"])]
    with writing(path) as out:
        _write(args, stacks, int(asked.obj["period_ns"]), out)
    return asked.done(args, args.format != "table")


def _write(args: argparse.Namespace, stacks: list[Any], period: int, out: TextIO) -> None:
    from fleetd.analyze.reading.profile import folded_lines, profile, speedscope

    if args.format == "folded":
        out.write("".join(line + "\n" for line in folded_lines(stacks)))
        return
    if args.format == "speedscope":
        name = "fleetd profile" + (f" pid {args.pid}" if args.pid else "") + \
            (f" tid {args.tid}" if args.tid else "")
        out.write(dumps(speedscope(stacks, name)).decode() + "\n")
        return
    summary = profile(stacks, period, args.top)
    if args.format == "json":
        out.write(dumps(summary).decode() + "\n")
        return
    _table(summary, out)


def _table(summary: Any, out: TextIO) -> None:
    from fleetd.analyze.reading.frames import short_frame

    if not summary["samples"]:
        print(f"fleetd profile: {summary['note']}", file=sys.stderr)
        return
    period_ms = summary["period_ns"] / 1e6
    print(f"{summary['samples']} on-CPU samples ({summary['on_cpu_ns'] / 1e9:.2f} s of CPU at "
          f"{period_ms:.1f} ms each) in {summary['threads']} thread(s), "
          f"{summary['stacks']} distinct stacks; {summary['gc_samples']} in the garbage "
          "collector", file=out)
    rows = [[short_frame(f["frame"]), f["self_samples"], f"{f['self_share']:.1%}",
             f["total_samples"], f"{f['total_share']:.1%}"] for f in summary["top"]]
    write_rows(COLUMNS, rows, "table", out)
