"""``fleetd import`` and ``fleetd gpu`` on real traces (tests/data/gpu, see its README).

Every expected figure is computed here straight from the source file, with plain
sqlite3 / json and exact integer (Decimal) times, never through fleetd's own code.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
import statistics
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetd.cli.main import main
from fleetd.store import schema
from fleetd.store.db import open_writer
from fleetd.store.merge import merge

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
NSYS = DATA / "perlmutter-cloverleaf-cuda.sqlite"
RANKS = [DATA / "sampled_rank-0.json.gz", DATA / "sampled_rank-1.json.gz"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def gpu_json(capsys: pytest.CaptureFixture[str], db: Path, *extra: str) -> dict[str, Any]:
    rc, out, err = run(capsys, "gpu", "--db", str(db), "--format", "json", *extra)
    assert rc == 0, err
    return dict(orjson.loads(out))


def close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-3 * max(abs(want), 1e-9)


# ---- independent figures ------------------------------------------------------------------


def covered(spans: list[tuple[int, int]]) -> int:
    """Total time covered by at least one span (a sweep over start/end points)."""
    points = sorted([(s, 1) for s, e in spans if e > s] + [(e, -1) for s, e in spans if e > s])
    depth, last, total = 0, 0, 0
    for t, step in points:
        if depth > 0:
            total += t - last
        depth += step
        last = t
    return total


def expected(gpu: list[dict[str, Any]], launches: dict[int, tuple[int, int]]) -> dict[str, Any]:
    """gpu: dicts with ts, end, kind, name, corr; launches: corr -> (start, end) of the call."""
    lo = min(g["ts"] for g in gpu)
    hi = max(g["end"] for g in gpu)
    window = hi - lo
    kern = [g for g in gpu if g["kind"] == "kernel"]
    nccl = [g for g in kern if g["name"].startswith("nccl")]
    linked = [g for g in kern if g["corr"] in launches]
    delays = sorted(g["ts"] - launches[g["corr"]][0] for g in linked)
    queues = sorted(max(0, g["ts"] - launches[g["corr"]][1]) for g in linked)
    busy = covered([(g["ts"], g["end"]) for g in gpu])
    all_k = covered([(g["ts"], g["end"]) for g in kern])
    comm = covered([(g["ts"], g["end"]) for g in nccl])
    return {
        "window_ns": window,
        "idle_pct": 100 * (window - busy) / window,
        "compute_pct": 100 * covered([(g["ts"], g["end"]) for g in kern if g not in nccl])
        / window,
        "comm_pct": 100 * comm / window,
        "memcpy_pct": 100 * covered([(g["ts"], g["end"]) for g in gpu if g["kind"] != "kernel"])
        / window,
        "kernels": len(kern), "nccl_kernels": len(nccl), "nccl_ns": comm,
        "tklqt_ns": sum(delays),
        "launch_delay_ns": {"mean": statistics.fmean(delays), "p50": statistics.median(delays),
                            "p95": statistics.quantiles(delays, n=20, method="inclusive")[-1],
                            "max": delays[-1]},
        "queue_delay_ns": {"mean": statistics.fmean(queues), "p50": statistics.median(queues),
                           "p95": statistics.quantiles(queues, n=20, method="inclusive")[-1],
                           "max": queues[-1]},
        "M1": (window - busy) / window,
        "M2": sum(launches[g["corr"]][1] - launches[g["corr"]][0] for g in linked) / window,
        "M4": all_k / window,
        "M5": comm / all_k,
    }


def nsys_source() -> tuple[list[dict[str, Any]], dict[int, tuple[int, int]], dict[str, int]]:
    c = sqlite3.connect(f"file:{NSYS}?mode=ro&immutable=1", uri=True)
    names = dict(c.execute("SELECT id, value FROM StringIds"))
    gpu = [{"ts": s, "end": e, "kind": "kernel", "name": names[n], "corr": k} for s, e, n, k in
           c.execute("SELECT start, end, demangledName, correlationId "
                     "FROM CUPTI_ACTIVITY_KIND_KERNEL")]
    gpu += [{"ts": s, "end": e, "kind": "memcpy", "name": "", "corr": k} for s, e, k in
            c.execute("SELECT start, end, correlationId FROM CUPTI_ACTIVITY_KIND_MEMCPY")]
    launches = {k: (s, e) for s, e, k in c.execute(
        "SELECT start, end, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME")}
    counts = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in (
        "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_MEMCPY",
        "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "OSRT_API")}
    c.close()
    return gpu, launches, counts


def ns(us: Decimal) -> int:
    return int(us * 1000)


def kineto_source(path: Path) -> tuple[list[dict[str, Any]], dict[int, tuple[int, int]],
                                        list[dict[str, Any]]]:
    doc = json.loads(gzip.decompress(path.read_bytes()), parse_float=Decimal)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    kinds = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
    gpu = [{"ts": ns(e["ts"]), "end": ns(e["ts"]) + ns(e["dur"]), "kind": kinds[e["cat"]],
            "name": e["name"], "corr": e["args"]["correlation"]}
           for e in events if e.get("cat") in kinds]
    launches = {e["args"]["correlation"]: (ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]))
                for e in events if e.get("cat") == "cuda_runtime"}
    return gpu, launches, events


def check_rank(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("window_ns", "idle_pct", "compute_pct", "comm_pct", "memcpy_pct", "kernels",
                "nccl_kernels", "nccl_ns", "tklqt_ns"):
        assert close(got[key], want[key]), (key, got[key], want[key])
    for dist in ("launch_delay_ns", "queue_delay_ns"):
        for stat in ("mean", "p50", "p95", "max"):
            assert close(got[dist][stat], want[dist][stat]), (dist, stat)
    for m in ("M1", "M2", "M4", "M5"):
        assert close(got["verdict"]["metrics"][m], want[m]), m


# ---- import ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("gpu") / "all.db"
    assert main(["import", str(NSYS), *map(str, RANKS), "--db", str(db)]) == 0
    return db


def test_nsys_counts_equal_the_source(imported: Path) -> None:
    _, _, want = nsys_source()
    c = sqlite3.connect(imported)
    q = "SELECT count(*) FROM {} WHERE node = 'nid008553'"
    assert c.execute(q.format("gpu_kernels")).fetchone()[0] == want["CUPTI_ACTIVITY_KIND_KERNEL"]
    assert c.execute(q.format("gpu_copies")).fetchone()[0] == want["CUPTI_ACTIVITY_KIND_MEMCPY"]
    assert c.execute(q.format("gpu_activity") + " AND kind = 'sync'").fetchone()[0] == \
        want["CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"]
    assert c.execute(q.format("events") + " AND source = 'cuda'").fetchone()[0] == \
        want["CUPTI_ACTIVITY_KIND_RUNTIME"]
    assert c.execute(q.format("events") + " AND op = 'syscall'").fetchone()[0] == \
        want["OSRT_API"]
    # Every kernel found its launch call, and kernels are queryable by name.
    assert c.execute(q.format("gpu_launches") + " AND kind = 'kernel'").fetchone()[0] == \
        want["CUPTI_ACTIVITY_KIND_KERNEL"]
    assert c.execute(q.format("gpu_kernels") + " AND kernel LIKE '%ideal_gas%'").fetchone()[0] > 0
    start = sqlite3.connect(NSYS).execute(
        "SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()[0]
    assert c.execute("SELECT mono_offset_ns FROM imports WHERE node = 'nid008553'"
                     ).fetchone()[0] == start


def test_kineto_counts_equal_the_source(imported: Path) -> None:
    c = sqlite3.connect(imported)
    for i, path in enumerate(RANKS):
        _, _, events = kineto_source(path)
        count = {k: sum(1 for e in events if e.get("cat") == k) for k in (
            "kernel", "cuda_runtime", "gpu_memcpy", "gpu_memset", "cpu_op", "user_annotation")}
        node = f"rank-{i}"

        def n(sql: str, node: str = node) -> int:
            return int(c.execute(sql, (node,)).fetchone()[0])

        assert n("SELECT count(*) FROM gpu_kernels WHERE node = ?") == count["kernel"]
        assert n("SELECT count(*) FROM events WHERE node = ? AND source = 'cuda'") == \
            count["cuda_runtime"]
        assert n("SELECT count(*) FROM gpu_copies WHERE node = ? AND kind = 'memcpy'") == \
            count["gpu_memcpy"]
        assert n("SELECT count(*) FROM gpu_copies WHERE node = ? AND kind = 'memset'") == \
            count["gpu_memset"]
        assert n("SELECT count(*) FROM annotations WHERE node = ?") == \
            count["cpu_op"] + count["user_annotation"]
        assert n("SELECT count(*) FROM annotations WHERE node = ? AND kind = 'step'") == 2
        assert n("SELECT rank FROM imports WHERE node = ?") == i
        assert n("SELECT count(DISTINCT collective) FROM gpu_kernels WHERE node = ? "
                 "AND collective IS NOT NULL") >= 1


def test_import_twice_adds_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "r.db"
    assert run(capsys, "import", str(RANKS[0]), "--db", str(db))[0] == 0

    def sizes() -> list[int]:
        c = sqlite3.connect(db)
        return [c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in (
            "event_data", "gpu_data", "annotation_data", "session_data", "gpu_names")]

    before = sizes()
    rc, out, _ = run(capsys, "import", str(RANKS[0]), "--db", str(db), "--node", "other")
    assert rc == 0 and "already imported" in out
    assert sizes() == before


# ---- bad input -------------------------------------------------------------------------------


def _no_kernels(tmp: Path) -> Path:
    p = tmp / "nokernels.sqlite"
    shutil.copy(NSYS, p)
    with sqlite3.connect(p) as c:
        c.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL")
    return p


def _truncated(tmp: Path) -> Path:
    p = tmp / "cut.json.gz"
    p.write_bytes(RANKS[0].read_bytes()[:50_000])
    return p


def _text(tmp: Path) -> Path:
    p = tmp / "notes.txt"
    p.write_text("these are not the traces you are looking for\n")
    return p


def _not_trace_json(tmp: Path) -> Path:
    p = tmp / "config.json"
    p.write_text('{"model": "llama", "layers": 32}')
    return p


def _foreign_sqlite(tmp: Path) -> Path:
    p = tmp / "other.sqlite"
    with sqlite3.connect(p) as c:
        c.execute("CREATE TABLE t (x)")
    return p


@pytest.mark.parametrize(("make", "says"), [
    (_no_kernels, "holds no GPU kernels"),
    (_truncated, "truncated gzip"),
    (_text, "not a trace fleetd can import"),
    (_not_trace_json, "without a traceEvents list"),
    (_foreign_sqlite, "not an nsys export"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, says: str) -> None:
    bad = make(tmp_path)
    db = tmp_path / "out.db"
    rc, out, err = run(capsys, "import", str(bad), "--db", str(db))
    assert rc == 2
    lines = err.strip().splitlines()
    assert lines[0].startswith("fleetd: error: ") and says in lines[0]
    assert len(lines) <= 2 and all("Traceback" not in ln for ln in lines)
    assert not db.exists()
    # A good file beside a bad one: still nothing written (all files are checked first).
    rc, _, _ = run(capsys, "import", str(RANKS[0]), str(bad), "--db", str(db))
    assert rc == 2 and not db.exists()


def test_kineto_without_gpu_events_imports_with_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(gzip.decompress(RANKS[0].read_bytes()))
    doc["traceEvents"] = [e for e in doc["traceEvents"]
                          if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")]
    src = tmp_path / "cpu_only.json"
    src.write_text(json.dumps(doc))
    db = tmp_path / "cpu.db"
    rc, _, err = run(capsys, "import", str(src), "--db", str(db))
    assert rc == 0 and "GPU metrics are unavailable" in err
    got = gpu_json(capsys, db)
    assert got["ranks"] == [] and "no GPU activity" in got["note"]
    assert sqlite3.connect(db).execute("SELECT count(*) FROM events").fetchone()[0] == sum(
        1 for e in doc["traceEvents"] if e.get("cat") == "cuda_runtime")


# ---- fleetd gpu against independent figures ---------------------------------------------------


def test_gpu_figures_nsys(imported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu, launches, _ = nsys_source()
    got = gpu_json(capsys, imported)
    rank = next(r for r in got["ranks"] if r["node"] == "nid008553")
    check_rank(rank, expected(gpu, launches))
    assert rank["verdict"]["host_overhead"] == "NO"


def test_gpu_figures_kineto_and_kernel_table(imported: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    got = gpu_json(capsys, imported)
    all_kernels: dict[str, list[int]] = {}
    for i, path in enumerate(RANKS):
        gpu, launches, events = kineto_source(path)
        rank = next(r for r in got["ranks"] if r["node"] == f"rank-{i}")
        check_rank(rank, expected(gpu, launches))
        assert rank["rank"] == i and rank["verdict"]["host_overhead"] == "YES"
        # Per step: its length, and the kernels launched inside it.
        steps = sorted((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e["name"]) for e in events
                       if e.get("cat") == "user_annotation"
                       and e["name"].startswith("ProfilerStep#"))
        assert [s["name"] for s in rank["steps"]] == [s[2] for s in steps]
        for s, (lo, hi, _) in zip(rank["steps"], steps, strict=True):
            assert s["step_ns"] == hi - lo
            assert s["launches"] == sum(1 for g in gpu if g["kind"] == "kernel"
                                        and lo <= g["ts"] < hi and g["corr"] in launches)
        for g in gpu:
            if g["kind"] == "kernel":
                all_kernels.setdefault(g["name"], []).append(g["end"] - g["ts"])
    _, _, counts = nsys_source()
    c = sqlite3.connect(f"file:{NSYS}?mode=ro&immutable=1", uri=True)
    for name, s, e in c.execute("SELECT s.value, k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                                "JOIN StringIds s ON s.id = k.demangledName"):
        all_kernels.setdefault(name, []).append(e - s)
    grand = sum(sum(v) for v in all_kernels.values())
    top = max(all_kernels, key=lambda n: sum(all_kernels[n]))
    row = got["kernels"][0]
    durs = sorted(all_kernels[top])
    assert row["name"] == top and row["count"] == len(durs)
    assert row["total_ns"] == sum(durs)
    assert close(row["p50_ns"], statistics.median(durs))
    assert close(row["p99_ns"], statistics.quantiles(durs, n=100, method="inclusive")[-1])
    assert close(row["share_pct"], 100 * sum(durs) / grand)


def test_merge_of_two_imported_ranks_keeps_each_ranks_figures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dbs = []
    for i, path in enumerate(RANKS):
        db = tmp_path / f"r{i}.db"
        assert run(capsys, "import", str(path), "--db", str(db))[0] == 0
        dbs.append(db)
    alone = [gpu_json(capsys, db)["ranks"][0] for db in dbs]
    out = tmp_path / "cluster.db"
    merge(dbs, out)
    whole = gpu_json(capsys, out)
    merged = whole["ranks"]
    # The slower rank by idle share or step time is the one named, with its score.
    idle = {r["node"]: r["idle_pct"] for r in merged}
    assert whole["straggler"]["node"] == max(idle, key=lambda n: idle[n]) or \
        whole["straggler"]["metric"] == "step_ns"
    assert 0 < whole["straggler"]["score"] < 1
    assert [(r["node"], r["rank"]) for r in merged] == [("rank-0", 0), ("rank-1", 1)]
    for a, m in zip(alone, merged, strict=True):
        assert {k: v for k, v in a.items()} == m
    assert merge(dbs, out).inputs[0].added["gpu"] == 0  # merging again adds nothing


def test_a_version_1_database_migrates_and_merges(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "v1.db"
    with sqlite3.connect(old) as c:
        for stmt in schema._statements(schema.MIGRATIONS[0]):
            c.execute(stmt)
        c.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")
        c.execute("PRAGMA user_version = 1")
        c.execute("INSERT INTO nodes VALUES (1, 'old', 'u1', NULL, NULL, 1)")
        c.execute("INSERT INTO event_data VALUES (1099511627777, 5, 1, 7, 7, 100, 0, 0, 0, 0, "
                  "0, 0)")
        schema.seed_catalog(c)
    out = tmp_path / "m.db"
    merge([old], out)
    with sqlite3.connect(out) as c:
        assert c.execute("PRAGMA user_version").fetchone() == (schema.SCHEMA_VERSION,)
        assert c.execute("SELECT count(*) FROM events").fetchone() == (1,)
        assert c.execute("SELECT count(*) FROM gpu_data").fetchone() == (0,)
    conn = open_writer(old)  # migrates in place
    assert conn.execute("PRAGMA user_version").fetchone() == (schema.SCHEMA_VERSION,)
    assert conn.execute("SELECT count(*) FROM gpu_kernels").fetchone() == (0,)
    conn.close()
    rc, _, err = run(capsys, "import", str(RANKS[1]), "--db", str(old))
    assert rc == 0, err


def test_import_refuses_a_node_a_recorder_writes_under(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A recorded scenario's node (sessions from fleetd trace): an import under its name
    is refused, one line and exit 2, the file unchanged; another node name is fine."""
    import hashlib

    db = tmp_path / "recorded.db"
    shutil.copy(DATA.parent / "scenarios" / "quiet.db", db)
    node = sqlite3.connect(db).execute("SELECT name FROM nodes").fetchone()[0]
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    rc, _, err = run(capsys, "import", str(RANKS[0]), "--db", str(db), "--node", node)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2, err
    assert lines[0].startswith(f"fleetd: error: node {node!r} in this database holds")
    assert "fleetd merge" in lines[1]
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    rc, _, err = run(capsys, "import", str(RANKS[0]), "--db", str(db), "--node", "imported")
    assert rc == 0, err
    # Imports into one node stay possible: a second rank under the same imported name.
    rc, _, err = run(capsys, "import", str(RANKS[1]), "--db", str(db), "--node", "imported")
    assert rc == 0, err
