"""Perfetto export of imported GPU timelines: one track per device and stream, annotated
ranges beside their thread, and an arrow from each launch call to its GPU work.

Expected counts come straight from the source files (plain json / sqlite3), never from
fleetd's own tables.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from fleetd.cli.main import main

from conftest import REPO

sys.path.insert(0, str(REPO / "tests"))

import export_golden  # noqa: E402
import gpu_export_golden  # noqa: E402
import perfetto_check  # noqa: E402

DATA = REPO / "tests" / "data" / "gpu"
NSYS = DATA / "perlmutter-cloverleaf-cuda.sqlite"
RANK0 = DATA / "sampled_rank-0.json.gz"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _kineto(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    return dict(json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw))


def _linked(doc: dict[str, Any]) -> tuple[int, int, set[tuple[int, int]]]:
    """GPU events, those whose correlation names a cuda_runtime call, and their
    (device, stream) pairs."""
    ev = doc["traceEvents"]
    calls = {e["args"]["correlation"] for e in ev if e.get("cat") == "cuda_runtime"}
    gpu = [e for e in ev if e.get("cat") in GPU_CATS]
    linked = sum(1 for e in gpu if e["args"].get("correlation") in calls)
    return len(gpu), linked, {(e["args"]["device"], e["args"]["stream"]) for e in gpu}


def _export(tmp: Path, src: Path, *extra: str) -> tuple[dict[str, Any],
                                                        perfetto_check.TraceSummary]:
    db, out = tmp / "in.db", tmp / "out.json"
    if not db.exists():
        assert main(["import", str(src), "--db", str(db)]) == 0
    assert main(["export", "--db", str(db), "-o", str(out), *extra]) == 0
    trace = perfetto_check.load(out)
    return trace, perfetto_check.validate(trace)


def _gpu_tracks(s: perfetto_check.TraceSummary) -> dict[tuple[int, int], str]:
    return {k: v for k, v in s.threads.items() if v.startswith("GPU ")}


def _flow_ends(trace: dict[str, Any]) -> dict[int, dict[str, dict[str, Any]]]:
    ends: dict[int, dict[str, dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] in ("s", "f") and e.get("cat") == "gpu":
            ends.setdefault(int(e["id"]), {})[e["ph"]] = e
    return ends


def _enclosing(trace: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """The slice an arrow end binds to (same track, its time inside the slice)."""
    ts = Decimal(end["ts"])
    found = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == end["pid"]
             and e["tid"] == end["tid"] and Decimal(e["ts"]) <= ts
             <= Decimal(e["ts"]) + Decimal(e["dur"])]
    assert len(found) == 1, end
    return found[0]


# ---- the golden slice ---------------------------------------------------------------------


def test_golden_gpu_trace(tmp_path: Path) -> None:
    """Exactly the committed file: regenerate only with tests/gpu_export_golden.py --write."""
    data = gpu_export_golden.export(tmp_path)
    golden = gpu_export_golden.GOLDEN.read_bytes()
    assert data == golden, "export changed; review and run tests/gpu_export_golden.py --write"
    trace = json.loads(golden, parse_float=Decimal)
    s = perfetto_check.validate(trace)
    doc = _kineto(gpu_export_golden.SLICE)
    n_gpu, linked, streams = _linked(doc)
    assert (n_gpu, linked, len(streams)) == (13, 13, 3)  # what the slice was cut to hold
    assert len(_gpu_tracks(s)) == len(streams)
    gpu_slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "gpu"]
    assert len(gpu_slices) == n_gpu
    assert s.flows == linked
    ranges = [e for e in doc["traceEvents"] if e.get("cat") in ("cpu_op", "user_annotation")]
    assert sum(1 for e in trace["traceEvents"]
               if e["ph"] == "X" and e["cat"] == "annotation") == len(ranges)


def test_arrows_join_each_launch_call_to_its_kernel(tmp_path: Path) -> None:
    trace, s = _export(tmp_path, gpu_export_golden.SLICE, "--chains", "none")
    doc = _kineto(gpu_export_golden.SLICE)
    calls = {e["args"]["correlation"]: e for e in doc["traceEvents"]
             if e.get("cat") == "cuda_runtime"}
    ends = _flow_ends(trace)
    assert ends and all(set(v) == {"s", "f"} for v in ends.values())
    gpu_tids = {tid for (_, tid) in _gpu_tracks(s)}
    for v in ends.values():
        launch, work = _enclosing(trace, v["s"]), _enclosing(trace, v["f"])
        assert work["tid"] in gpu_tids and launch["tid"] not in gpu_tids
        call = calls[work["args"]["correlation"]]
        # The source's own pairing: same call name, and the kernel starts after the call.
        assert launch["name"] == call["name"]
        assert Decimal(work["ts"]) >= Decimal(launch["ts"])
        assert launch["args"]["event"] == work["args"]["launch"]
    nccl = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "gpu"
            and e["name"].startswith("ncclKernel")]
    assert nccl and nccl[0]["args"]["collective"] == "SendRecv"


# ---- whole imported files ------------------------------------------------------------------


def test_kineto_rank_export(tmp_path: Path) -> None:
    trace, s = _export(tmp_path, RANK0, "--chains", "none")
    n_gpu, linked, streams = _linked(_kineto(RANK0))
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "gpu") == n_gpu
    assert s.flows == linked
    names = set(_gpu_tracks(s).values())
    assert {f"GPU {d} stream {st} · pyper:trainer:0:0[4037]" for d, st in streams} == names


def test_nsys_export(tmp_path: Path) -> None:
    trace, s = _export(tmp_path, NSYS)
    src = sqlite3.connect(f"file:{NSYS}?mode=ro&immutable=1", uri=True)
    kernels = src.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    copies = src.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY").fetchone()[0]
    linked = src.execute(
        "SELECT (SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k WHERE EXISTS (SELECT 1 "
        "FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE r.correlationId = k.correlationId)) + "
        "(SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY k WHERE EXISTS (SELECT 1 "
        "FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE r.correlationId = k.correlationId))"
    ).fetchone()[0]
    streams = src.execute("SELECT count(*) FROM (SELECT DISTINCT deviceId, streamId FROM "
                          "CUPTI_ACTIVITY_KIND_KERNEL UNION SELECT DISTINCT deviceId, streamId "
                          "FROM CUPTI_ACTIVITY_KIND_MEMCPY)").fetchone()[0]
    src.close()
    assert sum(1 for e in trace["traceEvents"]
               if e["ph"] == "X" and e["cat"] == "gpu") == kernels + copies
    assert len(_gpu_tracks(s)) == streams
    gpu_flows = len(_flow_ends(trace))
    assert gpu_flows == linked
    meta = s.other["nodes"][0]
    assert meta["gpu"]["launch_arrows"] == linked
    assert meta["flows"] == s.flows  # chain arrows and launch arrows, all with both ends


@pytest.mark.parametrize("extra", [("--limit-per-node", "40"), ("--pid", "4037"),
                                   ("--to", "2023-04-28T23:51:38.5Z")])
def test_filters_never_leave_an_arrow_dangling(tmp_path: Path, extra: tuple[str, str]) -> None:
    trace, s = _export(tmp_path, RANK0, "--chains", "none", *extra)  # validate() checks ends
    assert s.flows == len(_flow_ends(trace))
    if extra[0] == "--limit-per-node":
        assert sum(1 for e in trace["traceEvents"]
                   if e["ph"] == "X" and e["cat"] == "gpu") == 40
        assert 0 < s.flows <= 40
    if extra[0] == "--to":  # the window cuts the rank's GPU rows in two
        n_gpu = sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "gpu")
        assert 0 < n_gpu < _linked(_kineto(RANK0))[0]


def test_recorded_golden_is_unchanged(tmp_path: Path) -> None:
    """A database without GPU tables exports byte for byte as before (no gpu metadata)."""
    assert export_golden.export(tmp_path) == export_golden.GOLDEN.read_bytes()
