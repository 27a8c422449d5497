"""The hang verdict (fleetd/fleet/hang.py over fleetd/analyze/distributed/hangs.py), from node
answers
shaped as GET /api/v1/ranks gives them: stopped, exited and D-state ranks, quiet jobs,
skewed clocks, unmatched send/recv, restarted jobs, and hostile node values."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fleetd.fleet.hang import verdict
from fleetd.wire.ranks import MAX_RANKS, check_ranks_reply, top_chain

S = 1_000_000_000
NOW = 1_800_000_000 * S  # the node's own clock


def coll(seq: int, age_s: float, op: str = "ncclAllReduce", *, comm_hash: str | None = None,
         rank: int | None = None, nranks: int | None = None, now: int = NOW,
         communicator: str = "0x0") -> dict[str, Any]:
    age = int(age_s * S)
    return {"communicator": communicator, "comm_hash": comm_hash, "rank": rank,
            "nranks": nranks, "op": op, "seq": seq, "ts_ns": now - age, "age_ns": age,
            "dur_ns": 20_000, "ret": 4, "calls": seq}


def p2p(op: str, peer: int, seq: int, age_s: float, now: int = NOW) -> dict[str, Any]:
    age = int(age_s * S)
    return {"communicator": "0x0", "comm_hash": None, "op": op, "peer": peer, "seq": seq,
            "ts_ns": now - age, "age_ns": age, "dur_ns": 1_000, "ret": 4, "calls": seq}


def rank(pid: int, r: int | None, colls: list[dict[str, Any]], *, state: str = "sleeping",
         world: int | None = 4, job: str | None = "job-7", wchan: str | None = None,
         exit_code: int | None = None, exited_age_s: float | None = None,
         last: tuple[str, float] | None = None, sends: list[dict[str, Any]] | None = None,
         now: int = NOW) -> dict[str, Any]:
    lc = None
    if last is not None:
        lc = {"op": last[0], "ts_ns": now - int(last[1] * S), "age_ns": int(last[1] * S),
              "dur_ns": 5_000, "ret": 0}
    elif colls:
        c = min(colls, key=lambda c: c["age_ns"])
        lc = {"op": c["op"], "ts_ns": c["ts_ns"], "age_ns": c["age_ns"], "dur_ns": 5_000,
              "ret": c["ret"]}
    return {"pid": pid, "comm": "python", "rank": r, "local_rank": r, "world_size": world,
            "job": job, "state": state, "state_code": None, "wchan": wchan,
            "exit_code": exit_code if state == "exited" else None,
            "exited_age_ns": int(exited_age_s * S) if exited_age_s is not None else None,
            "collectives": colls, "last_call": lc, "p2p": sends or []}


def answer(node: str, *ranks: dict[str, Any], now: int = NOW) -> tuple[str, dict[str, Any]]:
    return node, {"node": node, "now_ns": now, "tracing": True, "ranks": list(ranks),
                  "dropped": 0}


def four_ranks(stopped_state: str = "stopped", behind_s: float = 12.1, wait_s: float = 12.0,
               **kw: Any) -> list[tuple[str, dict[str, Any]]]:
    """Ranks 0, 1 on node-a; 2, 3 on node-b; rank 2 is one collective behind."""
    return [
        answer("node-a", rank(100, 0, [coll(57, wait_s)]), rank(101, 1, [coll(57, wait_s)])),
        answer("node-b", rank(200, 2, [coll(56, behind_s, "ncclBroadcast")],
                              state=stopped_state, wchan="do_signal_stop", **kw),
               rank(201, 3, [coll(57, wait_s - 0.5)])),
    ]


# ---- collectives ------------------------------------------------------------------------


def test_a_stopped_rank_is_named_with_where_it_is_and_who_waits() -> None:
    v = verdict(four_ranks(), hang_after_s=10)
    assert v["status"] == "hang" and len(v["hangs"]) == 1
    h = v["hangs"][0]
    assert (h["kind"], h["matching"], h["seq"], h["op"]) == ("collective", "torchrun", 57,
                                                              "ncclAllReduce")
    [c] = h["culprits"]
    assert (c["node"], c["pid"], c["rank"], c["state"], c["seq"]) == ("node-b", 200, 2,
                                                                       "stopped", 56)
    assert c["wchan"] == "do_signal_stop" and c["last_call"]["op"] == "ncclBroadcast"
    assert [(w["node"], w["rank"]) for w in h["waiting"]] == [("node-a", 0), ("node-a", 1),
                                                             ("node-b", 3)]
    assert h["waited_s"] == 12.0  # the earliest arrival at collective 57
    assert "rank 2 (node-b pid 200, stopped in do_signal_stop) never arrived at collective " \
        "57" in v["verdict"]
    assert v["groups"][0]["ranks"] == [0, 1, 2, 3] and v["groups"][0]["seq"] == 57


def test_a_wait_shorter_than_the_limit_is_no_hang() -> None:
    v = verdict(four_ranks(behind_s=5.1, wait_s=5.0), hang_after_s=10)
    assert v["status"] == "ok" and v["hangs"] == []
    assert v["verdict"] == "no hang: job job-7 at collective 57"


def test_a_running_laggard_is_named_too() -> None:
    v = verdict(four_ranks(stopped_state="running"), hang_after_s=10)
    assert v["hangs"][0]["culprits"][0]["state"] == "running"


def test_an_exited_rank_is_named_exited() -> None:
    v = verdict(four_ranks(stopped_state="exited", exited_age_s=11.0), hang_after_s=10)
    [c] = v["hangs"][0]["culprits"]
    assert c["state"] == "exited" and c["exit_code"] is None and c["exited_s_ago"] == 11.0
    assert "killed by a signal" in v["verdict"]


# ---- no progress while a rank is stuck (all at the same collective) ---------------------


@pytest.mark.parametrize(("state", "wchan", "exit_code"), [
    ("stopped", "do_signal_stop", None), ("d_state", "folio_wait_bit_common", None),
    ("exited", None, 1), ("exited", None, None)])
def test_no_progress_while_a_rank_is_stuck_names_it(state: str, wchan: str | None,
                                                     exit_code: int | None) -> None:
    replies = [answer("node-a", rank(100, 0, [coll(57, 20)]), rank(101, 1, [coll(57, 20.1)])),
               answer("node-b", rank(200, 2, [coll(57, 20.2)], state=state, wchan=wchan,
                                     exit_code=exit_code, exited_age_s=19),
                      rank(201, 3, [coll(57, 20)]))]
    v = verdict(replies, hang_after_s=15)
    [h] = v["hangs"]
    assert h["kind"] == "stalled" and h["seq"] == 58  # the next collective nobody entered
    assert [(c["pid"], c["state"]) for c in h["culprits"]] == [(200, state)]
    assert {w["rank"] for w in h["waiting"]} == {0, 1, 3} and h["waited_s"] == 20.0
    assert verdict(replies, hang_after_s=25)["status"] == "ok"


def test_a_quiet_job_and_an_idle_job_are_no_hang() -> None:
    busy = [answer("node-a", *(rank(100 + r, r, [coll(900 + (r % 2), 0.002 * r)])
                               for r in range(4)))]
    v = verdict(busy, hang_after_s=1)
    assert v["status"] == "ok" and v["groups"][0]["seq"] == 901
    # Between collectives for a long time, everyone alive and sleeping: idle, not hung.
    idle = [answer("node-a", *(rank(100 + r, r, [coll(900, 300)]) for r in range(4)))]
    assert verdict(idle, hang_after_s=10)["status"] == "ok"
    assert verdict([], hang_after_s=10)["verdict"].startswith("no hang: no traced process")


def test_a_rank_that_finished_cleanly_is_not_a_culprit() -> None:
    """Rank 0 writes the checkpoint while the others have exited 0: the job is ending."""
    replies = [answer("node-a", rank(100, 0, [coll(500, 60)], state="running"),
                      *(rank(100 + r, r, [coll(500, 60)], state="exited", exit_code=0,
                             exited_age_s=55) for r in (1, 2, 3)))]
    assert verdict(replies, hang_after_s=10)["status"] == "ok"


def test_a_job_that_died_while_watched_names_the_first_death() -> None:
    replies = [answer("node-a",
                      rank(100, 0, [coll(80, 3.0)], state="exited", exit_code=3,
                           exited_age_s=2.0),
                      rank(101, 1, [coll(79, 3.2)], state="exited", exit_code=None,
                           exited_age_s=2.01),
                      rank(102, 2, [coll(80, 3.0)], state="exited", exit_code=3,
                           exited_age_s=1.99))]
    v = verdict(replies, hang_after_s=10)
    [h] = v["hangs"]
    assert h["kind"] == "exited" and h["culprits"][0]["pid"] == 101
    assert h["culprits"][0]["state"] == "exited" and len(h["waiting"]) == 2
    # Long dead before the watch began: not reported again and again.
    assert verdict(replies, hang_after_s=10, deaths_within_s=1)["status"] == "ok"
    # A job whose ranks all exited 0 finished.
    clean = copy.deepcopy(replies)
    for r in clean[0][1]["ranks"]:
        r["exit_code"] = 0
    assert verdict(clean, hang_after_s=10)["status"] == "ok"


def test_a_restarted_job_is_judged_by_its_live_ranks() -> None:
    """torchrun restarted the job under the same id: the dead generation, far ahead in
    collective numbers, must not make the new one look behind."""
    old = [rank(100 + r, r, [coll(1000, 600)], state="exited", exit_code=None,
                exited_age_s=590) for r in range(4)]
    new = [rank(200 + r, r, [coll(5, 0.01)]) for r in range(4)]
    v = verdict([answer("node-a", *old, *new)], hang_after_s=10)
    assert v["status"] == "ok" and v["groups"][0]["seq"] == 5


# ---- clocks -----------------------------------------------------------------------------


def test_skewed_node_clocks_do_not_change_the_verdict() -> None:
    """node-b's clock is an hour ahead: its timestamps are far off, its ages are not."""
    skew = 3600 * S
    b_now = NOW + skew
    replies = [
        answer("node-a", rank(100, 0, [coll(57, 12)]), rank(101, 1, [coll(57, 12)])),
        answer("node-b", rank(200, 2, [coll(56, 12.1, now=b_now)], state="stopped",
                              now=b_now),
               rank(201, 3, [coll(57, 11.5, now=b_now)], now=b_now), now=b_now),
    ]
    v = verdict(replies, hang_after_s=10)
    assert v["hangs"][0]["culprits"][0]["pid"] == 200 and v["hangs"][0]["waited_s"] == 12.0
    # And a node an hour behind does not make fresh arrivals look an hour old.
    replies[1] = answer("node-b", rank(200, 2, [coll(57, 0.2, now=NOW - skew)],
                                       now=NOW - skew),
                        rank(201, 3, [coll(57, 0.1, now=NOW - skew)], now=NOW - skew),
                        now=NOW - skew)
    replies[0] = answer("node-a", rank(100, 0, [coll(57, 0.3)]), rank(101, 1, [coll(57, 0.1)]))
    assert verdict(replies, hang_after_s=10)["status"] == "ok"


# ---- communicators ----------------------------------------------------------------------


def test_ranks_match_by_communicator_hash_across_nodes() -> None:
    h = "1f2e3d4c5b6a7988"
    a = [rank(100 + i, None, [coll(12, 30, comm_hash=h, rank=i, nranks=3,
                                   communicator=f"0x55{i}")], job=None, world=None)
         for i in (0, 1)]
    b = rank(300, None, [coll(11, 31, comm_hash=h, rank=2, nranks=3, communicator="0x77")],
             job=None, world=None, state="d_state", wchan="nvidia_wait")
    v = verdict([answer("node-a", *a), answer("node-b", b)], hang_after_s=10)
    [hang] = v["hangs"]
    assert hang["matching"] == "communicator" and hang["group"] == f"communicator {h}"
    assert hang["culprits"][0]["rank"] == 2 and hang["culprits"][0]["state"] == "d_state"
    assert hang["culprits"][0]["wchan"] == "nvidia_wait"


def test_missing_ranks_are_a_warning_not_a_verdict() -> None:
    v = verdict([answer("node-a", rank(100, 0, [coll(9, 40)]), rank(101, 1, [coll(9, 40)]))],
                hang_after_s=10)
    assert v["status"] == "ok"
    assert v["warnings"] == ["job job-7: rank(s) 2, 3 of 4 not seen (their node did not "
                             "answer, or they are not traced)"]


# ---- send / recv ------------------------------------------------------------------------


def test_an_unmatched_send_names_the_rank_that_never_received() -> None:
    r0 = rank(100, 0, [], world=2, last=("ncclSend", 20),
              sends=[p2p("ncclSend", 1, 5, 20), p2p("ncclRecv", 1, 5, 20.1)])
    r1 = rank(101, 1, [], world=2, state="stopped", last=("ncclRecv", 25),
              sends=[p2p("ncclSend", 0, 5, 25.1), p2p("ncclRecv", 0, 4, 25)])
    v = verdict([answer("node-a", r0), answer("node-b", r1)], hang_after_s=10)
    [h] = v["hangs"]
    assert (h["kind"], h["op"], h["peer_op"], h["seq"]) == ("p2p", "ncclSend", "ncclRecv", 5)
    assert h["culprits"][0]["pid"] == 101 and h["culprits"][0]["state"] == "stopped"
    assert h["waiting"][0]["pid"] == 100 and h["waited_s"] == 20.0
    assert "has not made ncclRecv #5" in h["summary"]
    # Matched pairs and nobody stuck: nothing.
    r1["p2p"][1]["seq"], r1["state"] = 5, "sleeping"
    assert verdict([answer("node-a", r0), answer("node-b", r1)],
                   hang_after_s=10)["status"] == "ok"


def test_a_receive_without_its_send_is_reported_from_the_receiver() -> None:
    r0 = rank(100, 0, [], world=2, last=("ncclRecv", 30), sends=[p2p("ncclRecv", 1, 3, 30)])
    r1 = rank(101, 1, [], world=2, last=("cudaLaunchKernel", 30),
              sends=[p2p("ncclSend", 0, 2, 31)])
    [h] = verdict([answer("a", r0, r1)], hang_after_s=10)["hangs"]
    assert (h["op"], h["peer_op"], h["seq"]) == ("ncclRecv", "ncclSend", 3)
    assert h["culprits"][0]["rank"] == 1 and h["culprits"][0]["seq"] == 2


# ---- hostile nodes ----------------------------------------------------------------------


def _with(mutate: Any) -> tuple[str, dict[str, Any]]:
    node, reply = four_ranks()[1]
    reply = copy.deepcopy(reply)
    mutate(reply)
    return node, reply


HOSTILE = {
    "ranks not a list": lambda r: r.update(ranks={"0": 1}),
    "rank not an object": lambda r: r["ranks"].append([1, 2]),
    "pid a string": lambda r: r["ranks"][0].update(pid="200"),
    "pid a bool": lambda r: r["ranks"][0].update(pid=True),
    "pid zero": lambda r: r["ranks"][0].update(pid=0),
    "seq negative": lambda r: r["ranks"][0]["collectives"][0].update(seq=-1),
    "age beyond 64 bits": lambda r: r["ranks"][0]["collectives"][0].update(age_ns=2**70),
    "age a float": lambda r: r["ranks"][0]["collectives"][0].update(age_ns=1e300),
    "state unknown": lambda r: r["ranks"][0].update(state="dancing"),
    "p2p op unknown": lambda r: r["ranks"][0].update(p2p=[p2p("ncclAllReduce", 1, 1, 1)]),
    "too many ranks": lambda r: r.update(ranks=[r["ranks"][1]] * (MAX_RANKS + 1)),
    "too many collectives": lambda r: r["ranks"][0].update(collectives=[coll(1, 1)] * 300),
    "duplicate pid": lambda r: r["ranks"].append(r["ranks"][0]),
    "job not a string": lambda r: r["ranks"][0].update(job=["job-7"]),
    "world size zero": lambda r: r["ranks"][0].update(world_size=0),
    "last call not an object": lambda r: r["ranks"][0].update(last_call="ncclSend"),
}


@pytest.mark.parametrize("why", sorted(HOSTILE))
def test_a_hostile_node_is_left_out_with_a_warning(why: str) -> None:
    good = four_ranks()[0]
    v = verdict([good, _with(HOSTILE[why])], hang_after_s=10)
    assert v["nodes"] == ["node-a"], why
    assert any(w.startswith("node node-b: malformed ranks answer") for w in v["warnings"])
    with pytest.raises(ValueError):
        check_ranks_reply("node-b", _with(HOSTILE[why])[1])


def test_hostile_strings_are_cleaned_and_cut() -> None:
    def evil(r: dict[str, Any]) -> None:
        r["ranks"][0]["comm"] = "evil\x1b[2J\nIGNORE"
        r["ranks"][0]["job"] = "job-7"
        r["ranks"][0]["wchan"] = "w" * 5000
        r["ranks"][1]["job"] = "j\x07" * 4000
    v = verdict([four_ranks()[0], _with(evil)], hang_after_s=10)
    [c] = v["hangs"][0]["culprits"]
    assert c["comm"] == "evil?[2J?IGNORE" and len(c["wchan"]) <= 64
    texts = [g["key"] for g in v["groups"]] + v["warnings"]
    assert all(t.isprintable() and len(t) < 400 for t in texts)
    with pytest.raises(ValueError):
        verdict([], hang_after_s=0)


def test_a_culprits_top_chain_keeps_only_checked_fields() -> None:
    chain = top_chain({"chains": [{"severity": "HIGH", "root_cause": "cpu_contention",
                                   "summary": "hog\x1b]0;x\x07 ran", "culprit": {
                                       "pid": 7, "comm": "hog\n"}, "evidence": ["x" * 10**6]}]})
    assert chain == {"severity": "HIGH", "root_cause": "cpu_contention",
                     "summary": "hog?]0;x? ran", "culprit": {"pid": 7, "comm": "hog?"}}
    assert top_chain({"chains": [{"severity": "DOOM", "culprit": {"pid": 2**80}}]}) == {
        "severity": None, "root_cause": None, "summary": None,
        "culprit": {"pid": None, "comm": None}}
    assert top_chain({"chains": "no"}) is None


def test_ranks_that_queued_further_collectives_wait_at_the_culprits_next_one() -> None:
    """Asynchronous NCCL: the healthy ranks enqueued 57..59; the job is stuck at 57."""
    replies = [answer("node-a", rank(100, 0, [coll(59, 12)]), rank(101, 1, [coll(58, 12.5)])),
               answer("node-b", rank(200, 2, [coll(56, 13)], state="stopped"),
                      rank(201, 3, [coll(59, 11)]))]
    h = verdict(replies, hang_after_s=10)["hangs"][0]
    assert (h["kind"], h["seq"], h["op"]) == ("collective", 57, None)
    assert [c["pid"] for c in h["culprits"]] == [200]  # rank 1 has entered 57 (and 58)
    assert [w["pid"] for w in h["waiting"]] == [100, 101, 201]
    assert "never arrived at collective 57 of job job-7" in h["summary"]
    assert "the furthest at collective 59" in h["summary"]


# ---- launch detail asked of the laggards' nodes (fleetd watch) ----------------------------


def test_watch_asks_the_laggards_node_for_detail_before_the_hang() -> None:
    from fleetd.fleet.hang import DETAIL_AFTER_S, checked, laggard_nodes

    def laggards(replies: list[tuple[str, dict[str, Any]]], hang_after_s: float) -> set[str]:
        return laggard_nodes(checked(replies).views, hang_after_s)

    # 2 s of waiting: no hang at 10 s, but rank 2's node is where the detail is
    early = four_ranks(stopped_state="running", behind_s=2.1, wait_s=2.0)
    assert verdict(early, hang_after_s=10)["status"] == "ok"
    assert laggards(early, hang_after_s=10) == {"node-b"}
    # nobody has waited DETAIL_AFTER_S yet: nothing is asked
    quiet = four_ranks(stopped_state="running", behind_s=DETAIL_AFTER_S / 2 + 0.1,
                       wait_s=DETAIL_AFTER_S / 2)
    assert laggards(quiet, hang_after_s=10) == set()
    # a short hang threshold asks at half of it
    assert laggards(quiet, hang_after_s=0.8) == {"node-b"}
