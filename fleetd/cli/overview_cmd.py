"""``fleetd overview``: per node, how much was recorded, what was lost, how many chains of
each severity and the verdict; of one database or (``--nodes``) of the whole fleet."""

from __future__ import annotations

import argparse
import sys

from fleetd.cli.fleet_args import add_fleet_args
from fleetd.cli.output import FORMATS, check_format, dumps, warn, write_rows
from fleetd.cli.questions import ask
from fleetd.cli.window_args import add_window
from fleetd.questions.catalog import OVERVIEW, OVERVIEW_COLUMNS, overview_rows


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "overview",
        help="per node: events, lost events, chains by severity, verdict",
        description="One line per node: events recorded in the window, events lost, trace "
        "sessions, causal chains by severity and the verdict. --format json gives every "
        "node's full overview (by source, sessions, top ops).",
    )
    add_window(p)
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    add_fleet_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fmt = check_format(args.format)
    asked = ask(args, OVERVIEW)
    if fmt == "json":
        sys.stdout.write(dumps(asked.obj).decode() + "\n")
    else:
        write_rows(OVERVIEW_COLUMNS, overview_rows(asked.obj["nodes"]), fmt, sys.stdout)
    if asked.result is None:
        warn(asked.obj["warnings"])
    return asked.done(args, fmt == "json")
