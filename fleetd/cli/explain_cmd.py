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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from fleetd.analyze.distributed.collectives import host_chains
from fleetd.analyze.facade import Analysis
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.window import WindowSpec
from fleetd.cli.fleet_args import add_fleet_args, fleet_mode, fleet_options, report
from fleetd.cli.outfile import add_output_args, output_path
from fleetd.cli.output import SEVERITY_STYLE, Held, colour_wanted, dumps, paint, table, warn
from fleetd.cli.pod_args import add_pod_args, fleet_selection, selected_pids
from fleetd.cli.progress import Progress, task
from fleetd.errors import UsageError
from fleetd.printable import printable_tree
from fleetd.store.db import default_db_path, open_reader
from fleetd.store.timeparse import format_ns

EXPLAIN_FORMATS = ("table", "json", "html")
FAIL_ON = ("HIGH", "MEDIUM", "LOW")  # worst first
FOUND_EXIT = 5  # explain --fail-on: such a chain exists (docs/cli.md, exit status)
# The per-thread columns, adding up to the wall time: sleeps split by wait reason.
BREAKDOWN_KEYS = ("running_ns", "runq_ns", "irq_ns", "d_state_ns", "lock_ns", "data_ns",
                  "timer_ns", "gpu_sync_ns", "other_ns")


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


def add_common(p: argparse.ArgumentParser) -> None:
    """The options explain and ops share."""
    add_window(p)
    p.add_argument("--pid", type=positive("pid"), help="only this process (as the victim)")
    add_pod_args(p)
    p.add_argument("--per-process", action="store_true", help="op statistics per process")
    add_fleet_args(p)


def positive(name: str) -> Callable[[str], int]:
    """An argparse type for a positive integer whose error names the option."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value <= 0:
            raise argparse.ArgumentTypeError(f"invalid {name} {text!r}: use a positive "
                                             "integer")
        return value

    return parse


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


@contextmanager
def open_analysis(args: argparse.Namespace) -> Iterator[tuple[Path, Analysis]]:
    """The database the command names (``--db``, else the default) and the analyzer
    facade over it in the command's window; the connection closes on exit."""
    if getattr(args, "lake", None) is not None:
        from fleetd.cli.lake_args import materialized

        with materialized(args) as copy:
            lake_conn = open_reader(copy)
            try:
                yield args.lake, Analysis.of(lake_conn,
                                             WindowSpec(args.since, args.from_, args.to))
            finally:
                lake_conn.close()
        return
    path: Path = args.db or default_db_path()
    conn = open_reader(path)
    try:
        yield path, Analysis.of(conn, WindowSpec(args.since, args.from_, args.to))
    finally:
        conn.close()


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
            found = _analyse(args, analysis, shown)
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


def _analyse(args: argparse.Namespace, analysis: Analysis, shown: Progress) -> dict[str, Any]:
    """The local report, step by step on the progress line: the events read once
    (names, op statistics, the per-thread breakdown), the chains, then the GPU verdict,
    collectives and the straggler ranking."""
    shown.step("reading")
    for sl in analysis.slices:
        sl.preload()
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


def _render(args: argparse.Namespace, found: dict[str, Any], out: TextIO) -> None:
    if args.format == "json":
        out.write(dumps(found).decode() + "\n")
    elif args.format == "html":
        write_html(found, out)
    elif "stragglers" in found:
        render_fleet(found, out)
    else:
        # -v (more log output everywhere) also prints slow calls' whole stacks.
        render(found, out, verbose=bool(getattr(args, "verbose", 0)))


# The GPU time shares an explain report carries per rank (the HTML report draws them).
GPU_SHARES = ("idle_pct", "compute_pct", "comm_pct", "memcpy_pct")

def _gpu_verdict(found: dict[str, Any], analysis: Analysis, pid: int | None) -> None:
    """An imported GPU timeline's verdict, the one ``fleetd gpu`` prints, joins the
    report (``gpu``) and leads the verdict when it finds host overhead: one answer for
    one file, whichever command is asked."""
    ranks = analysis.gpu(pid).get("ranks") or []
    if not ranks:
        return
    found["gpu"] = [{"node": r["node"], "pid": r["pid"], "rank": r.get("rank"),
                     "host_overhead": r["verdict"]["host_overhead"],
                     "summary": r["summary"],
                     **{k: r.get(k) for k in GPU_SHARES},
                     "metrics": r["verdict"].get("metrics"),
                     "thresholds": r["verdict"].get("thresholds")} for r in ranks]
    bound = [g for g in found["gpu"] if g["host_overhead"] == "YES"]
    if bound and str(found["verdict"]).startswith("quiet"):
        g = bound[0]
        found["verdict"] = (f"GPU timeline of {g['node']} pid {g['pid']}: {g['summary']} "
                            f"(fleetd gpu); the host side: {found['verdict']}")


def emit(args: argparse.Namespace, found: dict[str, Any],
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


def write_html(found: dict[str, Any], out: TextIO) -> None:
    from fleetd.export.html import write_report

    write_report(found, out)


def failed(args: argparse.Namespace, chains: list[dict[str, Any]], code: int) -> int:
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


def _no_such_pid(found: dict[str, Any], pid: int | None) -> None:
    """--pid of a process the window holds nothing of is not a quiet process: say so,
    in the verdict and as a warning, rather than "quiet"."""
    if pid is None or found["processes"] or found["ops"] or found["chains"]:
        return
    found["verdict"] = f"no events for pid {pid} in the window"
    found["warnings"].append(f"no events for pid {pid} in the window; list the traced "
                             "processes with: fleetd query \"SELECT DISTINCT pid, comm FROM "
                             "events\"")


def run_fleet(args: argparse.Namespace) -> int:
    from fleetd.analyze.reading.window import WindowSpec
    from fleetd.fleet.queries import explain

    if args.store:
        raise UsageError("--store writes into a local database",
                         "drop --store, or run explain --store --db on the node")
    pod, ns = fleet_selection(args)
    window = WindowSpec(args.since, args.from_, args.to)
    result = explain(fleet_options(args), window, args.pid, pod, ns)
    found = result.obj
    if args.format == "json":
        emit(args, found, lambda out: out.write(dumps(found).decode() + "\n"))
        if args.show_skew:
            report(result.answer, True)
    elif args.format == "html":
        found = fleet_ops(args, window, found)  # the histograms' rows
        emit(args, found, lambda out: write_html(found, out))
        report(result.answer, args.show_skew)
    else:
        emit(args, found, lambda out: render_fleet(found, out))
        report(result.answer, args.show_skew)
    return failed(args, found.get("chains") or [], result.exit_code)


def fleet_ops(args: argparse.Namespace, window: WindowSpec,
              found: dict[str, Any]) -> dict[str, Any]:
    """``found`` with every node's op statistics (as ``fleetd ops --nodes`` asks them)
    as its ``ops`` rows, for the page's histograms. Nodes that do not answer them are
    warnings, never a failed report."""
    from fleetd.analyze.pernode.opstats import COLUMNS
    from fleetd.errors import FleetdError
    from fleetd.fleet.queries import ops

    warnings = list(found.get("warnings") or [])
    try:
        result = ops(fleet_options(args), window, args.pid, False,
                     [c for c in COLUMNS if c not in ("pid", "comm")], "op",
                     *fleet_selection(args))
    except FleetdError as exc:
        warnings.append({"node": "", "kind": "ops", "error": f"no op statistics: {exc}"})
        return {**found, "warnings": warnings}
    cols = list(result.columns)
    rows = [dict(zip(cols, r, strict=True)) for r in result.rows]
    seen = {(w.get("node"), w.get("kind")) for w in warnings if isinstance(w, dict)}
    warnings += [w.to_json() for w in result.answer.warnings
                 if (w.node, w.kind) not in seen]
    return {**found, "ops": rows, "warnings": warnings}


# ---- table rendering ------------------------------------------------------------------


def _dur(ns: int | None) -> str:
    if ns is None:
        return "-"
    if ns >= 1_000_000_000:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"


def render(report: dict[str, Any], out: TextIO, *, verbose: bool = False) -> None:
    """The report as text. Every string in it is made printable first: names a traced
    process chose (comm, threads, pod, Python frames) are quoted in summaries,
    evidence and fixes, and one with a newline must not start a line of its own."""
    report = printable_tree(report)
    w = report["window"]
    out.write(f"fleetd explain: {', '.join(report['nodes']) or '(no nodes)'}; {w['label']} "
              f"({w['start']} .. {w['end']})\n")
    out.write(f"verdict: {report['verdict']}\n")
    _collectives(report, out)
    shown = [c for c in report["chains"] if c["severity"] != "LOW"] or report["chains"][:3]
    for c in shown:
        _chain(c, out, verbose=verbose)
    hidden = len(report["chains"]) - len(shown)
    if hidden:
        out.write(f"\n({hidden} LOW chain(s) not shown; --format json lists them all)\n")
    _processes(report["processes"], out)


def render_fleet(report: dict[str, Any], out: TextIO) -> None:
    """Stragglers first, each with its own top chains as the why; then every node's
    chains, most severe first, each tagged with its node (made printable first, as in
    :func:`render`)."""
    report = printable_tree(report)
    label = report["window"].get("label", "")
    names = report.get("nodes") or []
    out.write(f"fleetd explain: {len(names)} node(s) ({', '.join(names) or 'none'}); "
              f"{label}\n")
    ranked = report.get("stragglers") or []
    _stragglers(ranked, out)
    _collectives(report, out)
    verdicts = report.get("verdicts")
    if verdicts:
        for node, verdict in verdicts.items():
            out.write(f"  {node}: {verdict}\n")
    shown: set[str] = set()
    # The processes' pods (analyze.pods), to name a straggler rank's pod with it.
    placed = {(p["node"], p["pid"]): p for p in report.get("processes") or []}
    for s in (s for s in ranked if s["flagged"]):
        if s.get("metric") == "collective_arrival":
            # A rank named by collective arrival: its node's host chains say why.
            who = (f" ({s['comm']})" if s.get("comm") else "") + \
                pods.label(placed.get((s["node"], s.get("pid")), {}))
            out.write(f"\nSTRAGGLER rank {s['rank']} on {s['node']}, pid {s['pid']}{who}: "
                      f"last in {s['share_last']:.0%} of {s['judged']} collectives, median "
                      f"{_dur(s['lateness_p50_ns'])} late\n  {s['reason']}\n"
                      "  why (its node's top host chains):\n")
            theirs = host_chains(s["node"], s["pid"], report["chains"], s.get("peers") or ())
        else:
            out.write(f"\nSTRAGGLER {s['node']}: score {s['score']:.2f} on {s['metric']}\n"
                      f"  {s['reason']}\n  why (its top chains):\n")
            theirs = [c for c in report["chains"] if c["node"] == s["node"]]
        mine = [c for c in theirs if c["severity"] != "LOW"][:TOP_CHAINS] or theirs[:1]
        for c in mine:
            _chain(c, out, tag=True)
            shown.add(c["id"])
        if not mine:
            out.write("  (no chain: no host-side cause found on it)\n")
        _processes([p for p in report.get("processes", []) if p["node"] == s["node"]
                    and (s.get("rank") is None or p["pid"] == s.get("pid"))], out)
    rest = [c for c in report["chains"] if c["id"] not in shown]
    worth = [c for c in rest if c["severity"] != "LOW"]
    other = "other " if shown else ""
    out.write(f"\n{other}chains from every node, most severe first:\n" if worth
              else f"\nno HIGH or MEDIUM chain on any {other}node\n")
    for c in worth:
        _chain(c, out, tag=True)
    hidden = len(rest) - len(worth)
    if hidden:
        out.write(f"\n({hidden} LOW chain(s) not shown; --format json lists them all)\n")
    if report.get("selected"):
        # --pod / --namespace: the selected processes of every node, with their pods.
        procs = report.get("processes") or []
        if procs:
            _processes(procs, out)
        else:
            out.write(f"\nno process of {_selection(report['selected'])} on any node\n")


def _selection(selected: dict[str, str]) -> str:
    return " and ".join(f"{k} {v}" for k, v in selected.items())


TOP_CHAINS = 3


def _collectives(report: dict[str, Any], out: TextIO) -> None:
    """One line on collective arrival when NCCL collectives were recorded, and its notes."""
    found = report.get("collectives") or {}
    if not found.get("events"):
        return
    out.write(f"\ncollective arrival ({found.get('matching') or 'no'} matching): "
              f"{found['verdict']}\n")
    for note in found.get("notes") or []:
        out.write(f"  note: {note}\n")


def _stragglers(ranked: list[dict[str, Any]], out: TextIO) -> None:
    if not ranked:
        return
    rows = [[s["node"] + (f" rank {s['rank']}" if s.get("rank") is not None else ""),
             "" if s["score"] is None else f"{s['score']:.2f}",
             {True: "YES", False: "no", None: "-"}[s["flagged"]], s["metric"] or "",
             s["reason"]] for s in ranked]
    out.write("\nstragglers (score: speed relative to the best node on the metric, or for "
              "collective_arrival 1 - the share of collectives the rank was last in; flagged "
              "when far outside the fleet's spread, see docs/fleet.md and docs/explain.md):\n")
    out.write(table(["node", "score", "flagged", "metric", "reason"], rows))


def _chain(c: dict[str, Any], out: TextIO, tag: bool = False, *, verbose: bool = False
           ) -> None:
    where = f" on {c['node']}" if tag else ""
    sev = f"[{c['severity']}]"
    if colour_wanted(out):  # a terminal: the severity in its colour, as tables show it
        sev = paint(sev, SEVERITY_STYLE.get(str(c["severity"]), ""))
    out.write(f"\n{sev} {c['root_cause']}{where}  {c['id']}\n  {c['summary']}\n")
    v = c["victim"]
    out.write(f"  victim:  {v['comm']} pid {v['pid']} tid {v['tid']}{pods.label(v)}\n")
    if c["culprit"]:
        cu = c["culprit"]
        share = c["culprits"][0].get("share") if c.get("culprits") else None
        thread = (f" thread {cu['thread'] or '?'} tid {cu['tid']}"
                  if cu.get("tid") is not None and cu["tid"] != cu["pid"] else "")
        out.write(f"  culprit: {cu['comm']} pid {cu['pid']}{thread}{pods.label(cu)}"
                  f"{' (the victim process itself)' if cu.get('self') else ''}"
                  f"{f', {share:.0%} of the attributed time' if share is not None else ''}\n")
    d = c.get("detail") or {}
    if c["root_cause"] == "nccl_failures" and "calls" in d:  # a share of calls, not of time
        out.write(f"  {d['failed']} of {d['calls']} NCCL calls failed\n  evidence:\n")
    else:
        out.write(f"  explained {c['explained']:.0%} of the extra time; "
                  f"impact {c['impact']:.1%} of wall time\n  evidence:\n")
    for e in c["evidence"]:
        when = format_ns(e["ts_ns"])[11:] if "ts_ns" in e else ""
        indent = "      " if "spike" in e else "    "
        extra = f" [overlap {_dur(e['overlap_ns'])}]" if "overlap_ns" in e else ""
        at = f"{when:<16} " if when or "spike" in e else ""  # rule items have no time
        out.write(f"{indent}{at}{e['kind']:<10} {e['text']}{extra}\n")
        if verbose and e.get("stack"):  # innermost first, as recorded
            out.write("".join(f"{indent}{'':<16}   {f}\n" for f in e["stack"]))
    out.write("  fix:\n")
    for f in c["fixes"]:
        out.write(f"    - {f}\n")


def _pod(p: dict[str, Any]) -> str:
    """``namespace/pod`` (or the container) of a process row; ``-`` outside any."""
    if p.get("pod"):
        return f"{p['namespace']}/{p['pod']}" if p.get("namespace") else str(p["pod"])
    return str(p.get("container") or "-")


def _processes(procs: list[dict[str, Any]], out: TextIO) -> None:
    rows = []
    # A pod column only when some process ran in a container (analyze.pods).
    placed = any(p.get("pod") or p.get("container") for p in procs)
    # Reclaim (overlapping running) only when some thread reclaimed (analyze.memory).
    reclaim = any(t.get("reclaim_ns") for p in procs for t in p["threads"])
    for p in procs:
        for t in p["threads"]:
            wall = max(1, int(t["wall_ns"]))
            rows.append([
                p["node"], t["pid"], t["comm"] or "", t["tid"], t["thread"] or "",
                *([_pod(p)] if placed else []),
                *(f"{int(t.get(k) or 0) / wall:.1%}" for k in BREAKDOWN_KEYS),
                _dur(int(t["in_cuda_ns"])) + ("*" if t["in_cuda_estimated"] else ""),
                *([f"{int(t.get('reclaim_ns') or 0) / wall:.1%}"] if reclaim else []),
            ])
    if not rows:
        out.write("\nno traced threads in the window\n")
        return
    if all(not t.get("switches") and not t.get("off_cpu_ns") for p in procs
           for t in p["threads"]):
        # An imported trace (or tracing with --no-host) records no scheduler events: a
        # table would show every thread 100% running, which nothing measured.
        out.write("\nper-process breakdown: no scheduler data in this recording (imported "
                  "traces and --no-host record none), so where threads spent their time is "
                  "unknown\n")
        return
    out.write("\nper-process breakdown (share of wall time; in_cuda overlaps the rest"
              + (", reclaim overlaps running" if reclaim else "")
              + "; * = scaled from histograms):\n")
    cols = ["node", "pid", "comm", "tid", "thread", *(["pod"] if placed else []),
            *(k.removesuffix("_ns") for k in BREAKDOWN_KEYS), "in_cuda",
            *(["reclaim"] if reclaim else [])]
    out.write(table(cols, rows[:40]))
