"""One window, parsed once (#46 item 3): :class:`fleetd.store.bounds.Bounds` is built
from the user's words or a request's parameters, travels as parameters that are read
straight back into a Bounds, and is resolved against the data into the half-open
:class:`Window`; ``--to`` is inclusive everywhere it is written."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest

from fleetd.analyze.pernode.opstats import op_stats
from fleetd.analyze.reading.window import resolve, resolve_window
from fleetd.errors import QueryError, UsageError
from fleetd.questions.catalog import OPS, PODS
from fleetd.store.bounds import ABSOLUTE, RELATIVE, WHOLE, Bounds
from fleetd.store.db import open_reader

from conftest import REPO

SCENARIO = REPO / "tests" / "data" / "scenarios" / "cpu_hog.db"
NOW = 1_800_000_000_000_000_000


@pytest.fixture
def conn() -> Iterator[sqlite3.Connection]:
    c = open_reader(SCENARIO)
    try:
        yield c
    finally:
        c.close()


def _sync_times(conn: sqlite3.Connection) -> list[int]:
    """The start times of the recording's cudaStreamSynchronize events, in order."""
    return [int(r[0]) for r in conn.execute(
        "SELECT ts_ns FROM events WHERE op = 'cudaStreamSynchronize' ORDER BY ts_ns")]


def _syncs(conn: sqlite3.Connection, bounds: Bounds) -> int:
    rows = op_stats(conn, resolve(conn, bounds))
    return next((int(r["count"]) for r in rows if r["op"] == "cudaStreamSynchronize"), 0)


@pytest.mark.parametrize("words", [("5m", None, None), (None, "1750000000", "1750000060"),
                                   (None, "2026-11-23T02:00:00Z", None),
                                   (None, None, "1750000060123456789"), (None, None, None)])
def test_what_is_sent_is_read_back_as_the_same_window(words: tuple[str | None, ...]) -> None:
    sent = Bounds.parse(*words, now_ns=NOW)
    for offset in (0, 2_500_000_000, -7):
        back = Bounds.from_params(sent.params(offset), now_ns=NOW)
        moved = 0 if sent.origin == RELATIVE else offset  # "the last 5m" is any clock's
        assert back.origin == sent.origin
        assert back.start_ns == (None if sent.start_ns is None else sent.start_ns + moved)
        assert back.last_ns == (None if sent.last_ns is None else sent.last_ns + moved)
        assert back.since == sent.since


def test_the_registry_carries_the_window_beside_the_parameters() -> None:
    window = Bounds.parse(None, "1750000000", "1750000060")
    params = OPS.values({"pid": 7, "by": "kernel"})
    sent = OPS.query(window, params, 5)
    assert sent == {"from": "1750000000000000005", "to": "1750000060000000005", "pid": "7",
                    "by": "kernel"}
    assert OPS.parse(sent) == params
    assert OPS.window(sent).inclusive() == (1_750_000_000_000_000_005,
                                            1_750_000_060_000_000_005)
    # A question without a window sends none and reads the whole recording.
    assert PODS.query(window, PODS.values({}), 5) == {}
    assert PODS.window({"since": "junk"}) == Bounds()


def test_to_is_inclusive_from_the_flag_to_the_rows(conn: sqlite3.Connection) -> None:
    syncs = _sync_times(conn)
    first, edge = syncs[0], syncs[9]
    window = Bounds.parse(None, str(first), str(edge))
    assert window.inclusive() == (first, edge) and window.end_ns == edge + 1
    assert resolve(conn, window).end_ns == edge + 1  # the half-open end, derived once
    assert _syncs(conn, window) == 10  # the event at --to itself is in the window
    assert _syncs(conn, Bounds.parse(None, str(first), str(edge - 1))) == 9
    # Read back on a node, the same ten.
    assert _syncs(conn, Bounds.from_params(window.params())) == 10


def test_relative_absolute_and_whole_resolve_as_before(conn: sqlite3.Connection) -> None:
    whole = resolve(conn, Bounds())
    assert whole.label == "whole recording" and not whole.warnings
    last = resolve_window(conn, since="5m", now_ns=NOW)
    assert (last.start_ns, last.end_ns, last.label) == (NOW - 300 * 10**9, NOW + 1, "last 5m")
    assert "no events in the last 5m" in last.warnings[0]
    part = resolve(conn, Bounds.parse(None, str(whole.start_ns + 10**9), None))
    assert (part.start_ns, part.end_ns) == (whole.start_ns + 10**9, whole.end_ns)
    assert Bounds.parse("5m", now_ns=NOW).pinned() == Bounds(
        ABSOLUTE, NOW - 300 * 10**9, None, None, "last 5m")
    assert Bounds().origin == WHOLE and Bounds().pinned() == Bounds()


def test_a_bad_window_is_one_error_quoting_it(conn: sqlite3.Connection) -> None:
    with pytest.raises(UsageError, match="not before --to '1750000000'"):
        Bounds.parse(None, "1750000060", "1750000000")
    with pytest.raises(UsageError, match="not both"):
        Bounds.parse("5m", "1750000000")
    with pytest.raises(QueryError) as peer:
        Bounds.from_params({"to": "yesterday-ish"})
    assert peer.value.code == "bad_request" and "yesterday-ish" in peer.value.message
    # An open side filled from the data that crosses the other is refused too.
    extent_end = resolve(conn, Bounds()).end_ns
    with pytest.raises(UsageError, match="holds no time"):
        resolve(conn, Bounds.parse(None, str(extent_end + 10**9), None))
