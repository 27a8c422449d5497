"""The live straggler's cause is the one that CHANGED (fleetd.fleet.cause_change), from
real node answers: tests/data/straggle_causes holds GET /api/v1/chains answers of
bench/detect.py's bed (four ranks of a lockstep job, each in a 25% CPU slice, all on one
overloaded CPU), per fault: the late rank over its straggle window, the same rank over
10 s before the onset, and its three on-time peers over the straggle window. Every rank
waits for the CPU 55-88% of its wall time there, straggling or not, so the costliest
chain is cpu_contention whatever the fault."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from fleetd.fleet import cause_change
from fleetd.fleet.cause_change import (
    MIN_EXCESS,
    NEW_TAKER_RATIO,
    Shares,
    chain_of,
    new_taker,
    ranked,
    shares,
)
from fleetd.fleet.straggle import _name, _Open
from fleetd.wire.chains import check_chains_reply
from fleetd.wire.shapes import ChainsReply

DATA = Path(__file__).resolve().parents[1] / "data" / "straggle_causes"


def fault(kind: str) -> dict[str, Any]:
    d: dict[str, Any] = json.loads((DATA / f"{kind}.json").read_text())
    return d


def read(reply: dict[str, Any]) -> ChainsReply:
    return check_chains_reply(reply)  # as the watch reads a node's answer


def parts(kind: str) -> tuple[Shares, Shares, list[Shares]]:
    d = fault(kind)
    now, before = shares(read(d["late"]), d["pid"]), shares(read(d["baseline"]), d["pid"])
    peers = [shares(read(r), p) for r, p in zip(d["peers"], d["peer_pids"], strict=True)]
    assert now is not None and before is not None and None not in peers
    return now, before, [p for p in peers if p is not None]


def named(kind: str, *, baseline: bool = True, peers: bool = True) -> str | None:
    now, before, theirs = parts(kind)
    found = ranked(now, before if baseline else None, theirs if peers else [])
    return found[0].cause if found else None


def test_the_costliest_chain_is_contention_whatever_the_fault() -> None:
    """What the old rule named: the late rank's top chain by impact."""
    for kind in ("gc", "disk", "hog"):
        d = fault(kind)
        top = chain_of(read(d["late"]), d["pid"], None)
        assert top is not None and top["root_cause"] == "cpu_contention", kind


@pytest.mark.parametrize("baseline,peers", [(True, True), (True, False), (False, True)])
def test_a_gc_storm_is_named_gc_though_contention_costs_17_times_more(baseline: bool,
                                                                       peers: bool) -> None:
    now, _, theirs = parts("gc")
    assert now.causes["cpu_contention"] > 15 * now.causes["gc_pause"]
    # its peers pay as much contention per second awake (they sleep in the collective)
    contention = ranked(now, None, theirs)
    assert "cpu_contention" not in [x.cause for x in contention]
    assert named("gc", baseline=baseline, peers=peers) == "gc_pause"


@pytest.mark.parametrize("kind,cause", [("disk", "block_io"), ("loader", "data_starvation"),
                                        ("quota", "cpu_throttled")])
def test_each_fault_is_named_by_the_cause_that_rose(kind: str, cause: str) -> None:
    assert named(kind) == cause
    assert named(kind, baseline=False) == cause  # the peers alone
    now, before, theirs = parts(kind)
    top = ranked(now, before, theirs)[0]
    assert top.excess >= MIN_EXCESS and top.before is not None and top.peers is not None


def test_a_rank_whose_only_change_is_more_contention_is_named_contention() -> None:
    """The gc storm's baseline, as the late rank: others took its CPU (0.10 of wall moved
    from running to the run queue) and it sleeps less in the collective (0.10 more from
    sleeping), its contention chain's impact up by those 0.20, nothing else."""
    d = fault("gc")
    late = copy.deepcopy(d["baseline"])
    for c in late["chains"]:
        if c["root_cause"] == "cpu_contention":
            c["impact"] += 0.20
    proc = next(p for p in late["processes"] if p["pid"] == d["pid"])
    tenth = int(0.10 * (proc["runq_ns"] + proc["running_ns"] + proc["sleeping_ns"]
                        + proc["irq_ns"] + proc["d_state_ns"]))
    proc["running_ns"] -= tenth
    proc["sleeping_ns"] -= tenth
    proc["runq_ns"] += 2 * tenth
    now = shares(read(late), d["pid"])
    before = shares(read(d["baseline"]), d["pid"])
    assert now is not None and before is not None
    [x] = ranked(now, before, [])
    assert x.cause == "cpu_contention" and x.excess > MIN_EXCESS
    # the same rise of contention, all of it from sleeping less (waiting in the run queue
    # as much per second awake as before): what any late rank shows, not a change
    proc["running_ns"] += tenth
    proc["sleeping_ns"] -= tenth
    same = shares(read(late), d["pid"])
    assert same is not None and ranked(same, before, []) == []


def test_the_hog_rank_waits_no_more_per_second_awake_and_falls_back_to_its_top_chain() -> None:
    """On this bed a CPU hog in the rank's slice leaves its run-queue share per second
    awake where it was (every rank is runnable whenever awake): no cause rose, so the
    watch names the costliest chain, contention, without a ``changed`` record."""
    now, before, theirs = parts("hog")
    assert ranked(now, before, theirs) == []
    assert named("hog", baseline=False) is None  # the peers alone: within the noise
    d = fault("hog")
    o = _open(d)
    o.baseline = before
    assert not _name(o, read(d["late"]), list(theirs), fallback=False)  # window too short
    assert o.found["top_chain"] is None
    assert _name(o, read(d["late"]), list(theirs))
    assert o.found["top_chain"] is not None
    assert o.found["top_chain"]["root_cause"] == "cpu_contention"
    assert "changed" not in o.found


def test_the_watch_names_gc_with_its_chain_and_figures() -> None:
    d = fault("gc")
    o = _open(d)
    o.baseline = shares(read(d["baseline"]), d["pid"])
    peers = [shares(read(r), p) for r, p in zip(d["peers"], d["peer_pids"], strict=True)]
    assert _name(o, read(d["late"]), peers)
    top, changed = o.found["top_chain"], o.found["changed"]
    assert top is not None and top["root_cause"] == "gc_pause" and top["summary"]
    assert changed["cause"] == "gc_pause" and changed["baseline"] == 0.0
    assert changed["share"] == pytest.approx(0.0439, abs=1e-4)


def test_a_reference_asleep_most_of_its_window_says_nothing() -> None:
    """A baseline taken while the job was stopped (a hang): per second awake it would
    scale the rank's causes by noise."""
    now, before, _ = parts("gc")
    asleep = Shares(dict(before.causes), before.running, 0.95)
    assert ranked(now, asleep, []) == ranked(now, None, [])


def test_a_threshold_rule_crossed_by_not_waiting_is_not_a_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """host_cpu_bound fires once a thread runs most of the time it is not queued: the
    hog's rank, no longer sleeping in the collective, crossed it with less CPU time per
    second awake than before. Its reference is at least the rank's running share."""
    now, before, _ = parts("hog")
    assert now.causes["host_cpu_bound"] > MIN_EXCESS and "host_cpu_bound" not in before.causes
    assert "host_cpu_bound" not in [x.cause for x in ranked(now, before, [])]
    monkeypatch.setattr(cause_change, "COUNTED_FROM", {})  # without the floor: named
    assert [x.cause for x in ranked(now, before, [])] == ["host_cpu_bound"]


def test_an_answer_without_the_process_is_unknown_not_zero() -> None:
    d = fault("gc")
    assert shares(read(d["late"]), 999_999) is None


def _open(d: dict[str, Any]) -> _Open:
    return _Open({"kind": "straggler", "key": "k", "group": "job detect", "matching": "torchrun",
                  "node": d["late"]["node"], "pid": d["pid"], "comm": "python", "rank": 3,
                  "job": "detect", "ratio": 1.0, "late_ms": 40.0, "collectives": 30,
                  "summary": "", "top_chain": None})


def test_a_gc_storm_that_a_quota_turns_into_throttling_is_named_gc() -> None:
    """Live, the gc storm's rank was throttled 26% of its wall time (its extra CPU work
    past its slice's quota): the GC is the change, the throttling how it costs time.
    Before the on-CPU samples of the window are written (not ``settled``) no CPU wait
    is named where the rank ran no less than before; a quota that took its CPU is."""
    d = fault("gc")
    late = copy.deepcopy(d["late"])
    for c in late["chains"]:
        if c["root_cause"] == "cpu_throttled":
            c["impact"] = 0.264
    now = shares(read(late), d["pid"])
    _, before, theirs = parts("gc")
    assert now is not None
    assert [x.cause for x in ranked(now, before, theirs)] == ["gc_pause", "cpu_throttled"]
    unsampled = Shares({k: v for k, v in now.causes.items() if k != "gc_pause"},
                       now.running, now.asleep)
    assert ranked(unsampled, before, theirs, settled=False) == []
    assert [x.cause for x in ranked(unsampled, before, theirs)] == ["cpu_throttled"]
    q_now, q_before, q_peers = parts("quota")
    assert [x.cause for x in ranked(q_now, q_before, q_peers, settled=False)] == [
        "cpu_throttled"]


def test_a_disk_fault_whose_writes_a_quota_throttles_is_named_block_io() -> None:
    """Live, a rank writing 16 MiB a step was throttled 17% of its wall time (the copy
    into the page cache, past its slice's quota) beside 15% in D state: it asked more of
    the CPU rather than had it taken, so the I/O is named."""
    d = fault("disk")
    late = copy.deepcopy(d["late"])
    late["chains"].append({**next(c for c in late["chains"]
                                  if c["root_cause"] == "cpu_contention"),
                           "root_cause": "cpu_throttled", "impact": 0.174})
    now = shares(read(late), d["pid"])
    _, before, theirs = parts("disk")
    assert now is not None
    found = ranked(now, before, theirs)
    assert found[0].cause == "block_io" and "cpu_throttled" in [x.cause for x in found]
    assert found[0].score < max(x.score for x in found)  # the costlier rise comes second


def _ranks(d: dict[str, Any]) -> frozenset[int]:
    return frozenset([d["pid"], *d["peer_pids"]])


@pytest.mark.parametrize("kind", ["gc", "disk", "loader", "quota", "hog"])
def test_a_task_that_only_entered_the_top_culprits_is_not_new(kind: str) -> None:
    """On this shared host other tasks come and go among a rank's top culprits (the gc
    storm's rank: an agent 8.2% of its wall, absent from its references' top 3; the
    quota's: a python3 9.9%). Absent from a reference's list is not absent: it took at
    most the least listed culprit there, and against that bound none of them is new
    (the hog's 5.7% included: this recording cannot tell it from them)."""
    d = fault(kind)
    now, before, theirs = parts(kind)
    unbounded = [Shares(r.causes, r.running, r.asleep, r.takers, r.waits)
                 for r in (before, *theirs)]  # unlisted as 0
    assert new_taker(now, before, theirs, _ranks(d)) is None
    if kind in ("gc", "quota", "hog"):
        assert new_taker(now, unbounded[0], unbounded[1:], _ranks(d)) is not None


def _hog_took(factor: float) -> dict[str, Any]:
    """The hog run's late answer with the hog (fleetd-hog) having taken ``factor`` times
    the time it took there (its share of the chain's time rescaled to match)."""
    d = copy.deepcopy(fault("hog"))
    for c in d["late"]["chains"]:
        for u in c["culprits"]:
            if u["comm"] == "fleetd-hog":
                u["ns"] = int(u["ns"] * factor)
    return d


def _hog_parts(factor: float) -> tuple[Shares, Shares, list[Shares], frozenset[int]]:
    d = _hog_took(factor)
    now = shares(read(d["late"]), d["pid"])
    _, before, theirs = parts("hog")
    assert now is not None
    return now, before, theirs, _ranks(d)


def _hog_named_at_once(d: dict[str, Any], before: Shares, theirs: list[Shares],
                       hog_pid: int) -> _Open:
    """The watch's naming of ``d``'s late rank at its first ask (no fallback): a
    cpu_contention chain with the hog as its culprit. The rank's open straggle."""
    o = _open(d)
    o.baseline, o.ranks = before, _ranks(d)
    assert _name(o, read(d["late"]), list(theirs), fallback=False)
    top = o.found["top_chain"]
    assert top is not None and top["root_cause"] == "cpu_contention"
    assert top.get("culprit") == {"pid": hog_pid, "comm": "fleetd-hog"}
    return o


def test_a_hog_past_its_references_bound_is_named_before_the_fallback() -> None:
    """The same answer with the hog's time five times (29% of the rank's wall; its
    peers' bound per second awake is 8%, as their lists are cut to 3 culprits here, and
    the 4x hog, 23%, is not past NEW_TAKER_RATIO times that): contention is named at the
    first ask (no fallback), with the hog as its culprit and its figures."""
    assert new_taker(*_hog_parts(4.0)) is None
    d = _hog_took(5.0)
    now = shares(read(d["late"]), d["pid"])
    _, before, theirs = parts("hog")
    assert now is not None and ranked(now, before, theirs) == []  # no cause's share rose
    new = new_taker(now, before, theirs, _ranks(d))
    assert new is not None and new.taker[1] == "fleetd-hog"
    assert new.change.cause == "cpu_contention"
    assert new.change.now >= NEW_TAKER_RATIO * new.change.reference
    o = _hog_named_at_once(d, before, theirs, new.taker[0])
    assert o.found["changed"]["share"] == pytest.approx(new.change.now, abs=1e-4)


def test_a_rank_of_the_job_is_never_a_new_taker() -> None:
    """The peer rank 29180 ran more while the late rank waited (it waits for the late
    one in the collective less): a rank of the job, not a hog."""
    d = copy.deepcopy(fault("hog"))
    for c in d["late"]["chains"]:
        for u in c["culprits"]:
            if u["pid"] == 29180:
                u["ns"] *= 4
    now = shares(read(d["late"]), d["pid"])
    _, before, theirs = parts("hog")
    assert now is not None
    new = new_taker(now, before, theirs)
    assert new is not None and new.taker == (29180, "python")
    assert new_taker(now, before, theirs, _ranks(d)) is None


def test_a_hog_is_named_at_the_first_ask_from_its_culprits() -> None:
    """A quick run's hog (load 3-6) recorded with every culprit its chains list: no
    cause's share rose per second awake (the rank waited for a CPU 54% of its baseline
    wall, 88% now, all of it from sleeping less), but fleetd-hog took 22% of its wall
    while it waited, against 4% before (unlisted there: at most its least listed
    culprit) and 6% on its peers (one lists it: the bed's hosts share a CPU): named
    cpu_contention with the hog as culprit, before the fallback."""
    now, before, theirs = parts("hog_culprits")
    d = fault("hog_culprits")
    assert ranked(now, before, theirs) == []
    new = new_taker(now, before, theirs, _ranks(d))
    assert new is not None and new.taker[1] == "fleetd-hog"
    assert new.change.now > 0.2 and new.change.before is not None and new.change.peers
    assert new.change.now >= NEW_TAKER_RATIO * new.change.reference
    o = _hog_named_at_once(d, before, theirs, new.taker[0])
    assert o.found["changed"]["cause"] == "cpu_contention"


def test_a_gc_storm_at_its_quota_is_named_gc_though_throttling_rose_more() -> None:
    """A full run's GC storm (load 7) whose rank was throttled 51% of its wall, against
    none before, on a 25% slice: the storm's CPU work past the quota. Per second awake it
    ran 0.97 of its reference, the quota's cap, not a CPU taken from it, so the GC is
    named, at the watch's first ask (its window onset+1.5 .. +6.5 s; the answer read from
    the kept database, samples included, as a node writing them every second has them
    then). The old "ran less" (any less) named cpu_throttled there, at 6.7 s."""
    now, before, theirs = parts("gc_quota")
    assert now.causes["cpu_throttled"] > 5 * now.causes["gc_pause"]
    assert not cause_change.ran_less(now, before, theirs)
    assert [x.cause for x in ranked(now, before, theirs)] == ["gc_pause", "cpu_throttled"]
    d = fault("gc_quota")
    o = _open(d)
    o.baseline = before
    assert _name(o, read(d["late"]), list(theirs), fallback=False)
    assert o.found["top_chain"] is not None
    assert o.found["top_chain"]["root_cause"] == "gc_pause"
    # before the straggle's samples are written, no CPU wait is named for it
    unsampled = Shares({k: v for k, v in now.causes.items() if k != "gc_pause"},
                       now.running, now.asleep)
    assert ranked(unsampled, before, theirs, settled=False) == []


def test_a_rank_that_ran_barely_less_at_its_quota_did_not_have_its_cpu_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same answers with "less" meaning any less: the 3% a quota's cap hides made
    the throttling a CPU taken from the rank, named first (the full run's wrong cause).
    A quota cut (quota.json) or a hog (hog_unseen.json) takes far more."""
    now, before, theirs = parts("gc_quota")
    monkeypatch.setattr(cause_change, "RAN_LESS", 1.0)
    assert cause_change.ran_less(now, before, theirs)
    assert ranked(now, before, theirs)[0].cause == "cpu_throttled"
    monkeypatch.undo()
    for kind in ("quota", "hog_unseen"):
        assert cause_change.ran_less(*parts(kind)), kind


def test_a_hog_no_reference_lists_is_named_at_the_first_ask() -> None:
    """A quick run's hog (load 8) that took 13% of the rank's wall while it waited for a
    CPU: no cause rose, and 13% is not 3x the 7% its references can hide (their least
    listed culprits, per second awake), so the 3x rule waited for the 8 s fallback
    (14.4 s after onset). But no reference lists it at all, and the rank ran 0.65 of its
    reference per second awake: its CPU was taken, by a task that was not there to take
    it. Named cpu_contention with the hog as culprit, at the first ask."""
    now, before, theirs = parts("hog_unseen")
    d = fault("hog_unseen")
    assert ranked(now, before, theirs) == []
    assert new_taker(now, before, theirs, _ranks(d)) is None  # the 3x rule
    assert cause_change.ran_less(now, before, theirs)
    new = new_taker(now, before, theirs, _ranks(d), unseen=True)
    assert new is not None and new.taker[1] == "fleetd-hog"
    assert new.change.now < NEW_TAKER_RATIO * new.change.reference
    o = _hog_named_at_once(d, before, theirs, new.taker[0])
    assert o.found["changed"]["share"] == pytest.approx(new.change.now, abs=1e-4)


def test_a_task_some_reference_lists_or_a_rank_that_kept_its_cpu_is_not_unseen() -> None:
    """The hog_unseen answers changed one way each: the rank's own baseline lists the hog
    (at 2% of its wall: a task that was there, for the 3x rule to judge), or the rank ran
    as much as before per second awake (nothing was taken from it: the fallback names its
    costliest chain in time). Either way the first ask names nothing."""
    d = fault("hog_unseen")
    now, _, theirs = parts("hog_unseen")
    listed = copy.deepcopy(d)
    hog = next(u for c in d["late"]["chains"] for u in c["culprits"]
               if u["comm"] == "fleetd-hog")
    chain = next(c for c in listed["baseline"]["chains"]
                 if c["root_cause"] == "cpu_contention" and c["victim"]["pid"] == d["pid"])
    proc = next(p for p in listed["baseline"]["processes"] if p["pid"] == d["pid"])
    wall = sum(proc[k] for k in ("running_ns", "runq_ns", "irq_ns", "d_state_ns",
                                 "sleeping_ns"))
    chain["culprits"].append({**hog, "ns": int(0.02 * wall)})
    before = shares(read(listed["baseline"]), d["pid"])
    assert before is not None
    assert new_taker(now, before, theirs, _ranks(d), unseen=True) is None
    o = _open(listed)
    o.baseline, o.ranks = before, _ranks(d)
    assert not _name(o, read(d["late"]), list(theirs), fallback=False)
    kept = copy.deepcopy(d)
    row = next(p for p in kept["late"]["processes"] if p["pid"] == d["pid"])
    row["runq_ns"] -= row["running_ns"]
    row["running_ns"] *= 2
    o = _open(kept)
    o.baseline, o.ranks = parts("hog_unseen")[1], _ranks(d)
    assert not _name(o, read(kept["late"]), list(theirs), fallback=False)
