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
from fleetd.store.bounds import Bounds


@contextmanager
def materialized(args: argparse.Namespace, bounds: Bounds) -> Iterator[Path]:
    """A temporary database holding the lake's rows in the command's window ``bounds``
    (its date partitions, then its rows: ``[first, last]``)."""
    from fleetd.store.lakesql import Pruning, materialize

    if args.db is not None:
        raise UsageError("--lake and --db do not go together", "analyze one or the other")
    if fleet_mode(args):
        raise UsageError("--lake and --nodes/--config do not go together",
                         "analyze the lake, or ask the live nodes")
    since, until = bounds.inclusive()
    with tempfile.TemporaryDirectory(prefix="fleetd-lake-") as d:
        path = Path(d) / "lake.db"
        warn(materialize(args.lake, path, Pruning(None, since, until)))
        yield path
