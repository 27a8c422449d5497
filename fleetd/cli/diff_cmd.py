"""``fleetd diff``: two GPU timelines compared, biggest regressions first.

Each side is a fleetd database or a trace file ``fleetd import`` reads (an nsys SQLite
export, a PyTorch profiler .json/.json.gz). A trace file is imported into a temporary
database that is removed afterwards; the file itself is only read."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetd.cli.argtypes import positive
from fleetd.cli.output import dumps, table, warn
from fleetd.printable import printable_tree

if TYPE_CHECKING:  # the analyzers load only when the command runs
    from fleetd.wire.answers import GpuAnswer, GpuDiff

FORMATS = ("table", "json")
_HEADER = 72  # an SQLite header, through its application_id


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two GPU timelines (databases or trace files): steps, kernels, idle",
        description="Compare a baseline and a target GPU timeline: step time, GPU idle, "
        "kernel time, launches, launch delay and TKLQT side by side, the profiler steps "
        "paired by position, and kernel time by name with the biggest regression first. "
        "Each side is a fleetd database or a trace file fleetd import reads (imported into "
        "a temporary database).",
    )
    p.add_argument("sides", nargs="*", type=Path, metavar="BASELINE TARGET",
                   help="the two timelines: fleetd diff A.json.gz B.json.gz")
    p.add_argument("--db", action="append", type=Path, default=[], metavar="PATH",
                   help="a side given as an option instead (--db BASELINE --db TARGET)")
    p.add_argument("--steps", action="store_true",
                   help="measure whole profiler steps only (ProfilerStep ranges)")
    p.add_argument("--top", type=positive("--top"), default=10, metavar="N",
                   help="kernels to show (default 10)")
    p.add_argument("--format", default="table", help="output format: table|json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.errors import UsageError

    if args.format not in FORMATS:
        raise UsageError(f"unknown format {args.format!r}", "use one of: table, json")
    args.db = [*args.sides, *args.db]
    if len(args.db) != 2:
        raise UsageError(f"fleetd diff compares two timelines, got {len(args.db)}",
                         "fleetd diff BASELINE TARGET (each a fleetd database or a trace "
                         "file: .sqlite, .json, .json.gz)")
    with tempfile.TemporaryDirectory(prefix="fleetd-diff-") as tmp:
        base = _report(args.db[0], Path(tmp) / "baseline.db", args.steps)
        target = _report(args.db[1], Path(tmp) / "target.db", args.steps)
    from fleetd.analyze.gpu.diff import gpu_diff

    out = gpu_diff(base, target, str(args.db[0]), str(args.db[1]))
    _write(out, args)
    return 0


def is_fleetd_db(path: Path) -> bool:
    """A fleetd database (SQLite with fleetd's application_id), not a trace to import."""
    from fleetd.store.schema import APPLICATION_ID

    try:
        with path.open("rb") as f:
            head = f.read(_HEADER)
    except OSError:
        return False
    return (head.startswith(b"SQLite format 3\x00") and len(head) == _HEADER
            and int.from_bytes(head[68:72], "big") == APPLICATION_ID)


def _report(path: Path, scratch: Path, steps: bool) -> GpuAnswer:
    from fleetd.analyze.facade import Analysis
    from fleetd.store.db import open_reader

    db = path
    if not is_fleetd_db(path):
        from fleetd.ingest import import_traces

        for r in import_traces([path], scratch):
            warn(r.warnings, f"{path}: ")
        db = scratch
    conn = open_reader(db)
    try:
        return Analysis.of(conn).gpu(None, steps)
    finally:
        conn.close()


def _num(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "" if v is None else f"{v / scale:.{digits}f}"


_UNITS = {"step_ns": ("ms", 1e6), "window_ns": ("ms", 1e6), "kernel_ns": ("ms", 1e6),
          "tklqt_ns": ("ms", 1e6), "launch_delay_p50_ns": ("us", 1e3),
          "queue_delay_p50_ns": ("us", 1e3)}


# A metric's "worse" in the diff: True, False, or None when the metric is not judged.
_VERDICT = {True: "worse", False: "better", None: ""}


def _write(obj: GpuDiff, args: argparse.Namespace) -> None:
    if args.format == "json":
        sys.stdout.write(dumps(obj).decode() + "\n")
        return
    obj = printable_tree(obj)  # kernel and file names come from the recorded jobs
    print(f"baseline: {obj['baseline']['source']} ({len(obj['baseline']['ranks'])} rank(s))")
    print(f"target:   {obj['target']['source']} ({len(obj['target']['ranks'])} rank(s))\n")
    rows = []
    for m in obj["metrics"]:
        unit, scale = _UNITS.get(m["metric"], ("", 1.0))
        name = m["metric"].removesuffix("_ns") + (f" ({unit})" if unit else "")
        digits = 0 if m["metric"] in ("kernels", "launches") else 2
        rows.append([name, _num(m["baseline"], scale, digits), _num(m["target"], scale, digits),
                     _num(m["delta"], scale, digits), _num(m["delta_pct"], 1.0, 1),
                     _VERDICT[m["worse"]]])
    print(table(["metric", "baseline", "target", "change", "change%", "verdict"], rows))
    if obj["steps"]:
        print(table(["step", "baseline", "target", "baseline_ms", "target_ms", "change%"],
                    [[s["index"], s["baseline_name"] or "", s["target_name"] or "",
                      _num(s["baseline_ns"], 1e6), _num(s["target_ns"], 1e6),
                      _num(s["delta_pct"], 1.0, 1)] for s in obj["steps"]]))
    kernels = obj["kernels"][: args.top]
    if kernels:
        print(table(["kernel", "base_n", "target_n", "base_ms", "target_ms", "change_ms",
                     "change%"],
                    [[_short(k["name"]), k["baseline_count"], k["target_count"],
                      _num(k["baseline_ns"], 1e6), _num(k["target_ns"], 1e6),
                      _num(k["delta_ns"], 1e6), _num(k["delta_pct"], 1.0, 1)]
                     for k in kernels]))
    if obj["regressions"]:
        print("regressions, largest first: " + ", ".join(obj["regressions"]))
    warn(obj["warnings"])


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"
