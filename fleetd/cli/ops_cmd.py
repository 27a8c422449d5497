"""``fleetd ops``: per-op (and per-process) latency statistics over a window, of one
database or (``--nodes``) of every node, merged with a leading ``node`` column."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TypedDict

from fleetd.cli.output import FORMATS, check_format, table_view, warn, write_rows
from fleetd.cli.pod_args import fleet_selection, selected_pids
from fleetd.cli.questions import either
from fleetd.cli.window_args import add_common

if TYPE_CHECKING:
    from fleetd.analyze.facade import Analysis
    from fleetd.analyze.reading.answers import WindowJson
    from fleetd.analyze.reading.rows import KernelOpRow, OpRow
    from fleetd.fleet.fanout import FleetOptions
    from fleetd.fleet.queries import OpsJson
    from fleetd.fleet.result import FleetResult
    from fleetd.store.bounds import Bounds


class OpsLocalJson(TypedDict):
    """``fleetd ops --db``: the rows' cells under ``columns``, and the window."""

    columns: list[str]
    rows: list[list[Any]]  # each row's values of ``columns`` (OpRow / KernelOpRow)
    window: WindowJson
    warnings: list[str]



def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ops",
        help="per-op latency statistics (count, p50/p95/p99/max, total, errors, calls/s)",
        description="Latency statistics per op (and per process with --per-process). "
        "stats_from says whether they come from stored events (exact) or from the "
        "in-kernel histograms (every call counted; percentiles within a log2 bucket). "
        "With --nodes, every agent's statistics, led by a node column.",
    )
    add_common(p)
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    p.add_argument("--by", choices=("op", "kernel"), default="op",
                   help="one row per op (default) or per launched kernel name (from the "
                   "stored, sampled launches: est_calls scales them to every call)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.analyze.pernode.opstats import COLUMNS, KERNEL_COLUMNS

    fmt = check_format(args.format)
    every: list[str] = list(KERNEL_COLUMNS if args.by == "kernel" else COLUMNS)

    def fleet(opts: FleetOptions, bounds: Bounds) -> FleetResult[OpsJson]:
        from fleetd.fleet.queries import ops

        pod, ns = fleet_selection(args)
        cols = [c for c in every if args.per_process or c not in ("pid", "comm")]
        if pod or ns:
            # Per process, as with --db, and each row's pod beside its process.
            at = every.index("comm") + 1
            cols = [*every[:at], "pod", *every[at:]]
        return ops(opts, bounds, args.pid, args.per_process or bool(pod or ns), cols, args.by,
                   pod, ns)

    def local(analysis: Analysis) -> OpsLocalJson:
        pids = selected_pids(args, analysis.conn)
        # A pod's processes: per process (a total over all cannot be split afterwards).
        per_process = args.per_process or pids is not None
        rows: list[OpRow] | list[KernelOpRow] = (
            analysis.kernel_stats(args.pid, per_process) if args.by == "kernel"
            else analysis.op_stats(args.pid, per_process))
        cols = [c for c in every if per_process or c not in ("pid", "comm")]
        win = analysis.window
        # The cells of ``cols``, the rows' own keys (KERNEL_COLUMNS or COLUMNS).
        return {"columns": cols, "rows": [[r.get(c) for c in cols] for r in rows
                                          if pids is None or r["pid"] in pids],
                "window": win.to_json(), "warnings": list(win.warnings)}

    def fleet_check() -> None:
        fleet_selection(args)  # a --pod mistake is one usage error, not one per node

    asked = either(args, local, fleet, fleet_check)
    got = asked.result
    columns, rows = ((list(got.columns), [list(r) for r in got.rows]) if got is not None
                     else (asked.obj["columns"], asked.obj["rows"]))
    shown, values = table_view(columns, rows, fmt)
    write_rows(shown, values, fmt, sys.stdout,
               {k: v for k, v in asked.obj.items() if k not in ("columns", "rows")})
    if got is None and fmt != "json":
        warnings = asked.obj["warnings"]
        if not rows and not warnings:
            what = "launches with a kernel name" if args.by == "kernel" else "ops"
            print(f"fleetd: warning: no {what} in the window", file=sys.stderr)
        warn(warnings)
    return asked.done(args, fmt == "json")
