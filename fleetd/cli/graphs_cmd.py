"""``fleetd graphs``: CUDA graph capture, instantiation and replay per process, of one
database or (``--nodes``) of every node; the same view as the MCP tool
``graph_lifecycle``."""

from __future__ import annotations

import argparse
import sys

from fleetd.cli.argtypes import positive
from fleetd.cli.fleet_args import add_fleet_args
from fleetd.cli.output import FORMATS, check_format, print_notes, write_rows
from fleetd.cli.questions import ask
from fleetd.cli.window_args import add_window
from fleetd.questions.catalog import GRAPHS

COLUMNS = ["node", "pid", "comm", "captures", "instantiations", "launches",
           "launches_per_instantiation", "build_share_of_wall", "verdict"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "graphs",
        help="CUDA graph lifecycle per process: capture, instantiate, replay",
        description="Per process with CUDA graph calls: how often graphs were captured, "
        "instantiated and launched, the replay ratio, the launch rate inside and outside "
        "capture episodes, and a verdict (healthy replay or re-capture). --format json "
        "adds the phase latencies and a timeline of --buckets rows.",
    )
    add_window(p)
    p.add_argument("--pid", type=positive("pid"), help="only this process")
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    p.add_argument("--buckets", type=positive("--buckets"), default=20, metavar="N",
                   help="timeline rows per process in JSON (default 20)")
    add_fleet_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fmt = check_format(args.format)
    asked = ask(args, GRAPHS, pid=args.pid, buckets=args.buckets)
    _write(asked.body(), fmt)
    return asked.done(args, fmt == "json")


def _write(obj: dict[str, object], fmt: str) -> None:
    got = obj.get("processes")
    procs = [p for p in got if isinstance(p, dict)] if isinstance(got, list) else []
    rows = [_row(p) for p in procs]
    write_rows(COLUMNS, rows, fmt, sys.stdout, {k: v for k, v in obj.items()
                                                 if k != "processes"} | {"processes": procs})
    print_notes(obj, bool(procs), fmt)


def _row(p: dict[str, object]) -> list[object]:
    """A process's row. Over the fleet, a node's answer to graphs has no wire reader
    (only its numbers are checked), so its values stay ``object``, each read with a
    fallback: a node that sends something else costs that cell, not the table."""
    phases = _dict(p.get("phases"))
    rates = _dict(p.get("rates"))

    def count(phase: str) -> object:
        got = phases.get(phase)
        return got.get("count") if isinstance(got, dict) else 0

    return [p.get("node"), p.get("pid"), p.get("comm"), count("begin_capture"),
            count("instantiate"), count("launch"), rates.get("launches_per_instantiation"),
            rates.get("build_share_of_wall"), p.get("verdict")]


def _dict(value: object) -> dict[str, object]:
    """A node's nested object, or an empty one where it sent something else."""
    return value if isinstance(value, dict) else {}
