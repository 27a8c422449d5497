"""``fleetd import``: Nsight Systems and PyTorch profiler traces into a node database."""

from __future__ import annotations

import argparse
from pathlib import Path

from fleetd.cli.output import table, warn
from fleetd.cli.progress import stage


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "import",
        help="import nsys SQLite exports and PyTorch profiler (Kineto) traces",
        description="Read GPU timelines recorded by Nsight Systems ('nsys export --type "
        "sqlite') or the PyTorch profiler (Kineto .json/.json.gz, one file per rank) into a "
        "fleetd database, each file as one session: kernels, copies, sets and annotations "
        "in their own tables, CUDA calls and host events as events. Every file is checked "
        "before anything is written; a file imported before adds nothing.",
    )
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="trace files")
    p.add_argument("--db", type=Path, required=True, help="database to write (created if "
                   "missing)")
    p.add_argument("--node", help="node name for every file (default: the trace's host "
                   "name, or rank-N for a Kineto rank, or the file name)")
    p.add_argument("--format", dest="fmt", default="auto", choices=("auto", "nsys", "kineto"),
                   help="input format (default: auto, from the file's first bytes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.ingest import import_traces

    with stage(f"importing {len(args.files)} file(s) into {args.db}"):
        reports = import_traces(args.files, args.db, args.node, args.fmt)
    rows = []
    for r in reports:
        o = r.outcome
        added = "already imported: nothing added" if o.already else ", ".join(
            f"{k} {v}" for k, v in o.added.items() if v)
        rows.append([str(r.path), r.fmt, o.node, f"{o.node}:{o.session}", added])
    print(table(["file", "format", "node", "session", "added"], rows))
    for r in reports:
        warn(r.warnings, f"{r.path}: ")
    return 0
