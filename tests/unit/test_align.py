"""Collective numbers aligned across ranks (fleetd/analyze/distributed/align.py), on synthetic call
sequences: ranks traced from different moments (offsets found from the op/size
sequence, or from the arrival times when it repeats), ambiguity kept when neither
decides, restarted numbering, and the arrival analysis over a recording of ranks whose
agents attached late (fleetd/analyze/distributed/collectives.py)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from collective_synth import four_ranks, write_job
from synth import MS, US

from fleetd.analyze.distributed import align
from fleetd.analyze.distributed.align import Call
from fleetd.analyze.facade import Analysis
from fleetd.store.db import open_reader

OPS = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter")


def job(n: int, attach: dict[int, int], *, step: int = 30 * MS, sizes: Any = None,
        ops: Any = None, late: dict[int, int] | None = None, jitter: int = 300 * US,
        seed: int = 3, ranks: int = 4) -> dict[int, list[Call]]:
    """Each rank's calls of n lockstep collectives; rank r traced from instance
    attach[r] on (numbered from 1 there)."""
    rng = random.Random(seed)
    out: dict[int, list[Call]] = {}
    for r in range(ranks):
        first = attach.get(r, 0)
        calls = []
        for k in range(first, n):
            t = k * step + rng.randrange(jitter) + (late or {}).get(r, 0)
            size = sizes(k) if sizes else 4096
            op = ops(k) if ops else "ncclAllReduce"
            calls.append(Call(k - first + 1, t, op, size))
        out[r] = calls
    return out


def truth(attach: dict[int, int], ranks: int = 4) -> dict[int, int]:
    """The offsets that put every rank into the numbering of the rank traced longest."""
    first = min(attach.get(r, 0) for r in range(ranks))
    return {r: attach.get(r, 0) - first for r in range(ranks)}


# ---- from the op/size sequence --------------------------------------------------------------


def test_sizes_that_change_every_step_give_the_offsets() -> None:
    attach = {0: 40, 1: 3, 2: 27, 3: 12}
    al = align.align(job(200, attach, sizes=lambda k: 4 * (1024 + k)))
    assert al.offsets == truth(attach)
    assert (al.method, al.confidence, al.by()) == ("calls", "high", "signature")
    assert "aligned from the ops and sizes" in al.describe()
    assert all(p.pairs >= align.MIN_PAIRS for r, p in al.pairs.items() if r != al.reference)


def test_a_late_rank_does_not_confuse_a_signature_alignment() -> None:
    attach = {0: 10, 1: 0, 2: 5, 3: 7}
    # rank 2 is late by most of a step: timing alone could not tell which step it is in
    calls = job(120, attach, sizes=lambda k: 4 * (1000 + k), late={2: 25 * MS})
    al = align.align(calls)
    assert al.offsets == truth(attach) and al.confidence == "high"


def test_a_mix_of_ops_with_repeating_sizes_is_aligned_by_the_ops() -> None:
    attach = {0: 0, 1: 2, 2: 1, 3: 4}
    al = align.align(job(80, attach, ops=lambda k: OPS[k % 5] if k % 7 else OPS[0]))
    assert al.offsets == truth(attach)


# ---- from the arrival times -------------------------------------------------------------------


def test_a_repeating_sequence_is_aligned_by_the_arrival_times() -> None:
    attach = {0: 31, 1: 0, 2: 18, 3: 5}
    al = align.align(job(150, attach), lambda a, b: 1 * MS)
    assert al.offsets == truth(attach)
    assert al.confidence == "medium" and al.by() == "timing"
    p = al.pairs[0]
    assert p.residual_ns is not None and p.runner_up_ns is not None
    assert p.residual_ns < 1 * MS and p.runner_up_ns > 25 * MS


def test_a_period_of_five_is_told_apart_by_signature_and_timing() -> None:
    attach = {0: 0, 1: 12, 2: 3, 3: 9}
    al = align.align(job(100, attach, sizes=lambda k: 4096 * (1 + k % 5)),
                     lambda a, b: 2 * MS)
    assert al.offsets == truth(attach) and al.confidence == "medium"
    assert al.pairs[1].agreeing > 1  # several offsets agree with the sizes


def test_a_clock_error_as_large_as_a_step_leaves_it_ambiguous() -> None:
    attach = {0: 0, 1: 7}
    al = align.align(job(60, attach, ranks=2), lambda a, b: 40 * MS)
    other = 1 if al.reference == 0 else 0
    assert al.confidence == "ambiguous" and not al.sure(other)
    assert "repeats" in al.pairs[other].reason


def test_an_unknown_clock_error_leaves_a_repeating_sequence_ambiguous() -> None:
    al = align.align(job(60, {1: 7}, ranks=2), lambda a, b: None)
    assert al.confidence == "ambiguous"


def test_a_rank_late_by_half_a_step_is_ambiguous_and_keeps_its_numbers() -> None:
    # 20 ms late in a 50 ms step: "20 ms late" or "30 ms early" fit the times equally.
    calls = job(60, {}, step=50 * MS, late={2: 20 * MS})
    al = align.align(calls, lambda a, b: 0)
    assert not al.sure(2) and al.sure(1) and al.confidence == "ambiguous"
    assert al.offsets[2] == al.offsets[0]  # the numbers as recorded are among the tied


def test_ops_that_never_agree_are_ambiguous() -> None:
    calls = {0: [Call(k + 1, k * 30 * MS, "ncclAllReduce", 4096) for k in range(40)],
             1: [Call(k + 1, k * 30 * MS, "ncclBroadcast", 4096) for k in range(40)]}
    al = align.align(calls)
    assert al.confidence == "ambiguous"
    assert "no call of the same op and size" in (al.pairs[1].reason or al.pairs[0].reason)


def test_too_few_calls_keep_the_numbers_unverified() -> None:
    calls = {0: [Call(12, 0, "ncclAllReduce", 0)], 1: [Call(11, -MS, "ncclAllReduce", 0)]}
    al = align.align(calls)
    assert al.offsets == {0: 0, 1: 0} and al.confidence == "unverified"
    assert al.sure(0) and al.sure(1)


def test_calls_far_apart_in_time_keep_the_numbers_unverified() -> None:
    calls = {0: [Call(k + 1, k * MS, "ncclAllReduce", 4 * k) for k in range(10)],
             1: [Call(k + 1, 10**12 + k * MS, "ncclAllReduce", 4 * k) for k in range(10)]}
    assert align.align(calls).confidence == "unverified"


# ---- stretches and fixed sources ----------------------------------------------------------------


def test_numbers_that_start_again_are_cut_into_stretches() -> None:
    calls = [Call(s, t, "ncclAllReduce", 0) for t, s in enumerate([5, 6, 7, 1, 2, 3, 9])]
    assert [[c.seq for c in x] for x in align.stretches(calls)] == [[5, 6, 7], [1, 2, 3, 9]]


def test_communicator_counters_are_exact_and_missing_history_unverified() -> None:
    al = align.communicator([0, 1, 2])
    assert (al.confidence, al.offsets, al.sure(2)) == ("exact", {0: 0, 1: 0, 2: 0}, True)
    assert "communicator's creation" in al.describe()
    old = align.as_numbered([0, 1])
    assert old.confidence == "unverified" and "not verified" in old.describe()


@pytest.mark.parametrize("seed", range(6))
def test_random_attach_moments_and_order(seed: int) -> None:
    rng = random.Random(seed)
    attach = {r: rng.randrange(0, 90) for r in range(4)}
    calls = job(300, attach, sizes=lambda k: 4 * (2048 + k), seed=seed,
                late={rng.randrange(4): 15 * MS})
    al = align.align(calls, lambda a, b: 2 * MS)
    assert al.offsets == truth(attach), (attach, al.pairs)
    assert al.confidence == "high"


# ---- the arrival analysis over late-attached ranks ---------------------------------------------


def report(db: Path) -> dict[str, Any]:
    conn = open_reader(db)
    try:
        return Analysis.of(conn).collectives()
    finally:
        conn.close()


def test_late_attached_ranks_are_aligned_and_the_late_rank_is_named(tmp_path: Path) -> None:
    attach = {0: 9, 1: 0, 2: 23, 3: 4}
    db = write_job(tmp_path, four_ranks(late_rank=3, delay=15 * MS), n=120,
                   step=40 * MS, matching="torchrun", attach=attach,
                   nbytes=lambda k: 4 * (1024 + k))["gpu-01"]
    found = report(db)
    [comm] = found["communicators"]
    al = comm["alignment"]
    assert (al["method"], al["confidence"], al["by"]) == ("calls", "high", "signature")
    assert {s["rank"]: s["offset"] for s in al["stretches"]} == truth(attach)
    assert found["alignment"]["confidence"] == "high"
    assert comm["op_mismatch"] == 0 and comm["judged"] == 120 - 23
    [s] = found["stragglers"]
    assert s["rank"] == 3 and abs(s["lateness_p50_ns"] - 15 * MS) < 1 * MS


def test_raw_numbers_of_late_attached_ranks_would_have_named_the_wrong_rank(
        tmp_path: Path) -> None:
    """The same job, its calls matched as numbered: what the analysis did before."""
    attach = {0: 9, 1: 0, 2: 23, 3: 4}
    calls = job(120, attach, sizes=lambda k: 4 * (1024 + k), step=40 * MS,
                late={3: 15 * MS})
    # As numbered, rank 1 (traced first, its numbers highest) is "behind" everyone.
    last = [max(calls, key=lambda r: next(c.t_ns for c in calls[r] if c.seq == n))
            for n in range(1, 90)]
    assert set(last) == {2}  # the one traced last looks the latest, by 23 steps
    al = align.align(calls)
    fixed = [max(calls, key=lambda r, n=n: next(c.t_ns for c in calls[r]
                                                 if c.seq + al.offsets[r] == n))
             for n in range(30, 110)]
    assert set(fixed) == {3}


def test_the_table_says_how_ranks_were_matched(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from fleetd.cli.main import main

    db = write_job(tmp_path, four_ranks(), matching="torchrun", attach={1: 3},
                   nbytes=lambda k: 4 * (512 + k))["gpu-01"]
    assert main(["collectives", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "matched by collective numbers aligned from the ops and sizes of the calls " \
        "(1 rank(s) renumbered), high confidence" in out
