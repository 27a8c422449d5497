"""``fleetd merge``: node databases copied off air-gapped machines, merged into one file."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TextIO

from fleetd.cli.output import table, warn
from fleetd.cli.progress import EVERY_S, quiet
from fleetd.errors import UsageError
from fleetd.store.clockinfo import boot_groups
from fleetd.store.merge import DEFAULT_CLOCK_THRESHOLD_NS, MergeReport, Progress, merge
from fleetd.store.timeparse import format_ns, parse_duration


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "merge",
        help="merge node databases into one file (offline, for air-gapped clusters)",
        description="Merge fleetd databases copied off several nodes into one file that "
        "every local command (query, explain, ops, export) reads node by node. Inputs are "
        "only read. An existing output is extended; merging a file again adds nothing. The "
        "output appears only when the merge is complete (Ctrl-C leaves it as it was).",
    )
    p.add_argument("inputs", nargs="+", type=Path, metavar="IN.db", help="node databases")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.db",
                   help="merged database (created, or extended when it exists)")
    p.add_argument("--force-node", action="append", default=[], metavar="NAME|IN.db=NAME",
                   help="name the node of an input that has no node identity (one NAME per "
                   "such input, in order), or rename an input's node with IN.db=NAME")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="report progress on stderr (default: yes, a line every 5 s when "
                   "stderr is not a terminal; none with --quiet)")
    p.add_argument("--clock-skew-threshold", dest="clock_threshold",
                   default=f"{DEFAULT_CLOCK_THRESHOLD_NS // 1_000_000}ms",
                   metavar="DURATION", help="warn when node clocks cannot be aligned "
                   "within this (default 10ms)")
    # The name it had before the fleet commands' --clock-skew-threshold; kept working.
    p.add_argument("--clock-threshold", dest="clock_threshold", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    threshold = parse_duration(args.clock_threshold)
    for path in args.inputs:
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"
            raise UsageError(f"merge input '{path}' {what}",
                             "name the node databases copied off each node, e.g. "
                             "fleetd merge gpu-01.db gpu-02.db -o cluster.db")
    # Shown unless --quiet or --no-progress; in a pipe a line each EVERY_S seconds (the
    # progress facility's pace), or each half second with an explicit --progress.
    shown = not quiet() if args.progress is None else args.progress
    pace = 0.5 if args.progress or sys.stderr.isatty() else EVERY_S
    reporter = _ProgressPrinter(sys.stderr, pace) if shown else None
    with _sigterm_as_interrupt():
        report = merge(args.inputs, args.output, args.force_node, progress=reporter,
                       clock_threshold_ns=threshold)
    if reporter is not None:
        reporter.finish()
    _summary(report, sys.stdout)
    warn(report.warnings)
    return 0


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """``kill`` (SIGTERM) cleans up like Ctrl-C: no temporary file is left behind."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _ProgressPrinter:
    """Progress on stderr: rewritten in place on a terminal, else a line at most every
    ``pace`` seconds; the end of each input is always shown."""

    def __init__(self, out: TextIO, pace: float) -> None:
        self.out = out
        self.pace = pace
        self.tty = out.isatty()
        self.last = 0.0
        self.current: Path | None = None

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        fresh = p.path != self.current
        if not fresh and p.stage != "done" and now - self.last < self.pace:
            return
        if fresh:
            self.finish()
            self.current = p.path
        self.last = now
        pct = 100 * p.done // max(1, p.total)
        line = f"merge [{p.index}/{p.inputs}] {p.path.name}: {p.stage} {pct}% ({p.done}/{p.total})"
        self.out.write("\r\x1b[K" + line if self.tty else line + "\n")
        self.out.flush()

    def finish(self) -> None:
        if self.tty and self.current is not None:
            self.out.write("\n")
            self.out.flush()
            self.current = None


def _summary(report: MergeReport, out: TextIO) -> None:
    size = report.output.stat().st_size / 1e6
    out.write(f"merged {len(report.inputs)} input(s) into {report.output} in "
              f"{report.seconds:.1f} s ({size:.1f} MB)\n")
    cols = ["input", "nodes", "new events", "new stacks", "sessions", "chains", "aggregates"]
    rows = [[str(r.path), ", ".join(r.nodes) + (" (named)" if r.forced else ""),
             r.added.get("events", 0), r.added.get("stacks", 0), r.added.get("sessions", 0),
             r.added.get("chains", 0), r.added.get("aggregates", 0)] for r in report.inputs]
    out.write(table(cols, rows))
    # Nodes of one boot read one clock: aligned exactly, whatever each clock's error.
    # (Their sessions are counted in the table above: this one fits 100 columns.)
    shared = boot_groups(report.nodes)
    clocks = [[c.name, _utc(c.first_ns), _utc(c.last_ns), c.describe_error(),
               _one_clock(shared.get(c.name, []))] for c in report.nodes]
    out.write("\n" + table(["node", "first (UTC)", "last (UTC)", "clock", "same boot as"],
                           clocks))


def _utc(ns: int | None) -> str | None:
    """A node's first or last event as the UTC time it is (the column says so)."""
    return None if ns is None else format_ns(ns)


def _one_clock(others: list[str], shown: int = 3) -> str:
    """``node-2, node-3``: the nodes that ran in this node's boot (one clock)."""
    if not others:
        return "-"
    more = f" +{len(others) - shown}" if len(others) > shown else ""
    return f"{', '.join(others[:shown])}{more}"
