"""Clock samples from the answers' own stamps: what a node's headers may say, and when the
client adds its one extra ``/api/v1/time`` sample."""

from __future__ import annotations

import pytest

from fleetd.fleet import fanout, skew
from fleetd.fleet.client import ClockLog, stamp_of
from fleetd.wire.headers import RECV_NS as RECV_HEADER
from fleetd.wire.headers import SEND_NS as SEND_HEADER

T0 = 1_700_000_000_000_000_000


def _headers(t1: object, t2: object) -> dict[str, str]:
    return {RECV_HEADER: str(t1), SEND_HEADER: str(t2)}


def test_a_stamped_answer_is_a_sample() -> None:
    # Node 2.5 s ahead, 200 us each way, 3 ms of SQL between t1 and t2.
    t1 = T0 + 2_500_000_000 + 200_000
    t2 = t1 + 3_000_000
    stamp = stamp_of(_headers(t1, t2), T0, T0 + 3_400_000)
    assert stamp is not None
    s = skew.Sample(*stamp)
    assert s.offset_ns == 2_500_000_000 and s.rtt_ns == 400_000


@pytest.mark.parametrize("t1,t2", [
    ("1e300", "1"), ("-5", "7"), ("12a", "13"), ("9" * 20, "9" * 20),  # not int64 ns
    ("9" * 19, "9" * 19), ("\u0661\u0662", "\u0663\u0664"),  # beyond int64; not ASCII
    (T0 + 10, T0 + 5),  # answered before it was asked
    ("", T0),
])
def test_stamps_that_are_no_clock_reading_are_ignored(t1: object, t2: object) -> None:
    assert stamp_of(_headers(t1, t2), T0, T0 + 1) is None


def test_missing_stamps_are_no_sample() -> None:
    assert stamp_of({}, T0, T0 + 1) is None
    assert stamp_of({RECV_HEADER: str(T0)}, T0, T0 + 1) is None


def _log(rtt_ns: int, new_connection: bool) -> ClockLog:
    return ClockLog([(T0, T0 + 10, T0 + 10, T0 + rtt_ns)], new_connection)


def test_one_extra_sample_only_after_a_slow_first_exchange() -> None:
    slow = 2 * fanout.EXTRA_SAMPLE_ABOVE_NS + 2
    assert fanout._worth_a_sample(ClockLog([]))  # no stamps at all
    assert fanout._worth_a_sample(_log(slow, new_connection=True))
    # A warm connection's slow exchange: another sample would meet the same delays.
    assert not fanout._worth_a_sample(_log(slow, new_connection=False))
    assert not fanout._worth_a_sample(_log(100_000, new_connection=True))
