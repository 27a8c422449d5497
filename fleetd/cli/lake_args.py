"""``--lake DIR`` for the analysis commands (explain, ops, overview, gpu, stacks, graphs,
collectives): their analyzers run on SQLite, so the lake's partitions in the command's
window are copied into a temporary node database first (docs/scale-out.md)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fleetd.cli.fleet_args import fleet_mode
from fleetd.cli.output import warn
from fleetd.errors import UsageError


def lake_pruning_window(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """--since/--from/--to as ``[first, last]`` wall-clock ns (None: unbounded), for
    pruning a lake's partitions or choosing what to export into one: parsed by the one
    window parser (WindowSpec.bounds), so its errors read as every other command's."""
    from fleetd.analyze.reading.window import WindowSpec

    spec = WindowSpec(args.since or None, args.from_ or None, args.to or None)
    return spec.bounds().inclusive()


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
        warn(materialize(args.lake, path, Pruning(None, since, until)))
        yield path
