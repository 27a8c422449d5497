"""``--lake DIR`` for the analysis commands (explain, ops, overview, gpu, stacks, graphs,
collectives): their analyzers run on SQLite, so the lake's partitions in the command's
window are copied into a temporary node database first (docs/scale-out.md)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fleetd.cli.fleet_args import fleet_mode
from fleetd.errors import UsageError
from fleetd.store.timeparse import parse_duration, parse_timestamp


def lake_pruning_window(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """--since/--from/--to as absolute wall-clock ns (None: unbounded), for pruning a
    lake's partitions or choosing what to export into one."""
    since = time.time_ns() - parse_duration(args.since) if args.since else None
    if args.from_:
        since = parse_timestamp(args.from_)
    until = parse_timestamp(args.to) if args.to else None
    if since is not None and until is not None and since > until:
        raise UsageError(f"--from {args.from_!r} is later than --to {args.to!r}",
                         "swap the two times: the window runs from --from to --to")
    return since, until


@contextmanager
def materialized(args: argparse.Namespace) -> Iterator[Path]:
    """A temporary database holding the lake's rows of the command's window."""
    from fleetd.store.lakesql import Pruning, materialize

    if args.db is not None:
        raise UsageError("--lake and --db do not go together", "analyze one or the other")
    if fleet_mode(args):
        raise UsageError("--lake and --nodes/--config do not go together",
                         "analyze the lake, or ask the live nodes")
    since, until = lake_pruning_window(args)
    with tempfile.TemporaryDirectory(prefix="fleetd-lake-") as d:
        path = Path(d) / "lake.db"
        for w in materialize(args.lake, path, Pruning(None, since, until)):
            print(f"fleetd: warning: {w}", file=sys.stderr)
        yield path
