"""The explain report as text: one database's (:func:`render`) and the fleet's
(:func:`render_fleet`, also printed by ``fleetd demo``). The html page is
fleetd/export/html.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TextIO

from fleetd.analyze.reading import pods
from fleetd.analyze.reading.rows import TimeColumn
from fleetd.cli.output import SEVERITY_STYLE, colour_wanted, paint, table
from fleetd.printable import printable_tree
from fleetd.store.timeparse import format_ns
from fleetd.wire.answers import ChainJson, ExplainReport, ProcessRow, StragglerEntry

# The per-thread columns, adding up to the wall time: sleeps split by wait reason.
BREAKDOWN_KEYS: tuple[TimeColumn, ...] = (
    "running_ns", "runq_ns", "irq_ns", "d_state_ns", "lock_ns", "data_ns", "timer_ns",
    "gpu_sync_ns", "other_ns")


def _dur(ns: int | None) -> str:
    if ns is None:
        return "-"
    if ns >= 1_000_000_000:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"


def render(report: ExplainReport, out: TextIO, *, verbose: bool = False) -> None:
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


def render_fleet(report: Mapping[str, Any], out: TextIO) -> None:
    """Stragglers first, each with its own top chains as the why; then every node's
    chains, most severe first, each tagged with its node (made printable first, as in
    :func:`render`). ``report``: a file's :class:`ExplainReport` over several nodes, or
    the fleet client's (``fleetd.fleet.queries.explain``, docs/json.md)."""
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
            from fleetd.analyze.distributed.collectives import host_chains  # only here

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


def _collectives(report: Mapping[str, Any], out: TextIO) -> None:
    """One line on collective arrival when NCCL collectives were recorded, and its notes."""
    found = report.get("collectives") or {}
    if not found.get("events"):
        return
    out.write(f"\ncollective arrival ({found.get('matching') or 'no'} matching): "
              f"{found['verdict']}\n")
    for note in found.get("notes") or []:
        out.write(f"  note: {note}\n")


def _stragglers(ranked: list[StragglerEntry], out: TextIO) -> None:
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


def _chain(c: ChainJson, out: TextIO, tag: bool = False, *, verbose: bool = False) -> None:
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


def _pod(p: ProcessRow) -> str:
    """``namespace/pod`` (or the container) of a process row; ``-`` outside any."""
    if p.get("pod"):
        return f"{p['namespace']}/{p['pod']}" if p.get("namespace") else str(p["pod"])
    return str(p.get("container") or "-")


def _processes(procs: list[ProcessRow], out: TextIO) -> None:
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
