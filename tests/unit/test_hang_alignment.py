"""Hang verdicts over ranks whose agents attached at different moments (issue #28, item
2): the ranks' collective numbers are aligned from the last collectives each agent
keeps (op, bytes, age) before they are compared, a stopped rank is the culprit whatever
the numbers say, and a rank whose numbers cannot be aligned is never named from them.

Replies are shaped as ``GET /api/v1/ranks`` gives them (fleetd/node/ranks.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fleetd.fleet.hang import verdict
from fleetd.wire.ranks import check_ranks_reply

S = 1_000_000_000
MS = 1_000_000
NOW = 1_800_000_000 * S
OPS = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter")


def step_time(k: int, step_ns: int, last_step: int, idle_ns: int) -> int:
    """Age of job step k: steps every step_ns up to last_step, then idle_ns of nothing."""
    return idle_ns + (last_step - k) * step_ns


def rank(pid: int, r: int, attach: int, last: int, *, state: str = "sleeping",
         wchan: str | None = "wait_woken", step_ns: int = 30 * MS, idle_s: float = 12.0,
         sizes: bool = True, behind: int = 0, late_ns: int = 0, keep: int = 64,
         exit_code: int | None = None) -> dict[str, Any]:
    """Rank r of a job at step ``last - behind``; its agent attached at step ``attach``
    (numbers its collectives from 1 there)."""
    mine = last - behind
    idle = int(idle_s * S)
    recent = []
    for k in range(max(attach, mine - keep + 1), mine + 1):
        age = step_time(k, step_ns, last, idle) - late_ns
        recent.append([k - attach + 1, age, OPS[k % 5] if sizes else "ncclAllReduce",
                       4 * (1024 + k) if sizes else 4096])
    seq, age, op, _ = recent[-1]
    coll = {"communicator": "0x0", "comm_hash": None, "rank": None, "nranks": None,
            "op": op, "seq": seq, "ts_ns": NOW - age, "age_ns": age, "dur_ns": 20_000,
            "ret": 4, "calls": seq, "recent": recent}
    return {"pid": pid, "comm": "python", "rank": r, "local_rank": 0, "world_size": 4,
            "job": "late-job", "state": state, "state_code": None, "wchan": wchan,
            "exit_code": exit_code if state == "exited" else None,
            "exited_age_ns": int(idle_s * S) if state == "exited" else None,
            "collectives": [coll],
            "last_call": {"op": "cudaStreamSynchronize", "ts_ns": NOW - age + 1000,
                          "age_ns": age - 1000, "dur_ns": 5_000, "ret": 0},
            "p2p": []}


def answer(node: str, *ranks: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return node, {"node": node, "now_ns": NOW, "tracing": True, "ranks": list(ranks),
                  "dropped": 0}


# Agents attached at job steps 40, 3, 27 and 12: at step 500 the ranks number it 461,
# 498, 474 and 489.
ATTACH = {0: 40, 1: 3, 2: 27, 3: 12}


def job(stopped: int | None = 2, *, behind: dict[int, int] | None = None,
        **kw: Any) -> list[tuple[str, dict[str, Any]]]:
    """Ranks 0..3, one per node, at step 500; ``stopped`` stopped there."""
    out = []
    for r in range(4):
        extra = dict(kw)
        if r == stopped:
            extra.update(state="stopped", wchan="do_signal_stop")
        out.append(answer(f"host-{r}", rank(100 + r, r, ATTACH[r], 500,
                                            behind=(behind or {}).get(r, 0), **extra)))
    return out


def names(v: dict[str, Any]) -> set[tuple[int, str]]:
    return {(c["rank"], c["state"]) for h in v["hangs"] for c in h["culprits"]}


def test_raw_numbers_would_blame_the_rank_traced_last() -> None:
    """Before alignment, the rank whose agent attached last had the lowest numbers."""
    raw = {r: 500 - ATTACH[r] + 1 for r in range(4)}
    assert min(raw, key=lambda r: raw[r]) == 0 and max(raw, key=lambda r: raw[r]) == 1


def test_a_stopped_rank_at_the_same_step_is_named_stalled() -> None:
    v = verdict(job(stopped=2), hang_after_s=10, age_error_s=0.005)
    [h] = v["hangs"]
    assert names(v) == {(2, "stopped")} and h["kind"] == "stalled"
    assert {w["rank"] for w in h["waiting"]} == {0, 1, 3}
    assert h["alignment"]["method"] == "calls" and h["alignment"]["confidence"] == "high"
    # One numbering: the one of rank 1, traced longest (step 500 is its 498).
    assert h["seq"] == 499 and h["alignment"]["offsets"] == {"0": 37, "1": 0, "2": 24,
                                                             "3": 9}
    c = h["culprits"][0]
    assert (c["seq"], c["recorded_seq"]) == (498, 474)
    assert "aligned from the ops and sizes of the calls" in h["summary"]


def test_a_stopped_rank_one_behind_never_arrived() -> None:
    v = verdict(job(stopped=2, behind={2: 1}), hang_after_s=10, age_error_s=0.005)
    [h] = v["hangs"]
    assert names(v) == {(2, "stopped")} and h["kind"] == "collective"
    assert h["seq"] == 498 and [w["seq"] for w in h["waiting"]] == [498, 498, 498]
    assert "rank 2 (host-2 pid 102, stopped in do_signal_stop) never arrived at " \
        "collective 498 (ncclAllReduce)" in h["summary"]


@pytest.mark.parametrize("stopped", range(4))
def test_the_stopped_rank_is_named_whichever_it_is(stopped: int) -> None:
    v = verdict(job(stopped=stopped), hang_after_s=10, age_error_s=0.005)
    assert names(v) == {(stopped, "stopped")}


def test_ranks_waiting_inside_a_collective_are_never_culprits() -> None:
    """Rank 3 is inside collective 500 (its entry not recorded yet: records are made at
    return), sleeping on a futex; rank 0 is stopped: only rank 0 is named."""
    replies = job(stopped=0, behind={3: 1}, wchan="futex_wait_queue")
    v = verdict(replies, hang_after_s=10, age_error_s=0.005)
    assert names(v) == {(0, "stopped")}
    assert {w["rank"] for w in v["hangs"][0]["waiting"]} == {1, 2, 3}


def test_a_job_idle_for_long_with_far_apart_numbers_is_no_hang() -> None:
    """Every rank alive and between collectives for 12 s (a long evaluation, say): as
    recorded, rank 0 is 37 collectives behind rank 1; aligned, they are all at 498."""
    v = verdict(job(stopped=None), hang_after_s=10, age_error_s=0.005)
    assert v["status"] == "ok" and v["hangs"] == [], v["verdict"]
    [g] = v["groups"]
    assert g["seq"] == 498 and g["alignment"]["confidence"] == "high"
    assert v["verdict"] == "no hang: job late-job at collective 498"


def test_a_running_laggard_is_named_when_the_alignment_is_sure() -> None:
    replies = job(stopped=None, behind={1: 1})
    replies[1][1]["ranks"][0]["state"] = "running"
    v = verdict(replies, hang_after_s=10, age_error_s=0.005)
    [h] = v["hangs"]
    assert h["kind"] == "collective" and names(v) == {(1, "running")}


def test_repeating_calls_are_aligned_by_their_ages() -> None:
    v = verdict(job(stopped=3, sizes=False, behind={3: 1}), hang_after_s=10,
                age_error_s=0.002)
    [h] = v["hangs"]
    assert names(v) == {(3, "stopped")} and h["kind"] == "collective"
    assert h["alignment"]["confidence"] == "medium" and h["alignment"]["by"] == "timing"


def test_an_ambiguous_alignment_names_nobody_by_number() -> None:
    """Same-size calls, and a poll that took longer than a step: the ages cannot tell
    the steps apart. A rank that looks behind is not named; a warning says why."""
    replies = job(stopped=None, sizes=False, behind={1: 1})
    replies[1][1]["ranks"][0]["state"] = "running"
    v = verdict(replies, hang_after_s=10, age_error_s=0.1)
    assert v["status"] == "ok" and v["hangs"] == []
    assert any("could not be aligned" in w and "no rank is named from its number" in w
               for w in v["warnings"]), v["warnings"]
    assert v["groups"][0]["alignment"]["ambiguous_ranks"]


def test_an_ambiguous_alignment_still_names_a_stopped_rank() -> None:
    v = verdict(job(stopped=2, sizes=False), hang_after_s=10, age_error_s=0.1)
    [h] = v["hangs"]
    assert names(v) == {(2, "stopped")} and h["kind"] == "stalled"
    assert {w["rank"] for w in h["waiting"]} == {0, 1, 3}


def test_an_exited_rank_is_named_whatever_the_numbers() -> None:
    replies = job(stopped=None)
    replies[3][1]["ranks"][0].update(state="exited", exit_code=None,
                                     exited_age_ns=11 * S, wchan=None)
    v = verdict(replies, hang_after_s=10, age_error_s=0.005)
    assert names(v) == {(3, "exited")}


def test_a_rank_with_a_short_history_keeps_its_number() -> None:
    """An agent that has just attached holds a few calls: not enough to compare, so
    that rank's numbers are taken as recorded (unverified) and the group says so."""
    replies = job(stopped=1, keep=2)
    v = verdict(replies, hang_after_s=10, age_error_s=0.005)
    assert names(v) == {(1, "stopped")}
    assert v["groups"][0]["alignment"]["confidence"] == "unverified"


@pytest.mark.parametrize("bad", [
    [1, 2, 3], ["1", 2, "ncclAllReduce", 4], [0, 5, "ncclAllReduce", 4],
    [1, -5, "ncclAllReduce", 4], [1, 5, 7, 4], "recent"])
def test_a_malformed_recent_entry_rejects_the_node(bad: Any) -> None:
    node, reply = job()[0]
    reply = copy.deepcopy(reply)
    reply["ranks"][0]["collectives"][0]["recent"][0] = bad
    with pytest.raises(ValueError):
        check_ranks_reply(node, reply)
    reply["ranks"][0]["collectives"][0]["recent"] = [[1, 1, "ncclAllReduce", 4]] * 300
    with pytest.raises(ValueError):
        check_ranks_reply(node, reply)


# ---- what the agent keeps --------------------------------------------------------------


def test_the_rank_book_keeps_each_communicators_last_collectives() -> None:
    import os

    from fleetd.analyze.distributed.hangs import RankView
    from fleetd.node.ranks import RECENT, RankBook
    from fleetd.store.catalog import op_code

    book = RankBook()
    pid = os.getpid()  # a live process: the book reads its /proc
    now = NOW
    rows, args = [], []
    for k in range(1, RECENT + 11):
        op = OPS[k % 5]
        rows.append((now - (200 - k) * MS, 1_000, pid, pid, op_code(op), 4,
                     4 * (1024 + k), 0, 1024 + k, -1, 0))
        args.append((len(rows) - 1, {"comm": "0x0", "seq": k}))
    book.observe(rows, args)
    [r] = book.snapshot("n1", now_ns=now)
    [c] = r["collectives"]
    assert c["seq"] == RECENT + 10 and len(c["recent"]) == RECENT
    assert c["recent"][0] == [11, 189 * MS, OPS[11 % 5], 4 * 1035]
    assert c["recent"][-1][:2] == [RECENT + 10, (200 - RECENT - 10) * MS]
    view = RankView.of("n1", r)
    assert view.collectives[0].recent[-1].seq == RECENT + 10
    # Numbers that start again (a fresh communicator at the same handle) start afresh.
    book.observe([(now, 1_000, pid, pid, op_code("ncclAllReduce"), 4, 8, 0, 2, -1, 0)],
                 [(0, {"comm": "0x0", "seq": 1})])
    [r] = book.snapshot("n1", now_ns=now + MS)
    assert [x[0] for x in r["collectives"][0]["recent"]] == [1]
