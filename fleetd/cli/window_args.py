"""The database and window options of the analysis commands, and the analyzer facade
they open: ``--db``/``--lake`` and ``--since``/``--from``/``--to`` (:func:`add_window`),
with ``--pid``, ``--pod``, ``--per-process`` and the fleet options for explain and ops
(:func:`add_common`). The window is parsed here, once (:func:`window_of`): the
:class:`fleetd.store.bounds.Bounds` a command hands to the analyzer, the fleet client,
an export or a lake."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fleetd.cli.argtypes import positive
from fleetd.cli.fleet_args import add_fleet_args
from fleetd.cli.pod_args import add_pod_args
from fleetd.store.bounds import Bounds
from fleetd.store.db import default_db_path, open_reader

if TYPE_CHECKING:  # the analyzer is imported by the commands that open one
    from fleetd.analyze.facade import Analysis


def add_window(p: argparse.ArgumentParser) -> None:
    """The database and window every analysis command takes."""
    p.add_argument(
        "--db", type=Path, help="database file (default: $FLEETD_DB, else a per-user path)"
    )
    p.add_argument("--since", help="the last 30s, 5m, 2h, 1d (counted back from now)")
    p.add_argument("--from", dest="from_", metavar="TIME", help="from TIME (ISO 8601, epoch)")
    p.add_argument("--to", metavar="TIME", help="up to TIME")
    p.add_argument("--lake", type=Path, metavar="DIR",
                   help="analyze a Parquet lake instead of a database: the window's date "
                   "partitions are copied into a temporary database first "
                   "(docs/scale-out.md)")


def window_of(args: argparse.Namespace) -> Bounds:
    """The window the command's --since/--from/--to give, parsed now (a UsageError
    quoting a bad value)."""
    return Bounds.parse(args.since or None, args.from_ or None, args.to or None)


def add_common(p: argparse.ArgumentParser) -> None:
    """The options explain and ops share."""
    add_window(p)
    p.add_argument("--pid", type=positive("pid"), help="only this process (as the victim)")
    add_pod_args(p)
    p.add_argument("--per-process", action="store_true", help="op statistics per process")
    add_fleet_args(p)


@contextmanager
def open_analysis(args: argparse.Namespace) -> Iterator[tuple[Path, Analysis]]:
    """The database the command names (``--db``, else the default) and the analyzer
    facade over it in the command's window; the connection closes on exit."""
    from fleetd.analyze.facade import Analysis

    bounds = window_of(args)  # a typo in the window first, before any file is opened
    if getattr(args, "lake", None) is not None:
        from fleetd.cli.lake_args import materialized

        with materialized(args, bounds) as copy:
            lake_conn = open_reader(copy)
            try:
                yield args.lake, Analysis.of(lake_conn, bounds)
            finally:
                lake_conn.close()
        return
    path: Path = args.db or default_db_path()
    conn = open_reader(path)
    try:
        yield path, Analysis.of(conn, bounds)
    finally:
        conn.close()

