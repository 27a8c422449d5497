"""Live straggler rule (fleetd.analyze.distributed.lateness) and its hysteresis
(fleetd.fleet.straggle):
ranks of one torchrun job in lockstep, built as their agents' answers would read, with
one rank entering each collective late (or none), and the messages a watch would send."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

from fleetd.analyze.distributed.hangs import Collective, RankView, Recent
from fleetd.analyze.distributed.lateness import LATE_MARGIN_NS, lateness, stragglers
from fleetd.fleet.notify import Delivery, Notifier
from fleetd.fleet.straggle import OwnLateness, StraggleWatch

STEP_NS = 50_000_000  # 20 collectives a second
OPS = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter")


def job(late_rank: int | None, late_ns: int, *, ranks: int = 4, steps: int = 60,
        jitter_ns: int = 1_000_000, seed: int = 1, offsets: tuple[int, ...] = ()
        ) -> list[RankView]:
    """Each rank's view: its last ``steps`` collectives (the latest 0.1 s ago), entries
    jittered, ``late_rank`` entering ``late_ns`` after the others; ``offsets``: how far
    each rank's agent numbers them from the others' (attached at other moments)."""
    rnd = random.Random(seed)
    views = []
    for r in range(ranks):
        shift = offsets[r] if offsets else 0
        recent = []
        for i in range(steps):
            age = 100_000_000 + (steps - 1 - i) * STEP_NS + rnd.randrange(jitter_ns)
            if r == late_rank:
                age -= late_ns
            # as nccl_ranks.py: ops in turn, the count growing with the step number
            recent.append(Recent(i + 1 + shift, age, OPS[i % len(OPS)], 4 * (1024 + i)))
        last = recent[-1]
        views.append(RankView(
            node=f"n{r}", pid=100 + r, comm="python", rank=r, world_size=ranks, job="j1",
            state="running",
            collectives=[Collective("0x1", None, None, None, last.op, last.seq, last.age_ns,
                                    0, tuple(recent))]))
    return views


def test_a_healthy_job_has_no_late_rank_whatever_its_jitter() -> None:
    for seed in range(20):
        views = job(None, 0, jitter_ns=5_000_000, seed=seed)
        assert stragglers(views) == [], seed
        shares = [x.ratio for x in lateness(views)]
        assert len(shares) == 4 and abs(sum(shares) - 1) < 1e-9


def test_the_rank_entering_late_is_named_with_its_margin() -> None:
    found = stragglers(job(2, 15_000_000, offsets=(0, 7, 3, 12)))
    assert [(x.rank, x.view.node) for x in found] == [(2, "n2")]
    assert found[0].ratio == 1.0
    assert 14_000_000 <= found[0].late_ns <= 16_000_000
    assert 45_000_000 <= found[0].step_ns <= 55_000_000
    for late in (45_000_000, 200_000_000):  # most of a step, or more: aligned all the same
        assert [x.rank for x in stragglers(job(2, late, offsets=(5, 0, 9, 2)))] == [2]


def test_a_rank_late_by_less_than_the_margins_is_not_flagged() -> None:
    views = job(1, LATE_MARGIN_NS // 4, jitter_ns=100_000)
    assert [x.rank for x in lateness(views) if x.ratio > 0.9] == [1]
    assert stragglers(views) == []
    # always last, by 3 ms in 50 ms steps: the trail of a busy host, not a straggler
    views = job(1, 3_000_000, jitter_ns=100_000)
    assert [x.rank for x in lateness(views) if x.ratio > 0.9] == [1]
    assert stragglers(views) == []
    # last at 4 of 5 by 10 ms in 50 ms steps (the rank a barrier releases last): not one
    views = [_late_at(v, 1, 10_000_000, every=5) for v in job(None, 0, jitter_ns=100_000)]
    [x] = [x for x in lateness(views) if x.rank == 1]
    assert 0.75 <= x.ratio < 0.9 and stragglers(views) == []
    # always last by 10 ms of 50: a steady trail, flagged
    assert [x.rank for x in stragglers(job(1, 6_000_000, jitter_ns=100_000))] == [1]


def _late_at(v: RankView, rank: int, late_ns: int, every: int) -> RankView:
    """v, with rank ``rank`` late by late_ns at all but every ``every``-th collective."""
    if v.rank != rank:
        return v
    c = v.collectives[0]
    recent = tuple(Recent(x.seq, x.age_ns - (late_ns if x.seq % every else 0), x.op, x.bytes)
                   for x in c.recent)
    last = recent[-1]
    return RankView(node=v.node, pid=v.pid, comm=v.comm, rank=v.rank,
                    world_size=v.world_size, job=v.job, state=v.state,
                    collectives=[Collective(c.communicator, None, None, None, last.op,
                                            last.seq, last.age_ns, 0, recent)])


def test_flag_needs_consecutive_polls_and_so_does_recovery() -> None:
    w = StraggleWatch(flag_polls=2, calm_polls=3)
    healthy, slow = job(None, 0), job(3, 20_000_000)
    assert w.update(healthy, 0.01) == ([], [])
    assert w.update(slow, 0.01) == ([], [])  # one poll: not yet
    assert w.update(healthy, 0.01) == ([], [])  # a blip: the streak starts again
    assert w.update(slow, 0.01) == ([], [])
    flagged, _ = w.update(slow, 0.01)
    assert [s["rank"] for s in flagged] == [3] and "rank 3 (n3 pid 103)" in flagged[0]["summary"]
    assert w.update(slow, 0.01) == ([], [])  # flagged once, not again
    assert w.update(healthy, 0.01) == ([], [])
    assert w.update(slow, 0.01) == ([], [])  # late again: the calm count restarts
    assert w.update(healthy, 0.01) == ([], [])
    assert w.update(healthy, 0.01) == ([], [])
    _, recovered = w.update(healthy, 0.01)
    assert [s["rank"] for s in recovered] == [3]
    assert w.current() == []


def test_a_poll_whose_nodes_answered_far_apart_is_not_judged() -> None:
    """The detect bed's false alarms: after a disk fault, a poll whose answers came 415
    and 750 ms apart had a rank late at every collective. Such a poll neither counts
    towards a flag nor towards a recovery."""
    w = StraggleWatch(flag_polls=2, calm_polls=2)
    slow, healthy = job(3, 20_000_000), job(None, 0)
    assert w.update(slow, 0.01) == ([], [])
    assert w.update(job(1, 200_000_000), 0.415) == ([], [])  # not judged
    assert [k.rsplit(":", 1)[1] for k in w.streak] == ["3"]  # rank 1's poll not counted
    flagged, _ = w.update(slow, 0.01)  # rank 3's streak went on across it
    assert [s["rank"] for s in flagged] == [3]
    assert w.update(healthy, 0.01) == ([], [])
    assert w.update(slow, 0.75) == ([], [])  # not judged: not late, not calm either
    _, recovered = w.update(healthy, 0.01)
    assert [s["rank"] for s in recovered] == [3]
    fresh = StraggleWatch(flag_polls=2)
    for _ in range(3):
        assert fresh.update(job(1, 200_000_000), 0.5) == ([], [])
    assert fresh.streak == {}
    assert [s["rank"] for s in fresh.update(job(1, 200_000_000), 0.2)[0]] == []
    assert [s["rank"] for s in fresh.update(job(1, 200_000_000), 0.2)[0]] == [1]


def test_a_straggler_is_sent_firing_then_with_its_cause_then_resolved(tmp_path: Path) -> None:
    out = tmp_path / "got"
    n = Notifier(Delivery(command=["sh", "-c", f"cat >> {out}"]))
    w = StraggleWatch(flag_polls=1, calm_polls=1)
    w.update(job(0, 20_000_000), 0.01)
    [s] = w.current()

    async def go() -> list[list[str]]:
        sent = [await n.update([], None, now=1000.0, stragglers=[s])]
        sent.append(await n.update([], None, now=1001.0, stragglers=[s]))  # nothing new
        s["top_chain"] = {"root_cause": "cpu_contention", "severity": "high",
                          "summary": "runnable behind fleetd-hog", "culprit":
                          {"pid": 77, "comm": "fleetd-hog"}}
        sent.append(await n.update([], None, now=1003.0, stragglers=[s]))
        sent.append(await n.update([], None, now=1009.0))
        return [[f"{f['status']} {f['cause']} {f['culprit']}" for f in x] for x in sent]

    assert asyncio.run(go()) == [
        ["firing straggler python pid 100 on n0"], [],
        ["firing straggler: cpu_contention fleetd-hog pid 77"],
        ["resolved straggler: cpu_contention fleetd-hog pid 77"]]
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and '"kind":"straggler"' in lines[0]


def test_a_node_that_answered_first_is_not_late_once_its_ages_share_one_now() -> None:
    """Rank 2's node measured its ages 20 ms before the others (it answered first, the
    others were slower under load): read as they came, rank 2 entered every collective
    20 ms after the rest, a straggler at 2/5 of a step. With each node's read time its
    ages are counted from the same moment: nobody is late; and a rank truly 20 ms late
    on a node read 20 ms late stays late."""
    early = [_aged(v, -20_000_000) if v.node == "n2" else v for v in job(None, 0)]
    w = StraggleWatch(flag_polls=1)
    assert [s["rank"] for s in w.update(early, 0.03)[0]] == [2]
    read = {"n0": 5.0, "n1": 5.0, "n2": 4.98, "n3": 5.0}
    w = StraggleWatch(flag_polls=1)
    assert w.update(early, 0.03, read) == ([], [])
    late = [_aged(v, 20_000_000) if v.node == "n2" else v for v in job(2, 20_000_000)]
    w = StraggleWatch(flag_polls=1)
    assert [s["rank"] for s in w.update(late, 0.03, {**read, "n2": 5.02})[0]] == [2]


def _aged(v: RankView, by_ns: int) -> RankView:
    """v as its node would answer ``by_ns`` later (its ages larger by that)."""
    return dataclasses.replace(v, collectives=[dataclasses.replace(
        c, age_ns=c.age_ns + by_ns, recent=tuple(dataclasses.replace(x, age_ns=x.age_ns + by_ns)
                                                 for x in c.recent)) for c in v.collectives])


def test_a_rank_late_by_no_more_than_its_usual_trail_is_not_flagged() -> None:
    """A rank of a loaded host that entered last at 2 of 3 collectives by 6 ms for a
    minute, then at 19 of 20 by 7 ms for a few polls (the rule alone: a steady trail,
    flagged): beyond its usual trail it is 1 ms late, under the margin. The same rank
    20 ms late afterwards is flagged; with no minute of its own behind it, the rule
    alone judges (the 7 ms trail is flagged)."""
    t = [1000.0]
    usual = [_late_at(v, 1, 6_000_000, every=3) for v in job(None, 0, jitter_ns=100_000)]
    trail = [_late_at(v, 1, 7_000_000, every=20) for v in job(None, 0, jitter_ns=100_000)]
    assert [x.rank for x in stragglers(usual)] == [] and [x.rank for x in stragglers(trail)] == [1]
    w = StraggleWatch(flag_polls=2, own=OwnLateness(clock=lambda: t[0]))
    for _ in range(40):
        assert w.update(usual, 0.01) == ([], [])
        t[0] += 1.0
    for _ in range(4):
        assert w.update(trail, 0.01) == ([], [])
        t[0] += 1.0
    w.update(job(1, 20_000_000, jitter_ns=100_000), 0.01)
    got, _ = w.update(job(1, 20_000_000, jitter_ns=100_000), 0.01)
    assert [s["rank"] for s in got] == [1]
    fresh = StraggleWatch(flag_polls=2, own=OwnLateness(clock=lambda: t[0]))
    fresh.update(trail, 0.01)
    assert [s["rank"] for s in fresh.update(trail, 0.01)[0]] == [1]
