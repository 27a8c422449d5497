"""The fleet client's arithmetic: skew estimation and correction, merging, --reduce,
straggler scoring, node lists; and straggler ranking offline on a merged database."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from synth import MAIN, MS, STRESS, US, Timeline, base, training_loop

from fleetd.analyze.distributed import stragglers
from fleetd.errors import UsageError
from fleetd.fleet.combine import Merged, NodeRows, merge, reduce, unique_names
from fleetd.fleet.skew import Sample, correct_obj, correct_rows, estimate
from fleetd.fleet.targets import parse_nodes

from conftest import FLEETD, REPO

# ---- skew -----------------------------------------------------------------------------


def sample(offset_ns: int, out_ns: int, back_ns: int, server_ns: int = 10_000) -> Sample:
    """A sample whose request took out_ns on the way there and back_ns back."""
    t0 = 1_000_000_000
    t1 = t0 + out_ns + offset_ns
    t2 = t1 + server_ns
    return Sample(t0, t1, t2, t2 - offset_ns + back_ns)


def test_sample_arithmetic() -> None:
    s = sample(2_500_000_000, 300_000, 300_000)
    assert s.rtt_ns == 600_000 and s.offset_ns == 2_500_000_000
    lopsided = sample(0, 900_000, 100_000)
    # An uneven path biases one sample by half the difference: within rtt/2.
    assert abs(lopsided.offset_ns) == 400_000 <= lopsided.rtt_ns / 2


def test_estimate_trusts_the_lowest_rtt_samples() -> None:
    samples = [
        sample(5_000_000, 4_000_000, 200_000),  # the handshake: slow and lopsided
        sample(5_000_000, 120_000, 100_000),
        sample(5_000_000, 100_000, 110_000),
        sample(5_000_000, 2_000_000, 100_000),  # a delayed request
        sample(5_000_000, 105_000, 100_000),
    ]
    skew = estimate(samples)
    assert skew is not None
    assert abs(skew.offset_ns - 5_000_000) <= 10_000
    assert skew.error_ns == 205_000 / 2  # the best sample's rtt / 2
    assert skew.samples == 5 and skew.used == 3
    assert skew.to_json() == {"offset_ms": round(skew.offset_ms, 3),
                              "error_ms": round(skew.error_ms, 3)}


def test_estimate_without_samples_is_none() -> None:
    assert estimate([]) is None
    assert estimate([Sample(10, 0, 0, 5)]) is None  # negative rtt: a broken sample


def test_correct_rows_moves_ts_columns_only() -> None:
    rows = [[1_000_000, 5, 7_000, True, "x"], [2_000_000, 6, None, 9_000, "y"]]
    correct_rows(["ts_ns", "dur_ns", "start_ts_ns", "flag_ts_ns", "op"], rows, 1_000)
    assert rows == [[999_000, 5, 6_000, True, "x"], [1_999_000, 6, None, 8_000, "y"]]


def test_correct_obj_walks_nested_json_and_keeps_time_strings_in_step() -> None:
    ts = 1_750_000_000_000_000_000
    chain = {"ts_ns": ts, "dur_ns": 5, "time": "old",
             "evidence": [{"ts_ns": ts + 10, "kind": "spike"}], "window": {"start_ns": 3}}
    correct_obj(chain, 2_000_000_000)
    assert chain["ts_ns"] == ts - 2_000_000_000 and chain["dur_ns"] == 5
    assert chain["time"] == "2025-06-15T15:06:38.000000Z"
    assert chain["evidence"][0]["ts_ns"] == ts + 10 - 2_000_000_000
    assert chain["window"] == {"start_ns": 3}  # windows are each node's own clock


# ---- merge and --reduce ---------------------------------------------------------------


def test_merge_leads_with_node_and_keeps_mismatched_columns() -> None:
    merged = merge([
        NodeRows("a", ["op", "n"], [["x", 1]]),
        NodeRows("b", ["op", "n"], [["y", 2]]),
        NodeRows("c", ["op", "n", "extra"], [["z", 3, "e"]]),
        NodeRows("d", ["n"], [[4]]),
    ])
    assert merged.columns == ["node", "op", "n", "extra"]
    assert merged.rows == [["a", "x", 1, None], ["b", "y", 2, None], ["c", "z", 3, "e"],
                           ["d", None, 4, None]]
    by_node = {w.node: w for w in merged.warnings}
    assert set(by_node) == {"c", "d"} and {w.kind for w in merged.warnings} == {"columns"}
    assert "adds extra" in by_node["c"].error and "lacks op" in by_node["d"].error


def test_merge_uses_the_result_node_column_and_flags_truncation() -> None:
    merged = merge([NodeRows("a", ["id", "node", "ts_ns"], [["a:1", "a", 5]], truncated=True,
                             truncated_reason="rows")])
    assert merged.columns == ["node", "id", "ts_ns"] and merged.rows == [["a", "a:1", 5]]
    assert merged.truncated and merged.warnings[0].kind == "truncated"


def test_reduce_runs_sql_over_the_merged_rows() -> None:
    merged = Merged(["node", "op", "n", "n"], [["a", "x", 1, 10], ["b", "x", 3, 30],
                                               ["b", "y", 5, 50]])
    cols, rows = reduce(merged, "SELECT op, avg(n), sum(n_2) FROM merged GROUP BY op")
    assert cols == ["op", "avg(n)", "sum(n_2)"] and rows == [["x", 2.0, 40], ["y", 5.0, 50]]
    with pytest.raises(UsageError, match="no such column: missing") as err:
        reduce(merged, "SELECT missing FROM merged")
    assert "merged(node, op, n, n_2)" in (err.value.hint or "")
    with pytest.raises(UsageError, match="not authorized"):
        reduce(merged, "DELETE FROM merged")


def test_unique_names() -> None:
    assert unique_names(["node", "n", "n", "n_2", "node"]) == ["node", "n", "n_2", "n_2_2",
                                                               "node_2"]


# ---- node lists -----------------------------------------------------------------------


def test_parse_nodes_names_and_addresses() -> None:
    got = parse_nodes("10.0.0.1:7600, gpu-02=10.0.0.2:7601,[::1]:7602")
    assert [(t.name, t.host, t.port) for t in got] == [
        ("10.0.0.1:7600", "10.0.0.1", 7600), ("gpu-02", "10.0.0.2", 7601),
        ("[::1]:7602", "::1", 7602)]
    assert got[2].url("/x") == "https://[::1]:7602/x"
    for bad in ("", "host", "h:0", "h:1,h:1", "a=h:1,a=g:2"):
        with pytest.raises(UsageError):
            parse_nodes(bad)


def test_nodes_from_a_file(tmp_path: Path) -> None:
    listed = tmp_path / "nodes.txt"
    listed.write_text("# rack 1\ngpu-01=10.0.0.1:7600\n\n10.0.0.2:7600, 10.0.0.3:7600  # spare\n")
    assert [t.name for t in parse_nodes(f"@{listed}")] == [
        "gpu-01", "10.0.0.2:7600", "10.0.0.3:7600"]
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("fleet:\n  nodes:\n    - {name: a, address: 10.0.0.9:7600}\n")
    [t] = parse_nodes(f"@{fleet}")
    assert (t.name, t.host, t.port) == ("a", "10.0.0.9", 7600)
    (tmp_path / "empty").write_text("# nothing\n")
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    for bad, says in (("missing", "cannot read"), ("empty", "lists no node"),
                      ("bin", "is not text")):
        with pytest.raises(UsageError, match=says) as err:
            parse_nodes(f"@{tmp_path / bad}")
        assert str(tmp_path / bad) in str(err.value)


# ---- stragglers -----------------------------------------------------------------------


def features(calls: float, runq: float, **extra: Any) -> dict[str, Any]:
    return {"features": {"cuda_calls_per_s": calls, "runq_share": runq, "d_state_share": 0.0,
                         "launch_p50_ns": 2000, "launch_p99_ns": 9000, "sync_p50_ns": 6000,
                         "sync_p99_ns": 20000, **extra}}


def test_one_slow_node_is_flagged_with_its_metric_and_chain() -> None:
    profiles = {"a": features(1000, 0.03), "b": features(990, 0.031),
                "c": features(310, 0.69), "d": features(1005, 0.029)}
    chains = [{"node": "c", "root_cause": "cpu_contention", "severity": "HIGH",
               "culprit": {"comm": "hog", "pid": 7}}]
    ranked = stragglers.rank(profiles, {}, chains)
    assert [s["node"] for s in ranked][0] == "c"
    top = ranked[0]
    assert top["flagged"] is True and top["metric"] == "runq_share"
    assert top["score"] == pytest.approx(0.31 / 0.971, abs=1e-3)
    assert "cpu_contention" in top["reason"] and "culprit hog pid 7" in top["reason"]
    assert [s["flagged"] for s in ranked[1:]] == [False, False, False]


def test_identical_peers_do_not_hide_an_outlier() -> None:
    # MAD == 0: three nodes match exactly; the sigma floor still measures the fourth.
    profiles = {n: features(1000, 0.01) for n in "abc"} | {"d": features(400, 0.01)}
    ranked = stragglers.rank(profiles, {})
    assert [(s["node"], s["flagged"], s["metric"]) for s in ranked][0] == \
        ("d", True, "cuda_calls_per_s")


def test_spread_below_the_score_threshold_is_not_a_straggler() -> None:
    # A 15% slower node with a tight fleet: an outlier by z, but not slow enough.
    profiles = {"a": features(1000, 0.01), "b": features(1001, 0.01),
                "c": features(999, 0.01), "d": features(850, 0.01)}
    assert not any(s["flagged"] for s in stragglers.rank(profiles, {}))


def test_two_nodes_cannot_be_ranked() -> None:
    # Each worse on another metric: judged by the score alone, both were flagged.
    ranked = stragglers.rank({"a": features(1000, 0.5), "b": features(300, 0.0)}, {})
    assert [s["flagged"] for s in ranked] == [None, None], ranked
    by = {s["node"]: s for s in ranked}
    assert by["b"]["metric"] == "cuda_calls_per_s" and by["b"]["score"] == 0.3
    assert by["a"]["metric"] == "runq_share" and by["a"]["score"] == 0.5
    assert all("2 node(s) cannot be ranked" in s["reason"] for s in ranked), ranked
    assert all(s["z"] is None for s in ranked)


def test_unreachable_and_idle_nodes_are_never_reported_healthy() -> None:
    profiles = {"a": features(1000, 0.0), "b": features(1000, 0.0), "idle": {"features": {}}}
    ranked = stragglers.rank(profiles, {"gone": "timeout: no answer"})
    by = {s["node"]: s for s in ranked}
    assert by["gone"]["flagged"] is None and by["gone"]["reason"].startswith("unreachable")
    assert by["idle"]["flagged"] is None and by["idle"]["score"] is None
    assert [s["node"] for s in ranked][-2:] == ["idle", "gone"]  # the unreachable last
    assert all(set(s) >= {"node", "score", "flagged", "metric", "reason"} for s in ranked)


# ---- offline: a merged database ranks its nodes too ----------------------------------


def _write_fleet(path: Path) -> None:
    """gpu-01 shares its core with a hog every step; gpu-02..04 run undisturbed."""
    def hog(tl: Timeline, step: int, t: int) -> int:
        slice_ns = int(tl.rng.uniform(5, 7) * MS)
        tl.off_cpu(t + 100 * US, slice_ns, 0, STRESS)
        return tl.call("cudaStreamSynchronize", t, 2 * MS + slice_ns, always=True)

    tl = Timeline()
    base(tl)
    training_loop(tl, hook=hog, sync_every=1)
    tl.write(path, node="gpu-01")
    for node in ("gpu-02", "gpu-03", "gpu-04"):
        tl = Timeline()
        base(tl)
        training_loop(tl, sync_every=1)
        tl.write(path, node=node)


def test_explain_on_a_merged_database_groups_and_ranks_nodes(tmp_path: Path) -> None:
    db = tmp_path / "cluster.db"
    _write_fleet(db)
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}

    def explain(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([FLEETD, "explain", "--db", str(db), *args], capture_output=True,
                              text=True, env=env, cwd=REPO, timeout=120)

    proc = explain("--format", "json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["nodes"] == ["gpu-01", "gpu-02", "gpu-03", "gpu-04"] and obj["skew"] == {}
    flagged = [s["node"] for s in obj["stragglers"] if s["flagged"]]
    assert flagged == ["gpu-01"], obj["stragglers"]
    assert obj["stragglers"][0]["metric"] == "runq_share"
    assert "culprit stress pid" in obj["stragglers"][0]["reason"]
    assert {c["node"] for c in obj["chains"]} <= set(obj["nodes"])
    text = explain().stdout
    assert text.index("STRAGGLER gpu-01") < text.index("[HIGH] cpu_contention on gpu-01")
    assert f"culprit: stress pid {STRESS}" in text and f"pid {MAIN}" in text


# ---- failures and windows -------------------------------------------------------------


def test_only_transient_failures_are_retried() -> None:
    from fleetd.fleet.client import Failure, http_failure

    assert Failure("refused", "x").retryable and Failure("disconnected", "x").retryable
    assert not Failure("tls", "x").retryable and not Failure("timeout", "x").retryable
    assert not Failure("bad_json", "x").retryable
    busy = http_failure(429, b'{"error": {"code": "busy", "message": "too many queries"}}')
    assert busy.retryable and busy.code == "busy" and "HTTP 429 busy" in busy.message
    bad = http_failure(400, b'{"error": {"code": "bad_query", "message": "no such column",'
                            b' "hint": "see PRAGMA table_info(events)"}}')
    assert not bad.retryable and bad.hint == "see PRAGMA table_info(events)"
    assert "pass the fleet's bearer token" in (http_failure(401, b"").hint or "")
    assert http_failure(502, b"<html>bad gateway</html>").message.startswith("HTTP 502: <html>")


def test_absolute_windows_move_into_the_node_clock_and_since_does_not() -> None:
    from fleetd.store.bounds import Bounds

    w = Bounds.parse(None, "1750000000", "1750000060")
    assert w.absolute and w.params(2_500_000_000) == {
        "from": str(1_750_000_002_500_000_000), "to": str(1_750_000_062_500_000_000)}
    assert Bounds.parse("5m").params(2_500_000_000) == {"since": "5m"}
    assert Bounds().params(7) == {} and Bounds().label() == "whole recording"
    with pytest.raises(UsageError):
        Bounds.parse(None, "yesterday-ish")


def test_a_latency_outlier_that_costs_no_time_is_not_a_straggler() -> None:
    """The demo once flagged node-1 on sync p50 (8.7 us against a median of 4.0 us, at
    about 100 calls a second: 0.05% of its time) because two ranks shared its CPU; the
    same excess of milliseconds at that rate is a straggler."""
    fleet = {n: features(106, 0.01, sync_p50_ns=p) for n, p in
             (("a", 3500), ("b", 4000), ("c", 4100))}
    cheap = stragglers.rank({**fleet, "d": features(106, 0.01, sync_p50_ns=8700)}, {})
    assert not any(s["flagged"] for s in cheap), cheap
    assert {s["node"]: s["metrics"]["sync_p50_ns"]["z"] for s in cheap}["d"] >= 3.5
    costly = stragglers.rank({**fleet, "d": features(106, 0.01, sync_p50_ns=3_000_000)}, {})
    assert [(s["node"], s["flagged"], s["metric"]) for s in costly][0] == \
        ("d", True, "sync_p50_ns")
    launches = {n: features(106, 0.01, launches_per_s=20_000, launch_p50_ns=p) for n, p in
                (("a", 5000), ("b", 5200), ("c", 5100), ("d", 13000))}
    # 8 us more per launch at 20,000 launches a second: 16% of its time.
    assert [(s["node"], s["flagged"], s["metric"])
            for s in stragglers.rank(launches, {})][0] == ("d", True, "launch_p50_ns")
