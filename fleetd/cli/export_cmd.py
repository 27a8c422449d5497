"""``fleetd export``: a Perfetto / chrome://tracing timeline of one node or many."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fleetd.cli.fleet_args import add_fleet_args, fleet_mode, fleet_options, report
from fleetd.cli.output import warn
from fleetd.cli.progress import stage
from fleetd.errors import UsageError
from fleetd.store.db import default_db_path, open_reader
from fleetd.store.timeparse import parse_duration

if TYPE_CHECKING:
    from collections.abc import Callable

    from fleetd.export.parquet import LakeExport
    from fleetd.export.perfetto import NodeStats, Written

EXPORT_FORMATS = ("perfetto", "parquet")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from fleetd.export.local import CHAIN_MODES

    p = sub.add_parser(
        "export",
        help="export a timeline for ui.perfetto.dev / chrome://tracing",
        description="Write a Chrome Trace Event JSON timeline: one process per node, a "
        "track per traced thread with its CUDA calls and off-CPU time, block I/O and IRQ "
        "tracks, causal chains as markers with arrows from culprit to victim, calls/s "
        "counters. Open the file in ui.perfetto.dev. Works on a node database, a merged "
        "one (fleetd merge), or live agents (--nodes/--config: each node's events streamed "
        "over mTLS, its clock skew corrected).",
    )
    p.add_argument("--format", default="perfetto",
                   help="output format: perfetto (a timeline file), or parquet (-o is a lake "
                   "directory: Hive-partitioned Parquet for DuckDB, Spark, Trino; see "
                   "docs/scale-out.md)")
    p.add_argument("--db", type=Path,
                   help="database file (default: $FLEETD_DB, else a per-user path)")
    p.add_argument("-o", "--output", required=True, metavar="trace.json[.gz]",
                   help="output file (gzip when it ends in .gz; '-' for stdout); with "
                   "--format parquet, the lake directory")
    p.add_argument("--force", action="store_true",
                   help="let -o overwrite an existing timeline file (a lake directory is "
                   "extended, never overwritten)")
    p.add_argument("--since", help="the last 30s, 5m, 2h, 1d (counted back from now)")
    p.add_argument("--from", dest="from_", metavar="TIME", help="from TIME (ISO 8601, epoch)")
    p.add_argument("--to", metavar="TIME", help="up to TIME")
    p.add_argument("--pid", type=int, help="only this process")
    p.add_argument("--limit-per-node", type=int, metavar="N",
                   help="at most N events per node (the first N of the window)")
    p.add_argument("--chains", default="auto", choices=CHAIN_MODES,
                   help="causal chains: stored ones, else computed (auto, default); only "
                   "stored; always computed; or none")
    p.add_argument("--offset", action="append", default=[], metavar="NODE=DURATION",
                   help="shift a node's times by hand, e.g. gpu-02=-3.5ms (repeatable)")
    p.add_argument("--no-clock-correction", dest="no_skew_correct", action="store_true",
                   help="export times as recorded (no interpolation between clock samples; "
                   "with --nodes, no skew correction either)")
    p.add_argument("--no-skew-correct", dest="no_skew_correct", action="store_true",
                   help=argparse.SUPPRESS)  # the fleet commands' old name: the same switch
    add_fleet_args(p, timeout=False, correction=False)
    # An export's events take as long as their size: no deadline on them, a limit on
    # silence instead (docs/merge-export.md).
    p.add_argument("--timeout", metavar="DURATION",
                   help="fleet: the deadline for each node's names, sessions and chains, and "
                   "the longest its events may pause; slower nodes become warnings "
                   "(default: the config's timeout_s, else 10s)")
    p.set_defaults(func=run, local_flags=("no_skew_correct",))


def parse_offsets(specs: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for spec in specs:
        node, eq, text = spec.rpartition("=")
        if not eq or not node:
            raise UsageError(f"invalid --offset {spec!r}", "write NODE=DURATION, e.g. gpu-02=-3ms")
        sign = -1 if text.startswith("-") else 1
        out[node] = sign * parse_duration(text.lstrip("+-"))
    return out


def run(args: argparse.Namespace) -> int:
    if args.format not in EXPORT_FORMATS:
        raise UsageError(f"unknown export format {args.format!r}",
                         f"use one of: {', '.join(EXPORT_FORMATS)}")
    if args.pid is not None and args.pid <= 0:
        raise UsageError(f"invalid --pid {args.pid}", "use a positive process id")
    if args.limit_per_node is not None and args.limit_per_node <= 0:
        raise UsageError(f"invalid --limit-per-node {args.limit_per_node}",
                         "use a positive number of events")
    if args.format == "parquet":
        return run_parquet(args)
    out = None if args.output == "-" else Path(args.output)
    if out is not None and out.exists() and not args.force:
        raise UsageError(f"{str(out)!r} exists",
                         "pass --force to overwrite it, or write elsewhere with -o")
    if fleet_mode(args):
        return run_fleet(args, out)
    if args.timeout:
        raise UsageError(f"--timeout {args.timeout!r} only applies to live nodes",
                         "add --nodes HOST:PORT,... (or --config), or drop --timeout")
    from fleetd.export.perfetto import Written

    written = Written()
    with stage(f"exporting {args.db or 'the database'}", count=_count(written)):
        stats, warnings = export_db(args, out, written)
    _wrote(out, stats)
    warn(warnings)
    return 0


def run_fleet(args: argparse.Namespace, out: Path | None) -> int:
    """Export live agents; exit 3 when some nodes are missing from the file."""
    from fleetd.cli.window_args import window_of
    from fleetd.export.fleet import FleetExportOptions, export_fleet

    offsets = parse_offsets(args.offset)  # every flag checked before any node is asked
    xopts = FleetExportOptions(window_of(args), args.pid,
                               args.limit_per_node, args.chains, not args.no_skew_correct,
                               offsets)
    from fleetd.export.perfetto import Written

    written = Written()
    with stage("exporting the fleet's timelines", count=_count(written)):
        done = export_fleet(fleet_options(args), xopts, out, written)
    _wrote(out, done.stats)
    report(done.answer, args.show_skew)
    warn(done.warnings)
    return done.answer.exit_code


def _wrote(out: Path | None, stats: list[NodeStats]) -> None:
    events = sum(s.events for s in stats)
    where = "stdout" if out is None else str(out)
    size = f" ({out.stat().st_size / 1e6:.1f} MB)" if out is not None else ""
    print(f"wrote {where}{size}: {len(stats)} node(s), {events} events, "
          f"{sum(s.chains for s in stats)} chain(s), {sum(s.flows for s in stats)} arrow(s); "
          "open it in https://ui.perfetto.dev", file=sys.stderr if out is None else sys.stdout)


def _count(written: Written) -> Callable[[], str]:
    return lambda: f"{written.events:,} trace events written"


def export_db(args: argparse.Namespace, out: Path | None, written: Written | None = None
              ) -> tuple[list[NodeStats], list[str]]:
    """Export the database named by ``--db`` (or the default one)."""
    from fleetd.analyze.reading.window import resolve
    from fleetd.cli.window_args import window_of
    from fleetd.export.local import LocalOptions, local_traces
    from fleetd.export.output import open_output
    from fleetd.export.perfetto import write_trace

    path: Path = args.db or default_db_path()
    conn = open_reader(path)
    try:
        window = resolve(conn, window_of(args))
        opts = LocalOptions(window, args.pid, args.limit_per_node, args.chains,
                            not args.no_skew_correct, parse_offsets(args.offset))
        traces, origin, warnings = local_traces(conn, opts)
        meta = {"source": str(path.name), "window": window.to_json()}
        with open_output(out) as stream:
            stats = write_trace(traces, stream, origin_ns=origin, meta=meta, written=written)
    finally:
        conn.close()
    return stats, warnings


def run_parquet(args: argparse.Namespace) -> int:
    """``--format parquet``: the database (or the live nodes) into the lake at -o DIR."""
    for flag, value in (("--pid", args.pid), ("--limit-per-node", args.limit_per_node),
                        ("--offset", args.offset or None)):
        if value is not None:
            raise UsageError(f"{flag} does not apply to --format parquet",
                             "the lake keeps every event; filter when you query it "
                             "(fleetd query --lake DIR \"SELECT ... WHERE pid = ...\")")
    if args.output == "-":
        raise UsageError("--format parquet writes a directory, not stdout",
                         "pass -o DIR (a new directory, or a lake written before)")
    root = Path(args.output)
    from fleetd.cli.window_args import window_of

    since, until = window_of(args).inclusive()
    if fleet_mode(args):
        from fleetd.export.parquet import export_fleet_lake

        with stage(f"exporting the fleet into {root}"):
            done, answer = export_fleet_lake(fleet_options(args), root, since_ns=since,
                                             until_ns=until, correct=not args.no_skew_correct)
        _wrote_lake(done)
        report(answer, args.show_skew)
        return answer.exit_code
    if args.timeout:
        raise UsageError(f"--timeout {args.timeout!r} only applies to live nodes",
                         "add --nodes HOST:PORT,... (or --config), or drop --timeout")
    from fleetd.export.parquet import export_lake

    path: Path = args.db or default_db_path()
    conn = open_reader(path)
    try:
        with stage(f"exporting {path} into {root}"):
            done = export_lake(conn, root, since_ns=since, until_ns=until,
                               correct=not args.no_skew_correct)
    finally:
        conn.close()
    _wrote_lake(done)
    return 0


def _wrote_lake(done: LakeExport) -> None:
    tables = sorted({t for per in done.rows.values() for t in per})
    counts = ", ".join(f"{t} {sum(p.get(t, 0) for p in done.rows.values()):,}" for t in tables)
    print(f"wrote lake {done.root}: {len(done.rows)} node(s); rows: {counts or 'none'}")
    warn(done.warnings)
