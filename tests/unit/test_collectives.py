"""Collective arrival (fleetd/analyze/distributed/collectives.py) over databases built by code:
the late
rank named, clocks corrected, ambiguity inside the clock error, both matchings, failed
collectives as a finding, the CLI, and a node's answer checked by the fleet client."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from collective_synth import COMM_HASH, Rank, four_ranks, write_job
from synth import MS, T0, US

from fleetd.analyze.distributed import collectives as coll
from fleetd.analyze.explain import explain
from fleetd.analyze.facade import Analysis
from fleetd.cli.main import main
from fleetd.store.db import open_reader
from fleetd.wire.collectives import check_reply
from fleetd.wire.failure import BadReply


def report(db: Path, clocks: dict[str, coll.Clock] | None = None) -> dict[str, Any]:
    conn = open_reader(db)
    try:
        return Analysis.of(conn).collectives(clocks)
    finally:
        conn.close()


def parts(db: Path) -> list[coll.NodeArrivals]:
    conn = open_reader(db)
    try:
        return Analysis.of(conn).arrivals()
    finally:
        conn.close()


def ranks_of(found: dict[str, Any]) -> dict[int, dict[str, Any]]:
    [comm] = found["communicators"]
    return {r["rank"]: r for r in comm["ranks"]}


# ---- the late rank ---------------------------------------------------------------------


def test_four_ranks_one_late_by_a_fixed_delay_is_named(tmp_path: Path) -> None:
    db = write_job(tmp_path, four_ranks(late_rank=2, delay=20 * MS))["gpu-01"]
    found = report(db)
    assert found["matching"] == "communicator" and found["events"] == 160
    [s] = found["stragglers"]
    assert (s["rank"], s["node"], s["pid"], s["comm"]) == (2, "gpu-01", 1002, "python3")
    assert s["share_last"] == 1.0 and s["judged"] == 40 and s["communicator"] == COMM_HASH
    # Lateness: its arrival minus the median of the others', jitter under 0.2 ms.
    assert abs(s["lateness_p50_ns"] - 20 * MS) < 200 * US
    ranks = ranks_of(found)
    assert all(r["count"] == 40 and r["bytes"] == 40 * 4096 and r["failures"] == 0
               for r in ranks.values())
    assert ranks[2]["last"] == 40 and all(ranks[r]["last"] == 0 for r in (0, 1, 3))
    assert all(abs(ranks[r]["lateness_p50_ns"]) < 200 * US for r in (0, 1, 3))
    [comm] = found["communicators"]
    assert (comm["nranks"], comm["judged"], comm["ambiguous"], comm["partial"]) == (
        4, 40, 0, False)


def test_a_rank_late_in_30_percent_is_no_straggler(tmp_path: Path) -> None:
    ranks = four_ranks(late_rank=1, delay=lambda k: 20 * MS if k % 10 < 3 else 0)
    found = report(write_job(tmp_path, ranks)["gpu-01"])
    assert found["stragglers"] == []
    assert ranks_of(found)[1]["last"] >= 12  # late, and last, in its 30 %
    assert ranks_of(found)[1]["last_share"] < coll.MIN_LAST_SHARE
    assert "no straggler" in found["verdict"]


def test_a_rank_last_by_microseconds_is_not_a_straggler(tmp_path: Path) -> None:
    # Always last, but by 0.3 ms: scheduling noise, under the 1 ms bar.
    found = report(write_job(tmp_path, four_ranks(delay=300 * US))["gpu-01"])
    assert found["stragglers"] == [] and ranks_of(found)[2]["last_share"] == 1.0
    assert "under the 1.0 ms bar" in found["communicators"][0]["verdict"]


def test_too_few_collectives_name_nobody(tmp_path: Path) -> None:
    found = report(write_job(tmp_path, four_ranks(), n=4)["gpu-01"])
    assert found["stragglers"] == [] and "fewer than the 5" in found["verdict"]


# ---- clocks ----------------------------------------------------------------------------


def test_a_node_clock_2_5_s_ahead_is_corrected_by_the_offset_map(tmp_path: Path) -> None:
    # Ranks 0, 1 on node-a; 2, 3 on node-b whose clock reads 2.5 s ahead; rank 1 is late.
    nodes = ("node-a", "node-a", "node-b", "node-b")
    merged = tmp_path / "merged.db"
    write_job(tmp_path, four_ranks(late_rank=1, delay=15 * MS, nodes=nodes),
              skew={"node-b": 2_500 * MS}, one_file=merged)
    # As recorded, node-b's ranks look 2.5 s late: the wrong node would be named.
    raw = report(merged)
    assert [s["node"] for s in raw["stragglers"]] == ["node-b"]
    clocks: dict[str, coll.Clock] = {"node-a": (0, 300 * US), "node-b": (2_500 * MS, 300 * US)}
    found = report(merged, clocks)
    [s] = found["stragglers"]
    assert (s["rank"], s["node"], s["pid"]) == (1, "node-a", 1001)
    assert abs(s["lateness_p50_ns"] - 15 * MS) < 300 * US
    assert found["clocks"]["node-b"] == {"offset_ns": 2_500 * MS, "error_ns": 300 * US}
    # Times in the report are in the reference clock.
    [comm] = found["communicators"]
    assert comm["last_ts_ns"] < raw["communicators"][0]["last_ts_ns"] - 2 * 10**9


def test_a_spread_inside_the_clock_error_is_ambiguous(tmp_path: Path) -> None:
    nodes = ("node-a", "node-a", "node-b", "node-b")
    merged = tmp_path / "merged.db"
    write_job(tmp_path, four_ranks(late_rank=2, delay=3 * MS, nodes=nodes), one_file=merged)
    # Each clock known to +/- 2 ms: a 3 ms margin across nodes proves nothing.
    found = report(merged, {"node-a": (0, 2 * MS), "node-b": (0, 2 * MS)})
    assert found["stragglers"] == []
    [comm] = found["communicators"]
    assert comm["ambiguous"] == comm["judged"] == 40
    assert ranks_of(found)[2]["last_ambiguous"] == 40 and ranks_of(found)[2]["last"] == 0
    assert "inside the clock error" in comm["verdict"]
    # The same spread with a tight clock names it; an unknown error never does.
    assert report(merged, {"node-a": (0, 100 * US), "node-b": (0, 100 * US)})["stragglers"]
    assert not report(merged, {"node-a": (0, 100 * US), "node-b": (0, None)})["stragglers"]


def test_a_merged_file_uses_the_clock_error_its_sessions_recorded(tmp_path: Path) -> None:
    nodes = ("node-a", "node-a", "node-b", "node-b")
    loose, tight = tmp_path / "loose.db", tmp_path / "tight.db"
    ranks = four_ranks(late_rank=3, delay=3 * MS, nodes=nodes)
    write_job(tmp_path, ranks, one_file=loose, clock_error={"node-a": 5 * MS, "node-b": MS})
    write_job(tmp_path, ranks, one_file=tight, clock_error={"node-a": 50 * US,
                                                           "node-b": 50 * US})
    assert report(loose)["stragglers"] == []
    assert [s["rank"] for s in report(tight)["stragglers"]] == [3]
    assert report(tight)["clocks"]["node-a"] == {"offset_ns": 0, "error_ns": 50 * US}


def test_ranks_on_one_node_share_a_clock(tmp_path: Path) -> None:
    # A large error bound does not blur ranks of one node: they read the same clock.
    merged = tmp_path / "m.db"
    write_job(tmp_path, four_ranks(delay=3 * MS), one_file=merged,
              clock_error={"gpu-01": 50 * MS})
    assert [s["rank"] for s in report(merged)["stragglers"]] == [2]


# ---- matching --------------------------------------------------------------------------


def test_communicator_matching_by_hash_and_sequence(tmp_path: Path) -> None:
    found = report(write_job(tmp_path, four_ranks())["gpu-01"])
    [comm] = found["communicators"]
    assert (comm["matching"], comm["key"], comm["instances"]) == ("communicator", COMM_HASH,
                                                                   40)
    assert comm["ops"] == {"ncclAllReduce": 160}


def test_torchrun_matching_without_a_communicator(tmp_path: Path) -> None:
    # No GPU: no communicator is created, the calls carry no comm_hash; the processes'
    # RANK/WORLD_SIZE match them.
    found = report(write_job(tmp_path, four_ranks(), matching="torchrun")["gpu-01"])
    assert found["matching"] == "torchrun"
    [comm] = found["communicators"]
    assert comm["matching"] == "torchrun" and comm["key"] == "-/4" and comm["nranks"] == 4
    assert [s["rank"] for s in found["stragglers"]] == [2]


def test_torchrun_ranks_come_from_the_process_not_the_pid_order(tmp_path: Path) -> None:
    ranks = [Rank("gpu-01", 1000 + i, i, 20 * MS if i == 1 else 0, proc_rank=3 - i)
             for i in range(4)]
    found = report(write_job(tmp_path, ranks, matching="torchrun")["gpu-01"])
    [s] = found["stragglers"]
    assert (s["rank"], s["pid"]) == (2, 1001)  # pid 1001 runs with RANK=2


def test_torchrun_jobs_are_told_apart_by_their_job_identity(tmp_path: Path) -> None:
    db = write_job(tmp_path, four_ranks(), matching="torchrun")["gpu-01"]
    with sqlite3.connect(db) as conn:
        cols = {r[1] for r in conn.execute("PRAGMA table_info(process_data)")}
        if "job" not in cols:
            pytest.skip("process_data.job not in this schema yet")
        conn.execute("UPDATE process_data SET job = CASE WHEN pid < 1002 THEN 'run-a' "
                     "ELSE 'run-b' END")
    found = report(db)
    assert sorted(c["key"] for c in found["communicators"]) == ["run-a/4", "run-b/4"]
    assert all(c["partial"] for c in found["communicators"])


def test_processes_without_a_rank_are_not_matched(tmp_path: Path) -> None:
    ranks = [Rank("gpu-01", 1000 + i, i, proc_rank=None) for i in range(4)]
    found = report(write_job(tmp_path, ranks, matching="torchrun")["gpu-01"])
    assert found["communicators"] == [] and found["unmatched"] == 160
    assert any("not matched" in n for n in found["notes"])
    assert found["verdict"] == "160 collective call(s), none matched across ranks"


def test_calls_without_a_sequence_number_are_numbered_in_time_order(tmp_path: Path) -> None:
    found = report(write_job(tmp_path, four_ranks(), with_seq=False)["gpu-01"])
    assert [s["rank"] for s in found["stragglers"]] == [2]
    assert any("no sequence number" in n for n in found["notes"])


def test_a_rank_never_seen_makes_the_communicator_partial(tmp_path: Path) -> None:
    # Ranks 0-3 on two nodes, only node-a's file is read: 2 of 4 ranks seen.
    nodes = ("node-a", "node-a", "node-b", "node-b")
    paths = write_job(tmp_path, four_ranks(late_rank=0, nodes=nodes))
    found = report(paths["node-a"])
    [comm] = found["communicators"]
    assert comm["partial"] and comm["ranks_seen"] == 2 and comm["nranks"] == 4
    assert any("rank(s) 2-3 of 4 never seen" in n for n in found["notes"])
    assert [s["rank"] for s in found["stragglers"]] == [0]  # among the ranks seen


# ---- failed collectives ----------------------------------------------------------------


def test_failed_collectives_are_a_warning_and_a_chain(tmp_path: Path) -> None:
    db = write_job(tmp_path, four_ranks(ret=4))["gpu-01"]
    got = explain(db)
    lines = [w for w in got["warnings"] if "NCCL call(s)" in w]
    assert len(lines) == 4
    assert ("gpu-01: 40 of 40 NCCL call(s) of python3 (pid 1000) failed: ncclAllReduce ret 4 "
            "ncclInvalidArgument x40") in lines
    chains = [c for c in got["chains"] if c["root_cause"] == "nccl_failures"]
    # They fail within the collective's ~20 ms: no stall, so a finding but LOW.
    assert len(chains) == 4 and {c["severity"] for c in chains} == {"LOW"}
    c = chains[0]
    assert c["detail"]["longest_failed_ns"] < 100 * MS
    assert c["detail"]["by_error"] == [{"op": "ncclAllReduce", "ret": 4,
                                        "error": "ncclInvalidArgument", "count": 40}]
    kinds = [e["kind"] for e in c["evidence"]]
    assert kinds[0] == "nccl_error" and kinds.count("call") == 3
    assert "ncclInvalidArgument" in c["summary"] and "NCCL_DEBUG" in c["fixes"][0]
    assert not got["quiet"]
    # The arrivals of failed calls still count (without a GPU every call fails at once).
    found = report(db)
    assert [s["rank"] for s in found["stragglers"]] == [2]
    assert all(r["failures"] == 40 for r in ranks_of(found).values())


def test_failures_that_held_the_ranks_are_high(tmp_path: Path) -> None:
    # Rank 2 is 150 ms late, so the others' failing calls block that long first.
    got = explain(write_job(tmp_path, four_ranks(ret=4, delay=150 * MS))["gpu-01"])
    chains = {c["victim"]["pid"]: c for c in got["chains"]
              if c["root_cause"] == "nccl_failures"}
    assert chains[1000]["severity"] == "HIGH"
    assert chains[1000]["detail"]["longest_failed_ns"] >= 150 * MS


def test_pid_filter_keeps_only_that_process_failures(tmp_path: Path) -> None:
    got = explain(write_job(tmp_path, four_ranks(ret=5))["gpu-01"], pid=1003)
    assert [w for w in got["warnings"] if "NCCL" in w] == [
        "gpu-01: 40 of 40 NCCL call(s) of python3 (pid 1003) failed: ncclAllReduce ret 5 "
        "ncclInvalidUsage x40"]


def test_successful_collectives_are_quiet(tmp_path: Path) -> None:
    got = explain(write_job(tmp_path, four_ranks(delay=0))["gpu-01"])
    assert not [c for c in got["chains"] if c["root_cause"] == "nccl_failures"]
    assert not [w for w in got["warnings"] if "NCCL" in w]


# ---- the CLI ---------------------------------------------------------------------------


def test_collectives_command_table_and_json(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    db = write_job(tmp_path, four_ranks(late_rank=3))["gpu-01"]
    assert main(["collectives", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    header, _, *lines = out.splitlines()
    assert header.split()[:6] == ["communicator", "matching", "rank", "node", "pid", "comm"]
    row3 = next(line for line in lines if line.split()[2:3] == ["3"])
    assert "YES" in row3 and "100%" in row3 and "+20." in row3
    assert "verdict: straggler: rank 3" in out
    assert main(["collectives", "--db", str(db), "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["columns"] == list(coll.ROW_COLUMNS) and len(got["rows"]) == 4
    assert got["stragglers"][0]["rank"] == 3 and got["window"]["label"] == "whole recording"
    assert got["communicators"][0]["ranks"][3]["last_share"] == 1.0
    assert main(["collectives", "--db", str(db), "--format", "ndjson"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["straggler"] for r in rows] == [False, False, False, True]
    assert main(["collectives", "--db", str(db), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ",".join(coll.ROW_COLUMNS)


def test_explain_reports_the_collective_straggler_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = write_job(tmp_path, four_ranks(late_rank=1))["gpu-01"]
    assert main(["explain", "--db", str(db), "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    first = got["stragglers"][0]
    assert (first["metric"], first["rank"], first["node"], first["pid"], first["flagged"]) == (
        "collective_arrival", 1, "gpu-01", 1001, True)
    assert first["share_last"] == 1.0 and first["score"] == 0.0
    assert got["collectives"]["stragglers"][0]["rank"] == 1
    assert main(["explain", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "STRAGGLER rank 1 on gpu-01, pid 1001 (python3): last in 100% of 40" in out
    assert out.index("STRAGGLER rank 1") < out.index("per-process breakdown")


def test_explain_of_a_merged_file_names_the_rank_and_its_node(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = ("node-a", "node-a", "node-b", "node-b")
    paths = write_job(tmp_path, four_ranks(late_rank=2, nodes=nodes),
                      clock_error={"node-a": 100 * US, "node-b": 100 * US})
    merged = tmp_path / "cluster.db"
    assert main(["merge", *map(str, paths.values()), "-o", str(merged)]) == 0
    capsys.readouterr()
    assert main(["explain", "--db", str(merged), "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    first = got["stragglers"][0]
    assert (first["metric"], first["rank"], first["node"]) == ("collective_arrival", 2, "node-b")
    assert {s["node"] for s in got["stragglers"][1:]} == {"node-a", "node-b"}  # node ranking


def test_quiet_run_has_no_straggler_in_explain(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    db = write_job(tmp_path, four_ranks(delay=0))["gpu-01"]
    assert main(["explain", "--db", str(db), "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert "stragglers" not in got and got["collectives"]["stragglers"] == []
    assert got["collectives"]["verdict"].startswith("no straggler")


# ---- a node's answer, checked ----------------------------------------------------------


def node_answer(tmp_path: Path) -> dict[str, Any]:
    db = write_job(tmp_path, four_ranks(), n=10)["gpu-01"]
    [part] = parts(db)
    return json.loads(json.dumps({"node": "gpu-01", **part.to_json(), "warnings": []}))


def test_a_good_answer_round_trips(tmp_path: Path) -> None:
    reply = node_answer(tmp_path)
    got = check_reply(reply, "gpu-01")
    assert len(got.arrivals) == 40 and set(got.procs) == {1000, 1001, 1002, 1003}
    assert got.arrivals[0].comm_hash == COMM_HASH and got.arrivals[0].seq == 1
    cut = check_reply(reply, "gpu-01", max_rows=5)  # a node that ignores the limit is cut
    assert len(cut.arrivals) == 5 and cut.truncated and cut.truncated_reason == "rows"


@pytest.mark.parametrize(("where", "value", "message"), [
    ((0, 0), "1", "ts_ns: expected an integer"),
    ((0, 0), 2**70, "ts_ns"),
    ((0, 1), -5, "dur_ns"),
    ((0, 4), "rm -rf /", "not an NCCL collective"),
    ((0, 5), True, "ret: expected an integer"),
    ((0, 7), 0, "seq"),
    ((0, 8), "0xZZ", "comm_ptr"),
    ((0, 9), "0123456789ABCDEF", "comm_hash"),
    ((0, 9), None, "come together"),
    ((0, 10), 9, "not below nranks"),
    ((0, 11), 0, "nranks"),
    ((0,), [1, 2], "expected a list of 12"),
])
def test_a_bad_value_rejects_the_answer(tmp_path: Path, where: tuple[int, ...], value: Any,
                                        message: str) -> None:
    reply = node_answer(tmp_path)
    target: Any = reply["rows"]
    for i in where[:-1]:
        target = target[i]
    target[where[-1]] = value
    with pytest.raises(BadReply, match=message):
        check_reply(reply, "gpu-01")


def test_bad_shapes_and_strings(tmp_path: Path) -> None:
    reply = node_answer(tmp_path)
    for key, value, message in (("columns", ["ts_ns"], "columns"),
                                ("rows", {"a": 1}, "rows: expected a list"),
                                ("truncated", "yes", "truncated"),
                                ("clock_error_ns", -1, "clock_error_ns"),
                                ("processes", [], "processes")):
        bad = json.loads(json.dumps(reply))
        bad[key] = value
        with pytest.raises(BadReply, match=message):
            check_reply(bad, "gpu-01")
    many = json.loads(json.dumps(reply))
    many["processes"]["rows"] = [[1, "x", 0, 1, None]] * 70_000
    with pytest.raises(BadReply, match="above the limit"):
        check_reply(many, "gpu-01")
    odd = json.loads(json.dumps(reply))
    odd["processes"]["rows"][0][1] = "py\x1b[31mthon" + "x" * 500
    odd["processes"]["rows"][0][4] = "job\nforged line"
    got = check_reply(odd, "gpu-01")
    p = got.procs[odd["processes"]["rows"][0][0]]
    assert p.comm is not None and p.comm.isprintable() and len(p.comm) <= 64
    assert p.job == "job?forged line"


def test_max_rows_beyond_the_agents_limit_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["collectives", "--nodes", "127.0.0.1:9", "--max-rows", "300000"]) == 2
    assert "above the agents' limit of 200000" in capsys.readouterr().err


def test_local_max_rows_keeps_the_newest_calls(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    db = write_job(tmp_path, four_ranks())["gpu-01"]
    assert main(["collectives", "--db", str(db), "--max-rows", "40", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["events"] == 40 and got["truncated"] is True
    assert any("only the newest 40" in n for n in got["notes"])
    # The 10 newest instances, every rank seen: still judged, too few rows for more.
    assert got["communicators"][0]["judged"] == 10


def test_a_torchrun_process_with_two_communicators_numbers_each(tmp_path: Path) -> None:
    db = tmp_path / "two.db"
    # The first communicator's rank 2 is late; on the second (first used 1 s later), rank 0.
    write_job(tmp_path, four_ranks(late_rank=2), matching="torchrun", one_file=db)
    write_job(tmp_path, four_ranks(late_rank=0), matching="torchrun", one_file=db,
              comm_ptr="0x55d0c0ffef00", start=T0 + 10**9, n=10)
    found = report(db)
    comms = {c["key"]: c for c in found["communicators"]}
    assert set(comms) == {"-/4", "-/4#2"}
    assert comms["-/4"]["instances"] == 40 and comms["-/4#2"]["instances"] == 10
    assert comms["-/4"]["straggler"]["rank"] == 2 and comms["-/4#2"]["straggler"]["rank"] == 0
    assert [s["rank"] for s in found["stragglers"]] == [2, 0]  # one entry per process


def test_nodes_on_one_boot_share_one_clock() -> None:
    from fleetd.analyze.distributed import collectives as coll

    boot, other = "0" * 8 + "-1111-2222-3333-" + "4" * 12, "f" * 8 + "-1111-2222-3333-" + "4" * 12
    # a and b run on one machine; b's wall clock is set 2.5 s ahead (as libfaketime does):
    # their wall-minus-monotonic offsets say so exactly. c is another machine.
    mono = {"a": 1_000_000_000, "b": 3_500_000_000, "c": 7}
    parts = [coll.NodeArrivals(n, [], {}, None, boot_id=bt, mono_offset_ns=mono[n])
             for n, bt in (("a", boot), ("b", boot), ("c", other))]
    measured = {"a": coll.Clock(300_000, 900_000), "b": coll.Clock(2_499_800_000, 400_000),
                "c": coll.Clock(2_500_000_000, 500_000)}
    got = coll.one_machine(measured, parts)
    # Placed against b (the better measurement) by the monotonic offsets: exact.
    assert got["b"] == coll.Clock(2_499_800_000, 400_000, boot)
    assert got["a"] == coll.Clock(2_499_800_000 - 2_500_000_000, 400_000, boot)
    assert coll.combined_error("a", "b", got) == 0
    assert coll.combined_error("a", "c", got) == 900_000
    assert got["c"] == coll.Clock(2_500_000_000, 500_000, other)


def test_a_peer_rank_is_never_a_host_chains_culprit_but_the_next_one_is() -> None:
    # The shape measured in CI: ranks sharing the machine's two cores outrank, by time,
    # the hog in the late rank's own CPU quota.
    def who(pid: int, comm: str) -> dict[str, Any]:
        return {"pid": pid, "comm": comm, "self": False, "tid": pid, "thread": comm}

    chains = [
        {"node": "h2", "root_cause": "cpu_contention", "severity": "HIGH",
         "victim": {"pid": 12}, "culprit": who(10, "python"),
         "culprits": [{**who(10, "python"), "share": 0.7}, {**who(13, "python")},
                      {**who(99, "fleetd-hog"), "share": 0.1}]},
        {"node": "h2", "root_cause": "cpu_contention", "severity": "LOW",
         "victim": {"pid": 12}, "culprit": who(11, "python"),
         "culprits": [who(11, "python")]},  # only peers: left out
        {"node": "h1", "root_cause": "cpu_contention", "severity": "HIGH",
         "victim": {"pid": 5}, "culprit": who(7, "other")},  # another node
    ]
    got = coll.host_chains("h2", 12, chains, peers=[10, 11, 13])
    assert [c["culprit"] for c in got] == [who(99, "fleetd-hog")]
    assert chains[0]["culprit"]["pid"] == 10  # the report's own chain is left as it was
    assert coll.host_chains("h2", 12, chains, peers=[]) == chains[:2]
