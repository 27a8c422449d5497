"""``fleetd collectives``: NCCL collective arrival per communicator and rank, of one
database (a multi-rank node or a merged file) or (``--nodes``) of every node, compared in
one clock; the rank the others wait for is named (docs/explain.md, "Collective arrival")."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the types of the local and fleet answers' functions
    from fleetd.analyze.facade import Analysis
    from fleetd.analyze.reading.answers import WindowJson
    from fleetd.fleet.collectives import CollectivesJson
    from fleetd.fleet.fanout import FleetOptions
    from fleetd.fleet.result import FleetResult
    from fleetd.store.bounds import Bounds

from fleetd.cli.argtypes import positive
from fleetd.cli.fleet_args import add_fleet_args
from fleetd.cli.output import FORMATS, check_format, print_notes, write_rows
from fleetd.cli.questions import either
from fleetd.cli.window_args import add_window
from fleetd.errors import UsageError
from fleetd.printable import printable_tree
from fleetd.wire.answers import CollectivesAnswer


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "collectives",
        help="NCCL collectives per rank: who arrives last, and how late",
        description="Match the NCCL collectives of every rank (by communicator hash and "
        "sequence number, else by the torchrun identity) and compare their arrivals in one "
        "clock: per communicator and rank, calls, bytes, failures, the share of collectives "
        "it was last in, and its lateness against the median of the other ranks (p50/p99). "
        "A rank last in most of them, beyond the clock error and by at least 1 ms, is named "
        "the straggler. With --nodes, every agent sends its calls and the clocks are "
        "corrected by the measured skew.",
    )
    add_window(p)
    p.add_argument("--max-rows", type=positive("--max-rows"), metavar="N",
                   help="compare at most the newest N collective calls per node (default: "
                   "1000000 in a local file; 100000 per node with --nodes, at most 200000)")
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    add_fleet_args(p)
    p.set_defaults(func=run)


class CollectivesLocalJson(CollectivesAnswer):
    """``fleetd collectives --db``: the arrival report and the file's window."""

    window: WindowJson
    warnings: list[str]


def run(args: argparse.Namespace) -> int:
    from fleetd.analyze.distributed.collectives import LOCAL_ROWS, MAX_ROWS, ROW_COLUMNS, rows

    fmt = check_format(args.format)

    def local(analysis: Analysis) -> CollectivesLocalJson:
        found = analysis.collectives(max_rows=args.max_rows or LOCAL_ROWS)
        win = analysis.window
        return {**found, "window": win.to_json(), "warnings": list(win.warnings)}

    def fleet_check() -> None:
        if args.max_rows and args.max_rows > MAX_ROWS:
            raise UsageError(f"--max-rows {args.max_rows} is above the agents' limit of "
                             f"{MAX_ROWS}", "narrow the window instead (--since/--from/--to)")

    def fleet(opts: FleetOptions, bounds: Bounds) -> FleetResult[CollectivesJson]:
        from fleetd.fleet.collectives import collectives

        return collectives(opts, bounds, args.max_rows)

    asked = either(args, local, fleet, fleet_check)
    if asked.result is None:
        _write(asked.obj, list(ROW_COLUMNS), rows(asked.obj), fmt)
        print_notes(asked.obj, bool(asked.obj["events"]), fmt)
    else:
        _write(asked.obj, asked.result.columns, asked.result.rows, fmt)
    return asked.done(args, fmt == "json")


def _write(obj: CollectivesLocalJson | CollectivesJson, columns: list[str],
           values: list[list[Any]], fmt: str) -> None:
    if fmt != "table":
        extra = {k: v for k, v in obj.items() if k not in ("columns", "rows")}
        write_rows(columns, values, fmt, sys.stdout, extra)
        return
    obj = printable_tree(obj)  # communicator keys and notes quote what ranks reported
    shown = [c.removesuffix("_ns") for c in columns]
    cells = [[_cell(c, v) for c, v in zip(columns, r, strict=True)] for r in values]
    if cells:
        write_rows(shown, cells, fmt, sys.stdout)
    out = sys.stdout
    for c in obj.get("communicators") or []:
        out.write(f"{c['matching']} {c['key']}: {c['instances']} instance(s), {c['judged']} "
                  f"judged, {c['ambiguous']} ambiguous, {c['incomplete']} incomplete"
                  f"{' (partial: not every rank seen)' if c['partial'] else ''}\n")
        al = c.get("alignment")
        if al:
            out.write(f"  matched by {al['text']}\n")
    out.write(f"verdict: {obj.get('verdict')}\n")
    for note in obj.get("notes") or []:
        out.write(f"note: {note}\n")


def _cell(col: str, value: Any) -> Any:
    """Lateness as a signed duration, the share as a percentage; the rest as is."""
    if value is None:
        return None
    if col.startswith("lateness_") and isinstance(value, int):
        sign = "+" if value > 0 else "-" if value < 0 else ""
        v = abs(value)
        text = (f"{v / 1e9:.2f} s" if v >= 1_000_000_000 else f"{v / 1e6:.2f} ms"
                if v >= 1_000_000 else f"{v / 1e3:.1f} us")
        return sign + text
    if col == "last_share" and isinstance(value, float):
        return f"{value:.0%}"
    if col == "straggler":
        return "YES" if value else ""
    return value
