"""`fleetd export --nodes` of agents serving imported GPU work: the same GPU tracks,
annotated ranges and launch arrows as `fleetd export --db` of the same database.

Real `fleetd agent --no-trace` processes on loopback, over mTLS with certificates from
`fleetd certs`, each serving a database made by `fleetd import` of the small shared
traces in tests/data/gpu: gpu-01 the Nsight Systems export (one stream, 1,591 kernels
and copies, every one launched), gpu-02 rank 0 of the PyTorch profiler trace (five
streams, NCCL kernels, profiler steps and operator ranges). Every file is checked with
tests/perfetto_check.py. A damaged database and hand-made spools stand for a node that
lies: each bad row is a warning naming the node and the row, the others are kept.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import shutil
import sqlite3
import subprocess
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import perfetto_check
import pytest
from agents import Agent, Pki, agent, client_ssl

from fleetd.export import pull
from fleetd.export.fleet import (
    LINE_WARNINGS,
    MAX_NAME_CHARS,
    FleetExportOptions,
    _annotations,
    _ascending,
    _gpu,
    export_fleet,
)
from fleetd.export.pull import NodePull, PullSpec
from fleetd.fleet.client import ClientOptions
from fleetd.fleet.fanout import FleetOptions, NodeOutcome
from fleetd.fleet.targets import parse_nodes
from fleetd.store.bounds import WHOLE, Bounds

from conftest import FLEETD, REPO, build_db

DATA = REPO / "tests" / "data" / "gpu"
SOURCES = {"gpu-01": DATA / "perlmutter-cloverleaf-cuda.sqlite",
           "gpu-02": DATA / "sampled_rank-0.json.gz"}
RANK_PID = 4037  # the PyTorch rank's process
# What a node's entry in otherData.nodes says about its timeline, clock aside.
KEYS = ("events", "slices", "instants", "skipped", "overlap_lanes", "chains", "flows", "gpu")


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=180)


@pytest.fixture(scope="module")
def dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dbs")
    out = {}
    for node, src in SOURCES.items():
        out[node] = d / f"{node}.db"
        proc = fleetd("import", str(src), "--db", str(out[node]), "--node", node)
        assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def fleet(pki: Pki, dbs: dict[str, Path]) -> Iterator[list[Agent]]:
    with ExitStack() as stack:
        yield [stack.enter_context(agent(db, node, pki, "--no-trace"))
               for node, db in dbs.items()]


def address(a: Agent) -> str:
    return a.url.removeprefix("https://")


def live(pki: Pki, agents: list[Agent], out: Path, *extra: str
         ) -> tuple[dict[str, Any], perfetto_check.TraceSummary, str]:
    proc = fleetd("export", "--nodes", ",".join(address(a) for a in agents), *pki.client_flags(),
                  "-o", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    trace = perfetto_check.load(out)
    return trace, perfetto_check.validate(trace), proc.stderr


def local(db: Path, out: Path, *extra: str) -> tuple[dict[str, Any], perfetto_check.TraceSummary]:
    proc = fleetd("export", "--db", str(db), "-o", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    trace = perfetto_check.load(out)
    return trace, perfetto_check.validate(trace)


def by_node(trace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in trace["otherData"]["nodes"]}


def figures(trace: dict[str, Any], node: str) -> dict[str, Any]:
    n = by_node(trace)[node]
    return {k: n.get(k) for k in KEYS}


def gpu_items(trace: dict[str, Any], s: perfetto_check.TraceSummary, pid: int
              ) -> Counter[tuple[str, str, str, str]]:
    """Every GPU slice and annotated range of one node: its track's name, its name,
    duration and args (times differ by the clock correction, nothing else may)."""
    return Counter((s.threads[(pid, e["tid"])].split(" (overlap")[0], e["name"],
                    str(e["dur"]), orjson.dumps(e["args"], option=orjson.OPT_SORT_KEYS).decode())
                   for e in trace["traceEvents"]
                   if e["ph"] == "X" and e["pid"] == pid and e.get("cat") in ("gpu", "annotation"))


def launch_pairs(trace: dict[str, Any], s: perfetto_check.TraceSummary, pid: int
                 ) -> Counter[tuple[str, str]]:
    """Each launch arrow as (its launch call's event id, its GPU row's id): the slices
    that enclose its two ends."""
    tracks: dict[int, list[tuple[Decimal, Decimal, dict[str, Any]]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == pid:
            tracks.setdefault(e["tid"], []).append(
                (Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"]), e["args"]))
    for slices in tracks.values():
        slices.sort(key=lambda x: x[0])

    def enclosing(end: dict[str, Any], key: str) -> str:
        slices = tracks[end["tid"]]
        ts = Decimal(end["ts"])
        i = bisect.bisect_right(slices, ts, key=lambda x: x[0])
        found = [a[key] for lo, hi, a in slices[:i] if lo <= ts <= hi and key in a]
        assert len(found) == 1, (end, found)
        return str(found[0])

    ends: dict[int, dict[str, dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] in ("s", "f") and e.get("cat") == "gpu" and e["pid"] == pid:
            ends.setdefault(int(e["id"]), {})[e["ph"]] = e
    assert all(set(v) == {"s", "f"} for v in ends.values())
    return Counter((enclosing(v["s"], "event"), enclosing(v["f"], "gpu"))
                   for v in ends.values())


def db_one(db: Path, sql: str, *params: Any) -> Any:
    with sqlite3.connect(db) as c:
        return c.execute(sql, params).fetchone()[0]


# ---- the live export draws what the file draws ------------------------------------------


def test_gpu_tracks_and_launch_arrows_are_the_local_ones(
        pki: Pki, fleet: list[Agent], dbs: dict[str, Path], tmp_path: Path) -> None:
    trace, s, stderr = live(pki, fleet, tmp_path / "live.json")
    assert trace["otherData"]["fleet"]["status"] == "complete"
    assert trace["otherData"]["warnings"] == [], stderr
    for node, db in dbs.items():
        mine, ms = local(db, tmp_path / f"{node}.json")
        got, want = figures(trace, node), figures(mine, node)
        assert got == want, node
        # The counts are the file's own (straight from its tables).
        slices = db_one(db, "SELECT count(*) FROM gpu_data WHERE kind IN (1, 2, 3)")
        assert got["gpu"]["gpu_slices"] == slices > 1000, node
        assert got["gpu"]["annotations"] == db_one(db, "SELECT count(*) FROM annotation_data")
        assert got["gpu"]["launch_arrows"] == db_one(
            db, "SELECT count(*) FROM gpu_data WHERE kind IN (1, 2, 3) AND launch != 0") > 1000
        # The same tracks, slices, ranges and arrows, one by one.
        pid, mpid = by_node(trace)[node]["pid"], by_node(mine)[node]["pid"]
        assert gpu_items(trace, s, pid) == gpu_items(mine, ms, mpid), node
        pairs = launch_pairs(trace, s, pid)
        assert pairs == launch_pairs(mine, ms, mpid)
        assert sum(pairs.values()) == got["gpu"]["launch_arrows"]
    assert by_node(trace)["gpu-02"]["gpu"]["streams"] == 5
    assert by_node(trace)["gpu-02"]["label"] == "gpu-02 (rank 0)"
    # The node's clock correction moves its GPU rows with its events.
    node = by_node(trace)["gpu-01"]
    assert node["clock"]["source"].startswith("fleet")
    first_gpu = db_one(dbs["gpu-01"], "SELECT min(ts_ns) FROM gpu_data WHERE kind IN (1, 2, 3)")
    first_gpu_slice = min(Decimal(e["ts"]) for e in trace["traceEvents"]
                          if e["ph"] == "X" and e.get("cat") == "gpu" and e["pid"] == node["pid"])
    want_ts = Decimal(first_gpu + node["clock"]["offset_ns"] - trace["otherData"]["origin_ns"])
    assert first_gpu_slice == want_ts / 1000


def test_window_pid_and_limit_cut_as_the_file_does(
        pki: Pki, fleet: list[Agent], dbs: dict[str, Path], tmp_path: Path) -> None:
    lo, hi = (db_one(dbs["gpu-02"], f"SELECT {f}(ts_ns) FROM gpu_data") for f in ("min", "max"))
    # Without clock correction the window reads the same on the node as in the file.
    cuts = {
        "window": ["--from", str(lo + (hi - lo) // 3), "--to", str(lo + 2 * (hi - lo) // 3)],
        "limit": ["--limit-per-node", "300"],
        "pid": ["--pid", str(RANK_PID)],
    }
    for what, args in cuts.items():
        trace, _, _ = live(pki, fleet, tmp_path / f"{what}.json", "--no-clock-correction",
                           *args)
        for node, db in dbs.items():
            mine, _ = local(db, tmp_path / f"{what}-{node}.json", "--no-clock-correction",
                            *args)
            # The nsys recording holds neither the rank's time nor its process.
            assert (node in by_node(trace)) == (node in by_node(mine)), (what, node)
            if node in by_node(trace):
                assert figures(trace, node) == figures(mine, node), (what, node)
        gpu = by_node(trace)["gpu-02"]["gpu"]
        if what == "limit":
            assert gpu["gpu_slices"] == gpu["annotations"] == 300
            assert 0 < gpu["launch_arrows"] < 300  # launch calls past the first 300: none
        if what == "window":
            assert 0 < gpu["gpu_slices"] < 1204


def test_paged_in_small_pages_and_the_pull_stays_flat(
        pki: Pki, dbs: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In process, under tracemalloc: the GPU rows come in pages of 251 (so every page
    boundary is crossed, ts_ns repeats included) and equal the file's; with eight times
    the GPU rows, pulling and checking them (everything before the writer starts) peaks
    about as high, and so does the whole export (the GPU pass writes out as it goes)."""
    from fleetd.export import fleet

    monkeypatch.setattr(pull, "GPU_PAGE", 251)
    small = dbs["gpu-01"]
    large = tmp_path / "gpu-01x8.db"
    shutil.copy(small, large)
    with sqlite3.connect(large) as c:  # seven shifted copies of every GPU row
        span = c.execute("SELECT max(ts_ns + dur_ns) - min(ts_ns) FROM gpu_data").fetchone()[0]
        cols = [r[1] for r in c.execute("PRAGMA table_info(gpu_data)")]
        rest = ", ".join(cols[3:])  # after id, session, ts_ns
        for k in range(1, 8):
            c.execute(f"INSERT INTO gpu_data SELECT id + {k * 10_000_000}, session, "
                      f"ts_ns + {k * span}, {rest} FROM gpu_data "
                      f"WHERE id < (SELECT min(id) FROM gpu_data) + 10000000")
    pulled: list[int] = []
    write_trace = fleet.write_trace

    def measured(*args: Any, **kw: Any) -> Any:
        pulled.append(tracemalloc.get_traced_memory()[1])
        return write_trace(*args, **kw)

    monkeypatch.setattr(fleet, "write_trace", measured)

    def peak(db: Path) -> tuple[int, int, float, dict[str, int]]:
        with agent(db, "gpu-01", pki, "--no-trace") as a:
            opts = FleetOptions(tuple(parse_nodes(address(a))),
                                ClientOptions(ssl=client_ssl(pki), timeout_s=30))
            tracemalloc.start()
            t0 = time.perf_counter()
            done = export_fleet(opts, FleetExportOptions(chains="none"),
                                tmp_path / f"{db.stem}.json")
            took = time.perf_counter() - t0
            _, top = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert done.warnings == []
        [stats] = done.stats
        assert stats.gpu is not None
        if db == small:
            mine, _ = local(db, tmp_path / "local.json", "--chains", "none")
            assert stats.gpu == by_node(mine)["gpu-01"]["gpu"]
            assert stats.flows == by_node(mine)["gpu-01"]["flows"]
        return pulled[-1], top, took, stats.gpu

    (p1, w1, t1, g1), (p8, w8, t8, g8) = peak(small), peak(large)
    assert g8["gpu_slices"] == 8 * g1["gpu_slices"]
    assert g8["launch_arrows"] == 8 * g1["launch_arrows"]
    print(f"live export, pages of 251: {g1['gpu_slices']} GPU rows {t1:.2f} s, pull peak "
          f"{p1 / 1e6:.1f} MB, whole peak {w1 / 1e6:.1f} MB; {g8['gpu_slices']} GPU rows "
          f"{t8:.2f} s, pull peak {p8 / 1e6:.1f} MB, whole peak {w8 / 1e6:.1f} MB")
    assert p8 < p1 * 1.5 + 500_000, (p1, p8)
    # The writer's GPU pass writes out as it goes: the whole export stays flat too.
    assert w8 < w1 * 1.5 + 500_000, (w1, w8)


# ---- nodes without GPU work -------------------------------------------------------------


def _v1(db: Path) -> Path:
    """A file from before imports: no GPU tables at all."""
    with sqlite3.connect(db) as c:
        for view in ("gpu_launches", "gpu_kernels", "gpu_copies", "gpu_activity",
                     "annotations", "imports"):
            c.execute(f"DROP VIEW {view}")
        for table in ("gpu_data", "annotation_data", "gpu_names"):
            c.execute(f"DROP TABLE {table}")
        c.execute("PRAGMA user_version = 1")
    return db


def test_a_node_without_gpu_work_costs_one_small_request(
        pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    send_all = pull.send_all

    async def counting(client: Any, t: Any, requests: Any) -> Any:
        asked.extend(str((r.body or {}).get("sql")) for r in requests)
        return await send_all(client, t, requests)

    monkeypatch.setattr(pull, "send_all", counting)
    plain = build_db(tmp_path / "gpu-03.db", node="gpu-03", n=200)
    old = _v1(build_db(tmp_path / "gpu-04.db", node="gpu-04", n=100))
    with agent(plain, "gpu-03", pki, "--no-trace") as a, \
            agent(old, "gpu-04", pki, "--no-trace") as b:
        opts = FleetOptions(tuple(parse_nodes(f"{address(a)},{address(b)}")),
                            ClientOptions(ssl=client_ssl(pki), timeout_s=30))
        done = export_fleet(opts, FleetExportOptions(chains="none"), tmp_path / "plain.json")
    assert done.answer.status == "complete" and done.warnings == []
    assert {s.name: (s.events, s.gpu) for s in done.stats} == {"gpu-03": (200, None),
                                                               "gpu-04": (100, None)}
    gpu_asks = [q for q in asked if "gpu_data" in q or "annotation_data" in q]
    assert len(gpu_asks) == 2 and all(q.startswith("SELECT (SELECT ts_ns") for q in gpu_asks)
    trace = perfetto_check.load(tmp_path / "plain.json")
    perfetto_check.validate(trace)
    assert all("gpu" not in n for n in trace["otherData"]["nodes"])


def test_an_agent_serving_a_merged_file_draws_no_ambiguous_arrow(
        pki: Pki, dbs: dict[str, Path], tmp_path: Path) -> None:
    merged = tmp_path / "merged.db"
    proc = fleetd("merge", *(str(db) for db in dbs.values()), "-o", str(merged))
    assert proc.returncode == 0, proc.stderr
    with agent(merged, "gpu-01", pki, "--no-trace") as a:
        trace, _, stderr = live(pki, [a], tmp_path / "merged.json", "--chains", "none")
    gpu = by_node(trace)["gpu-01"]["gpu"]
    assert gpu["gpu_slices"] == sum(
        db_one(db, "SELECT count(*) FROM gpu_data WHERE kind IN (1, 2, 3)")
        for db in dbs.values())
    assert gpu["launch_arrows"] == 0
    assert "launch arrows left out: the agent serves a file of 2 nodes" in stderr


# ---- a node that lies -------------------------------------------------------------------


def _position(db: Path, table: str, row_id: int, where: str = "1") -> int:
    """The row's place (1-based) in what the node sends: time order, then id."""
    return int(db_one(db, f"SELECT count(*) FROM {table} WHERE {where} AND (ts_ns, id) <= "
                      f"(SELECT ts_ns, id FROM {table} WHERE id = ?)", row_id))


def test_bad_gpu_rows_from_a_node_are_warnings_naming_node_and_row(
        pki: Pki, dbs: dict[str, Path], tmp_path: Path) -> None:
    db = tmp_path / "damaged.db"
    shutil.copy(dbs["gpu-02"], db)
    kernels = "kind IN (1, 2, 3)"
    with sqlite3.connect(db) as c:
        ids = [r[0] for r in c.execute(
            f"SELECT id FROM gpu_data WHERE {kernels} AND launch != 0 ORDER BY ts_ns, id "
            "LIMIT 5 OFFSET 100")]
        long_name = 0x7EEDBEEF
        c.execute("INSERT INTO gpu_names VALUES (?, ?)", (long_name, "k" * (MAX_NAME_CHARS + 1)))
        for row_id, damage in zip(ids, ("dur_ns = 'oops'", "stream = -3", "device = 2.5",
                                        f"name = {long_name}", f"launch = {2**41}"),
                                  strict=True):
            c.execute(f"UPDATE gpu_data SET {damage} WHERE id = ?", (row_id,))
        ranges = [r[0] for r in c.execute(
            "SELECT id FROM annotation_data ORDER BY ts_ns, id LIMIT 2 OFFSET 50")]
        c.execute("UPDATE annotation_data SET kind = 9 WHERE id = ?", (ranges[0],))
        c.execute("UPDATE annotation_data SET tid = 'main' WHERE id = ?", (ranges[1],))
    rows = [_position(db, "gpu_data", i, kernels) for i in ids]
    at = [_position(db, "annotation_data", i) for i in ranges]
    with agent(db, "gpu-02", pki, "--no-trace") as a:
        trace, _, stderr = live(pki, [a], tmp_path / "bad.json", "--chains", "none")
    good, _ = local(dbs["gpu-02"], tmp_path / "good.json", "--chains", "none")
    got, want = by_node(trace)["gpu-02"]["gpu"], by_node(good)["gpu-02"]["gpu"]
    # Every other row is kept; no arrow to a row left out (validate() checks both ends).
    assert got == {"gpu_slices": want["gpu_slices"] - 5, "annotations": want["annotations"] - 2,
                   "launch_arrows": want["launch_arrows"] - 5, "streams": want["streams"]}
    warned = [ln.removeprefix("fleetd: warning: ") for ln in stderr.splitlines()
              if "row" in ln and "skipped" in ln]
    assert warned == [
        f"node gpu-02: GPU row {rows[0]} skipped: dur_ns is a str, not an integer",
        f"node gpu-02: GPU row {rows[1]} skipped: stream -3 is out of range",
        f"node gpu-02: GPU row {rows[2]} skipped: device is a float, not an integer",
        f"node gpu-02: GPU row {rows[3]} skipped: name is {MAX_NAME_CHARS + 1} characters "
        f"long (at most {MAX_NAME_CHARS})",
        f"node gpu-02: GPU row {rows[4]} skipped: launch {2**41} is out of range",
        f"node gpu-02: annotation row {at[0]} skipped: kind 9 is not a step (1), NVTX range "
        "(2), user annotation (3) or operator (4)",
        f"node gpu-02: annotation row {at[1]} skipped: tid is a str, not an integer",
    ]
    assert set(warned) <= set(trace["otherData"]["warnings"])  # the file says so too
    assert trace["otherData"]["fleet"]["status"] == "complete"


WINDOW = (1_000, 10_000)
GOOD_GPU = [1, 2_000, 50, 7, 0, 7, 1, "gemm", 11, 5, 0, None, 1, 1, 1, 128, 1, 1]
GOOD_RANGE = [2, 2_000, 900, 7, 8, 1, "ProfilerStep#1"]


def _with(row: list[Any], **changes: Any) -> list[Any]:
    names = {"id": 0, "ts": 1, "dur": 2, "pid": 3, "device": 4, "stream": 5, "kind": 6,
             "name": 7, "launch": 9, "collective": 11, "grid_x": 12}
    out = list(row)
    for k, v in changes.items():
        out[names[k]] = v
    return out


def test_the_gpu_spool_reader_checks_every_value(tmp_path: Path) -> None:
    lines = [
        orjson.dumps(GOOD_GPU).decode(),                             # 1 kept
        "not json",                                                  # 2
        orjson.dumps({"id": 1}).decode(),                            # 3
        orjson.dumps(GOOD_GPU[:17]).decode(),                        # 4
        orjson.dumps(_with(GOOD_GPU, ts=20_000)).decode(),           # 5 outside the window
        orjson.dumps(_with(GOOD_GPU, ts=3_000, launch=True)).decode(),  # 6 a bool
        orjson.dumps(_with(GOOD_GPU, ts=3_000, kind=4)).decode(),    # 7 sync: no slice
        orjson.dumps(_with(GOOD_GPU, ts=3_000, collective=7)).decode(),  # 8
        orjson.dumps(_with(GOOD_GPU, ts=3_000, grid_x=2**32)).decode(),  # 9
        orjson.dumps(_with(GOOD_GPU, ts=3_000, id=9, launch=6)).decode(),  # 10 kept
        orjson.dumps(_with(GOOD_GPU, ts=2_500, id=10)).decode(),     # 11 back in time
        orjson.dumps(_with(GOOD_GPU, ts=4_000, id=11, collective="allreduce",
                           launch=2)).decode(),                      # 12 kept
    ]
    path = tmp_path / "gpu.ndjson"
    path.write_text("\n".join(lines) + "\n")
    notes: list[str] = []
    rows = list(_gpu(path, WINDOW, notes.append))
    assert [(r[0], r[9], r[11]) for r in rows] == [(1, 5, None), (9, 6, None),
                                                   (11, 2, "allreduce")]
    assert notes[0].startswith("GPU row 2 skipped: not JSON")
    assert notes[1:] == [
        "GPU row 3 skipped: a dict where a row of 18 values belongs",
        "GPU row 4 skipped: a row of 17 values, not 18",
        "GPU row 5 skipped: ts_ns 20000 is outside the window asked for",
        "GPU row 6 skipped: launch is a bool, not an integer",
        f"{9 - LINE_WARNINGS} more bad GPU row(s) skipped",
    ]
    ranges = tmp_path / "ranges.ndjson"
    ranges.write_text("\n".join(orjson.dumps(r).decode() for r in (
        GOOD_RANGE, [*GOOD_RANGE[:6], "x" * (MAX_NAME_CHARS + 1)],
        _with(GOOD_RANGE, pid=-1), _with(GOOD_RANGE, dur=-5), _with(GOOD_RANGE, id=3))))
    notes = []
    assert [r[0] for r in _annotations(ranges, WINDOW, notes.append)] == [2, 3]
    assert notes == [
        f"annotation row 2 skipped: name is {MAX_NAME_CHARS + 1} characters long (at most "
        f"{MAX_NAME_CHARS})",
        "annotation row 3 skipped: pid -1 is out of range",
        "annotation row 4 skipped: dur_ns -5 is out of range",
    ]


def test_launch_seqs_are_sorted_in_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from array import array

    from fleetd.export import fleet

    monkeypatch.setattr(fleet, "LAUNCH_RUN", 7)
    seqs = [(i * 7919) % 101 for i in range(300)]
    assert list(_ascending(array("q", seqs))) == sorted(seqs)
    already = array("q", range(50))
    assert _ascending(already) is already


def test_pages_that_do_not_move_forward_end_the_paging(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that answers every page with the same rows, 'truncated': one page is
    kept, then a warning; the loop never turns again."""
    pages: list[list[Any]] = []

    async def same_page(client: Any, t: Any, request: Any) -> dict[str, Any]:
        pages.append(request.body["params"])
        return {"columns": [], "rows": [GOOD_GPU, GOOD_GPU], "truncated": True}

    monkeypatch.setattr(pull, "_ask", same_page)
    [target] = parse_nodes("127.0.0.1:1")
    node = NodePull(NodeOutcome(target, "liar"), {}, tmp_path / "e", tmp_path / "r",
                    window=WINDOW)
    spec = PullSpec(Bounds(WHOLE))
    got = asyncio.run(pull._pages(None, target, pull.GPU_SQL.format(pid=""),
                                  spec, node, 1.0, tmp_path / "gpu.ndjson", "GPU rows"))
    assert got == 4 and len(pages) == 2
    assert pages[1][:4] == [2_000, WINDOW[1], 2_000, 1]  # the cursor moved once
    assert node.warnings == ["GPU rows after the first 4 left out: the node's pages do not "
                             "move forward in time"]
