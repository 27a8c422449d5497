"""Every local command on a merged file answers per node, as on the node's own file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from synth import SCENARIOS

from conftest import FLEETD, REPO

sys.path.insert(0, str(REPO / "tests"))

import perfetto_check  # noqa: E402

NODES = {"gpu-01": "cpu_hog", "gpu-02": "lock_wait", "gpu-03": "quiet"}


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    proc = subprocess.run([FLEETD, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


def as_json(*args: str) -> Any:
    return json.loads(fleetd(*args, "--format", "json").stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Path]:
    d = tmp_path_factory.mktemp("cluster")
    # The synthetic scenarios all record as node gpu-01: the merge names them.
    inputs = {node: SCENARIOS[s](d / f"{s}.db") for node, s in NODES.items()}
    renames = [f"--force-node={p}={n}" for n, p in inputs.items() if n != "gpu-01"]
    merged = d / "cluster.db"
    fleetd("merge", *map(str, inputs.values()), "-o", str(merged), *renames)
    return inputs, merged


def test_query_per_node(cluster: tuple[dict[str, Path], Path]) -> None:
    inputs, merged = cluster
    sql = "SELECT node, count(*) AS n, min(id) AS first FROM events GROUP BY node ORDER BY node"
    rows = as_json("query", "--db", str(merged), sql)["rows"]
    for node, n, first in rows:
        [[_, alone, own_first]] = as_json("query", "--db", str(inputs[node]), sql)["rows"]
        assert n == alone
        assert first == own_first.replace("gpu-01", node)  # ids keep their seq
    assert [r[0] for r in rows] == sorted(NODES)
    shortcut = as_json("query", "--db", str(merged), "--op", "cudaStreamSynchronize")
    assert {r[1] for r in shortcut["rows"]} == set(NODES)


def _chains(report: dict[str, Any], node: str) -> list[tuple[Any, ...]]:
    return sorted((c["root_cause"], c["severity"], c["victim"]["pid"],
                   (c["culprit"] or {}).get("pid")) for c in report["chains"]
                  if c["node"] == node)


def test_explain_per_node(cluster: tuple[dict[str, Path], Path]) -> None:
    inputs, merged = cluster
    whole = as_json("explain", "--db", str(merged))
    assert set(whole["nodes"]) == set(NODES)
    for node, path in inputs.items():
        alone = as_json("explain", "--db", str(path))
        assert _chains(whole, node) == _chains(alone, "gpu-01"), node
    assert ("cpu_contention", "HIGH", 1000, 2000) in _chains(whole, "gpu-01")
    assert ("lock_wait", "HIGH", 1000, 3000) in _chains(whole, "gpu-02")
    assert not [c for c in _chains(whole, "gpu-03") if c[1] == "HIGH"]


def test_ops_per_node(cluster: tuple[dict[str, Path], Path]) -> None:
    inputs, merged = cluster
    whole = as_json("ops", "--db", str(merged))
    cols = whole["columns"]
    node_col = cols.index("node")
    for node, path in inputs.items():
        alone = as_json("ops", "--db", str(path))
        mine = [r[:node_col] + r[node_col + 1:] for r in whole["rows"] if r[node_col] == node]
        theirs = [r[:node_col] + r[node_col + 1:] for r in alone["rows"]]
        assert mine == theirs, node


def test_export_of_a_merged_sample_is_one_timeline(
        cluster: tuple[dict[str, Path], Path], tmp_path: Path) -> None:
    _, merged = cluster
    out = tmp_path / "cluster.json"
    fleetd("export", "--db", str(merged), "-o", str(out))
    trace = perfetto_check.load(out)
    s = perfetto_check.validate(trace)
    assert sorted(s.processes.values()) == sorted(NODES)
    nodes = {n["name"]: n for n in trace["otherData"]["nodes"]}
    assert set(nodes) == set(NODES)
    # One time axis: every node's recording starts at the same wall time here.
    assert len({n["first_ns"] for n in nodes.values()}) == 1
    starts = {pid: min(ts for (p, _), sl in s.slices.items() if p == pid for ts, _, _ in sl)
              for pid in s.processes}
    assert max(starts.values()) - min(starts.values()) < 1000  # microseconds
    culprits = {m["args"]["node"]: m["args"]["root_cause"] for m in s.markers
                if m["args"]["severity"] == "HIGH"}
    assert culprits == {"gpu-01": "cpu_contention", "gpu-02": "lock_wait"}
    assert s.flows >= 2


def test_explain_store_on_a_merged_file(cluster: tuple[dict[str, Path], Path],
                                        tmp_path: Path) -> None:
    _, merged = cluster
    copy = tmp_path / "copy.db"
    copy.write_bytes(merged.read_bytes())
    fleetd("explain", "--db", str(copy), "--store")
    stored = as_json("query", "--db", str(copy),
                     "SELECT DISTINCT node FROM chains ORDER BY node")["rows"]
    assert [r[0] for r in stored] >= ["gpu-01", "gpu-02"]
    out = tmp_path / "stored.json"
    fleetd("export", "--db", str(copy), "-o", str(out), "--chains", "stored")
    s = perfetto_check.validate(perfetto_check.load(out))
    assert {m["args"]["node"] for m in s.markers} >= {"gpu-01", "gpu-02"}
