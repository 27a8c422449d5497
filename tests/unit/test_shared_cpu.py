"""Two busy loops taking turns on the feeding thread's CPU (found on a live case: hog-a
and hog-b, pinned beside the workload). The preempting task is always the same one and
the other always hands the CPU back, so charging each wait to the first taker named one
loop for 100% of the time two took. The wait is shared between the two ends, and the
fixes name both."""

from __future__ import annotations

from fleetd.analyze.causes.causes import fixes, summary
from fleetd.analyze.causes.chains import Chain
from fleetd.analyze.reading.nodeview import preempt_takers


def test_a_wait_with_two_takers_is_shared_and_with_one_is_not() -> None:
    assert preempt_takers(10, 21, 22, 8_000_001) == [(21, 4_000_001), (22, 4_000_000)]
    assert preempt_takers(10, 21, 21, 8_000_000) == [(21, 8_000_000)]
    assert preempt_takers(10, 21, 0, 8_000_000) == [(21, 8_000_000)]  # not recorded
    assert preempt_takers(10, 21, 10, 8_000_000) == [(21, 8_000_000)]  # itself: no taker


def _chain(shares: list[tuple[str, int, float]]) -> Chain:
    victim = {"comm": "python", "pid": 100, "tid": 100}
    culprits = [{"comm": c, "pid": p, "share": s} for c, p, s in shares]
    return Chain("n", "cpu_contention", victim, "cudaStreamSynchronize", [], 10**9,
                 culprits=culprits)


def test_fixes_name_every_loop_that_took_a_large_share() -> None:
    both = fixes(_chain([("hog-b", 201, 0.497), ("hog-a", 202, 0.495), ("kworker", 3, 0.006)]))
    assert any("renice -n 19 -p 201 202" in f and "hog-a (pid 202)" in f for f in both), both
    assert not any("kworker" in f for f in both)
    one = fixes(_chain([("cpu-hog", 201, 0.99), ("kworker", 3, 0.01)]))
    assert any("renice -n 19 -p 201," in f and "run it with" in f for f in one), one


def test_the_summary_does_not_give_one_loop_the_whole_share() -> None:
    ch = _chain([("hog-b", 201, 0.497), ("hog-a", 202, 0.495)])
    ch.explained = 1.0
    ch.spikes = [object()]  # type: ignore[list-item]  # a chain of stalls: its why
    ch.detail = {"worst_ns": 8_000_000, "kind": "stall"}
    text = summary(ch)
    assert "hog-b (pid 201) and others ran for 100% of the extra time, hog-b 50% of it" in text
