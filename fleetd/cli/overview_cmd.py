"""``fleetd overview``: per node, how much was recorded, what was lost, how many chains of
each severity and the verdict; of one database or (``--nodes``) of the whole fleet."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fleetd.cli.fleet_args import add_fleet_args, fleet_mode, fleet_options, report
from fleetd.cli.output import FORMATS, check_format, dumps, write_rows


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "overview",
        help="per node: events, lost events, chains by severity, verdict",
        description="One line per node: events recorded in the window, events lost, trace "
        "sessions, causal chains by severity and the verdict. --format json gives every "
        "node's full overview (by source, sessions, top ops).",
    )
    p.add_argument(
        "--db", type=Path, help="database file (default: $FLEETD_DB, else a per-user path)"
    )
    p.add_argument("--since", help="the last 30s, 5m, 2h, 1d (counted back from now)")
    p.add_argument("--from", dest="from_", metavar="TIME", help="from TIME (ISO 8601, epoch)")
    p.add_argument("--to", metavar="TIME", help="up to TIME")
    p.add_argument("--lake", type=Path, metavar="DIR",
                   help="analyze a Parquet lake (its window copied into a temporary "
                   "database first; docs/scale-out.md)")
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    add_fleet_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.fleet.queries import OVERVIEW_COLUMNS, overview_rows

    fmt = check_format(args.format)
    if fleet_mode(args):
        return run_fleet(args, fmt)
    nodes, warnings = local(args)
    if fmt == "json":
        sys.stdout.write(dumps({"nodes": nodes, "warnings": warnings, "skew": {}}).decode()
                         + "\n")
        return 0
    write_rows(OVERVIEW_COLUMNS, overview_rows(nodes), fmt, sys.stdout)
    for w in warnings:
        print(f"fleetd: warning: {w}", file=sys.stderr)
    return 0


def local(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    from fleetd.cli.explain_cmd import open_analysis

    with open_analysis(args) as (_, analysis):
        found = [analysis.overview(name) for name in analysis.node_names()]
    win = analysis.window
    for f in found:
        f.pop("warnings", None)  # the window's warnings, said once below
    return found, list(win.warnings)


def run_fleet(args: argparse.Namespace, fmt: str) -> int:
    from fleetd.analyze.window import WindowSpec
    from fleetd.fleet.queries import overview

    result = overview(fleet_options(args), WindowSpec(args.since, args.from_, args.to))
    if fmt == "json":
        sys.stdout.write(dumps(result.obj).decode() + "\n")
    else:
        write_rows(result.columns, result.rows, fmt, sys.stdout)
    if fmt != "json" or args.show_skew:
        report(result.answer, args.show_skew)
    return result.exit_code
