"""``fleetd gpu``: the GPU side of imported traces, per rank: where device time went,
launch delays and TKLQT, and the M1-M5 host-overhead verdict, of one database or (with
``--nodes``) of every node, the slowest rank flagged."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, cast

from fleetd.cli.argtypes import positive
from fleetd.cli.fleet_args import add_fleet_args
from fleetd.cli.output import dumps, human_ns, print_notes, table
from fleetd.cli.questions import either
from fleetd.cli.window_args import add_window
from fleetd.printable import printable_tree
from fleetd.questions.catalog import GPU

if TYPE_CHECKING:
    from fleetd.analyze.facade import Analysis
    from fleetd.fleet.fanout import FleetOptions
    from fleetd.fleet.queries import GpuFleetJson
    from fleetd.fleet.result import FleetResult
    from fleetd.store.bounds import Bounds
    from fleetd.wire.answers import GpuAnswer, GpuRank
    from fleetd.wire.gpu import CheckedRank

FORMATS = ("table", "json")
RANK_COLUMNS = ["node", "pid", "rank", "device", "window", "idle%", "compute%", "comm%",
                "memcpy%", "kernels", "delay_p50", "delay_p95", "tklqt", "host_overhead"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gpu",
        help="GPU idle, launch delays and the host-overhead verdict per rank",
        description="For each process and device of imported GPU timelines (fleetd "
        "import): the temporal breakdown (idle, compute, communication, memcpy), the kernel "
        "table, launch and queue delays with TKLQT, the M1-M5 host-overhead verdict and "
        "per-step figures. With --nodes, every agent computes its ranks and the slowest "
        "rank is flagged.",
    )
    add_window(p)
    p.add_argument("--pid", type=positive("pid"), help="only this process")
    p.add_argument("--steps", action="store_true",
                   help="measure whole profiler steps only (ProfilerStep ranges)")
    p.add_argument("--threshold", action="append", default=[],
                   metavar="[PHASE:]METRIC=VALUE",
                   help="override a verdict threshold (defaults M1=0.30, M2=0.10, M3a=0.50, "
                   "M3b=0.05, M3c=0.50, M4=0.60, M5=0.20); with PHASE: only for the "
                   "profiler steps whose name is PHASE or matches it as a glob "
                   "(ProfilerStep#3:M1=0.4, 'ProfilerStep*:M4=0.5'); repeatable")
    p.add_argument("--top", type=positive("--top"), default=10, metavar="N",
                   help="kernels to show (default 10)")
    add_fleet_args(p)
    p.add_argument("--format", default="table", help="output format: table|json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.analyze.gpu.device import parse_thresholds
    from fleetd.errors import UsageError

    if args.format not in FORMATS:
        raise UsageError(f"unknown format {args.format!r}", "use one of: table, json")
    limits = parse_thresholds(args.threshold)
    params = GPU.values({"pid": args.pid, "steps": args.steps, "thresholds": limits})

    def local(analysis: Analysis) -> GpuAnswer:
        return cast("GpuAnswer", GPU.answer_locally(analysis, params))  # GPU.shape

    def fleet(opts: FleetOptions, bounds: Bounds) -> FleetResult[GpuFleetJson]:
        from fleetd.fleet.queries import GpuFleetJson, ask

        return ask(opts, GPU, bounds, params, GpuFleetJson)

    asked = either(args, local, fleet)
    _write(asked.obj, args)
    return asked.done(args, args.format == "json")


def _write(obj: GpuAnswer | GpuFleetJson, args: argparse.Namespace) -> None:
    if args.format == "json":
        sys.stdout.write(dumps(obj).decode() + "\n")
        return
    obj = printable_tree(obj)  # kernel and step names come from the traced job
    ranks = obj.get("ranks") or []
    rows = [[r["node"], r["pid"], r.get("rank"), r["device"], human_ns(r["window_ns"]),
             f"{r['idle_pct']:.1f}", f"{r['compute_pct']:.1f}", f"{r['comm_pct']:.1f}",
             f"{r['memcpy_pct']:.1f}", r["kernels"], human_ns(r["launch_delay_ns"]["p50"]),
             human_ns(r["launch_delay_ns"]["p95"]), human_ns(r["tklqt_ns"]),
             r["verdict"]["host_overhead"]] for r in ranks]
    print(table(RANK_COLUMNS, rows))
    for r in ranks:
        _verdict(r)
    s = obj.get("straggler")
    if s:
        print(f"SLOWEST RANK {s['node']} pid {s['pid']} (rank {s.get('rank')}): {s['reason']}\n")
    kernels = (obj.get("kernels") or [])[: args.top]
    if kernels:
        print(table(["kernel", "count", "total", "mean", "p50", "p99", "share%"],
                    [[_short(str(k["name"])), k["count"], human_ns(k["total_ns"]),
                      human_ns(k["mean_ns"]), human_ns(k["p50_ns"]), human_ns(k["p99_ns"]),
                      f"{k['share_pct']:.1f}"] for k in kernels]))
    print_notes(obj, bool(ranks), "table")


def _verdict(r: GpuRank | CheckedRank) -> None:
    from fleetd.analyze.gpu.device import M_WORDS, TKLQT_WORDS, one_verdict

    v = r["verdict"]
    m = v["metrics"]
    figures = "  ".join(f"{k} {m[k]:.3f}" for k in ("M1", "M2", "M3a", "M3b", "M3c", "M4",
                                                      "M5") if m.get(k) is not None)
    summary = one_verdict(v["host_overhead"], r["tklqt_reading"])  # never a node's text
    print(f"{r['node']} pid {r['pid']} device {r['device']}: {summary}")
    print(f"  host overhead {v['host_overhead']} by {M_WORDS}: {figures}")
    for line in v["evidence"] + v.get("phases", []) + v["caveats"]:
        print(f"  - {line}")
    hf = r.get("host_frames")  # a local rank's only (the fleet's reader keeps none)
    if isinstance(hf, dict) and hf:
        print(f"  - while the GPU idled: {hf['text']}")
    why = (r.get("m3") or {}).get("reason")
    if why:
        print(f"  M3 (exposed host prep) not computed: {why}")
    print(f"  {TKLQT_WORDS} {human_ns(r['tklqt_ns'])}, reading {r['tklqt_reading']}: launch "
          f"delay mean {human_ns(r['launch_delay_ns']['mean'])}, queue delay p50 "
          f"{human_ns(r['queue_delay_ns']['p50'])}")
    for s in r.get("steps") or []:
        print(f"  step {s['name']}: {human_ns(s['step_ns'])}, GPU idle {s['idle_pct']:.1f}%, "
              f"{s['launches']} launches, TKLQT {human_ns(s['tklqt_ns'])}, host overhead "
              f"{s['host_overhead']}")
    print()


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"
