"""``fleetd explain``: causal chains (most severe first), their evidence and fixes, then
where each traced thread's time went.

Reading is read-only; ``--store`` writes the chains into the database afterwards (a
chain whose key exists gets the next version, so history is kept).

``--format html`` draws the same report as one self-contained page
(fleetd/export/html.py); ``-o FILE`` writes any format to a file, never over an existing
one without ``--force``.

With ``--nodes``/``--config`` every agent analyzes its own data over the same window,
in parallel; chains come back tagged with their node, and each node's profile is
scored against the fleet's to rank stragglers (fleetd/analyze/distributed/stragglers.py). A database
holding several nodes (``fleetd merge``) gets the same ranking offline.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fleetd.cli.explain_render import render, render_fleet
from fleetd.cli.fleet_args import fleet_mode, fleet_options, report
from fleetd.cli.outfile import add_output_args, output_path
from fleetd.cli.output import Held, dumps, warn
from fleetd.cli.pod_args import fleet_selection, selected_pids
from fleetd.cli.progress import Progress, task
from fleetd.cli.window_args import add_common, open_analysis, window_of
from fleetd.errors import UsageError
from fleetd.store.bounds import Bounds
from fleetd.wire.answers import ChainJson, ExplainReport

if TYPE_CHECKING:  # the command loads it only when it runs: `fleetd --version` stays quick
    from fleetd.analyze.facade import Analysis
    from fleetd.fleet.queries import ExplainJson, ExplainPage

EXPLAIN_FORMATS = ("table", "json", "html")
FAIL_ON = ("HIGH", "MEDIUM", "LOW")  # worst first
FOUND_EXIT = 5  # explain --fail-on: such a chain exists (docs/cli.md, exit status)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "explain",
        help="explain GPU latency: causal chains, culprits, fixes",
        description="Find CUDA calls slower than usual, tie each to the host events that "
        "overlapped it on its thread (preemption, run-queue and D-state waits, IRQs, block "
        "I/O), name the culprit process and a fix; then show where each traced thread's "
        "time went. Without --since/--from/--to the whole recording is analyzed. With "
        "--nodes, every agent analyzes its own data and the nodes are ranked as stragglers "
        "(slowest first, each with its own chains as the why); a database holding several "
        "nodes is ranked the same way.",
    )
    add_common(p)
    p.add_argument("--format", default="table",
                   help="output format: table|json|html (html: one self-contained page "
                   "with charts, for a browser; docs/explain.md)")
    add_output_args(p, "the report")
    p.add_argument("--store", action="store_true",
                   help="also store the chains in the database (kept with history)")
    p.add_argument("--fail-on", type=str.upper, choices=FAIL_ON, metavar="SEVERITY",
                   help="exit with status 5 when a chain of this severity or worse is "
                   "found (HIGH, MEDIUM or LOW), for CI and cron")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.analyze.explain import store_chains

    if args.format not in EXPLAIN_FORMATS:
        raise UsageError(f"unknown format {args.format!r}",
                         f"use one of: {', '.join(EXPLAIN_FORMATS)}")
    args.output_path = output_path(args)  # refused before any work is done for it
    if fleet_mode(args):
        return run_fleet(args)
    where = args.lake if getattr(args, "lake", None) is not None else args.db
    with task(f"explaining {where or 'the database'}") as shown:
        with open_analysis(args) as (path, analysis):
            # A --db file can be read again by a forked child (a lake's copy is not kept).
            lake = getattr(args, "lake", None) is not None
            found = _analyse(args, analysis, shown, None if lake else path)
        if args.store and found["chains"]:
            shown.step("storing the chains")
            found["stored"] = store_chains(path, found)
        shown.step("rendering")
        # Rendered whole before it is written: the live progress line (stderr) is gone
        # before the first line of the report reaches the terminal.
        buf = Held(sys.stdout if args.output_path is None else None)
        _render(args, found, buf)
    emit(args, found, lambda out: out.write(buf.getvalue()))
    if args.format == "table":
        warn(found["warnings"])
    return failed(args, found["chains"], 0)


def _analyse(args: argparse.Namespace, analysis: Analysis, shown: Progress,
             path: Path | None) -> ExplainReport:
    """The local report, step by step on the progress line: the events read once
    (names, op statistics, the per-thread breakdown; the last two at once on two CPUs,
    ``path`` opened again by a child), the chains, then the GPU verdict, collectives and
    the straggler ranking."""
    from fleetd.analyze.pernode.preload import preload
    from fleetd.store.db import open_reader

    shown.step("reading")
    preload(analysis.slices, None if path is None else lambda: open_reader(path))
    pids = selected_pids(args, analysis.conn)
    shown.step("chains")
    found = analysis.explain(args.pid, args.per_process, pids)
    shown.step("analysing")
    _no_such_pid(found, args.pid)
    _gpu_verdict(found, analysis, args.pid)
    # NCCL collectives of several ranks: the rank the others wait for leads.
    found["collectives"] = analysis.collectives()
    if len(found["nodes"]) > 1 or found["collectives"]["stragglers"]:
        # A merged file: rank its nodes the way the fleet client ranks live ones.
        found["stragglers"] = analysis.stragglers(found["chains"], found["collectives"])
        found["skew"] = {}  # one file, one clock per node as recorded
    return found


def _render(args: argparse.Namespace, found: ExplainReport, out: TextIO) -> None:
    if args.format == "json":
        out.write(dumps(found).decode() + "\n")
    elif args.format == "html":
        write_html(found, out)
    elif "stragglers" in found:
        render_fleet(found, out)
    else:
        # -v (more log output everywhere) also prints slow calls' whole stacks.
        render(found, out, verbose=bool(getattr(args, "verbose", 0)))


def _gpu_verdict(found: ExplainReport, analysis: Analysis, pid: int | None) -> None:
    """An imported GPU timeline's verdict, the one ``fleetd gpu`` prints, joins the
    report (``gpu``) and leads the verdict when it finds host overhead: one answer for
    one file, whichever command is asked."""
    ranks = analysis.gpu(pid).get("ranks") or []
    if not ranks:
        return
    found["gpu"] = [{"node": r["node"], "pid": r["pid"], "rank": r.get("rank"),
                     "host_overhead": r["verdict"]["host_overhead"],
                     "summary": r["summary"], "idle_pct": r.get("idle_pct"),
                     "compute_pct": r.get("compute_pct"), "comm_pct": r.get("comm_pct"),
                     "memcpy_pct": r.get("memcpy_pct"),
                     "metrics": r["verdict"].get("metrics"),
                     "thresholds": r["verdict"].get("thresholds")} for r in ranks]
    bound = [g for g in found["gpu"] if g["host_overhead"] == "YES"]
    if bound and str(found["verdict"]).startswith("quiet"):
        g = bound[0]
        found["verdict"] = (f"GPU timeline of {g['node']} pid {g['pid']}: {g['summary']} "
                            f"(fleetd gpu); the host side: {found['verdict']}")


def emit(args: argparse.Namespace, found: Mapping[str, Any],
         write: Callable[[TextIO], object]) -> None:
    """``write`` the report to stdout, or to the ``-o`` file: whole or not at all (a
    temporary file beside it, renamed when complete, as ``fleetd export`` does)."""
    path: Path | None = args.output_path
    if path is None:
        write(sys.stdout)
        return
    from fleetd.export.output import open_output

    buf = io.StringIO()
    write(buf)
    data = buf.getvalue().encode()
    with open_output(path) as sink:
        sink.write(data)
    ranked = sum(1 for s in found.get("stragglers") or [] if s.get("flagged") is True)
    hint = "; open it in a browser" if args.format == "html" else ""
    print(f"wrote {path} ({len(data) / 1e3:.1f} kB): {len(found.get('nodes') or [])} "
          f"node(s), {len(found.get('chains') or [])} chain(s), {ranked} straggler(s)"
          f"{hint}")


def write_html(found: Mapping[str, Any], out: TextIO) -> None:
    from fleetd.export.html import write_report

    write_report(found, out)


def failed(args: argparse.Namespace, chains: Sequence[ChainJson], code: int) -> int:
    """``code``, or :data:`FOUND_EXIT` when --fail-on names a severity some chain has
    (or a worse one); said on stderr so that a cron mail tells why."""
    if not args.fail_on:
        return code
    worst = FAIL_ON[: FAIL_ON.index(args.fail_on) + 1]
    hits = [c for c in chains if c.get("severity") in worst]
    if not hits:
        return code
    print(f"fleetd: {len(hits)} chain(s) at {args.fail_on} or worse (--fail-on "
          f"{args.fail_on})", file=sys.stderr)
    return FOUND_EXIT if code == 0 else code


def _no_such_pid(found: ExplainReport, pid: int | None) -> None:
    """--pid of a process the window holds nothing of is not a quiet process: say so,
    in the verdict and as a warning, rather than "quiet"."""
    if pid is None or found["processes"] or found["ops"] or found["chains"]:
        return
    found["verdict"] = f"no events for pid {pid} in the window"
    found["warnings"].append(f"no events for pid {pid} in the window; list the traced "
                             "processes with: fleetd query \"SELECT DISTINCT pid, comm FROM "
                             "events\"")


def run_fleet(args: argparse.Namespace) -> int:
    from fleetd.fleet.queries import explain

    if args.store:
        raise UsageError("--store writes into a local database",
                         "drop --store, or run explain --store --db on the node")
    pod, ns = fleet_selection(args)
    bounds = window_of(args)
    result = explain(fleet_options(args), bounds, args.pid, pod, ns)
    found = result.obj
    if args.format == "json":
        emit(args, found, lambda out: out.write(dumps(found).decode() + "\n"))
        if args.show_skew:
            report(result.answer, True)
    elif args.format == "html":
        found = fleet_ops(args, bounds, found)  # the histograms' rows
        emit(args, found, lambda out: write_html(found, out))
        report(result.answer, args.show_skew)
    else:
        emit(args, found, lambda out: render_fleet(found, out))
        report(result.answer, args.show_skew)
    return failed(args, found.get("chains") or [], result.exit_code)


def fleet_ops(args: argparse.Namespace, bounds: Bounds, found: ExplainJson
              ) -> ExplainPage | ExplainJson:
    """``found`` with every node's op statistics (as ``fleetd ops --nodes`` asks them)
    as its ``ops`` rows, for the page's histograms. Nodes that do not answer them are
    warnings, never a failed report."""
    from fleetd.analyze.pernode.opstats import COLUMNS
    from fleetd.errors import FleetdError
    from fleetd.fleet.queries import ops

    warnings = list(found.get("warnings") or [])
    try:
        result = ops(fleet_options(args), bounds, args.pid, False,
                     [c for c in COLUMNS if c not in ("pid", "comm")], "op",
                     *fleet_selection(args))
    except FleetdError as exc:
        warnings.append({"node": "", "kind": "ops", "error": f"no op statistics: {exc}"})
        unchanged: ExplainJson = {**found, "warnings": warnings}  # no ops rows
        return unchanged
    cols = list(result.columns)
    rows = [dict(zip(cols, r, strict=True)) for r in result.rows]
    seen = {(w.get("node"), w.get("kind")) for w in warnings if isinstance(w, dict)}
    warnings += [w.to_json() for w in result.answer.warnings
                 if (w.node, w.kind) not in seen]
    return {**found, "ops": rows, "warnings": warnings}
