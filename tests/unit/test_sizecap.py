"""The headroom the writer keeps below store.max_bytes for what the files add beyond the
data (one commit, the WAL): measured maxima, from a start sized by the commit, never by
the cap alone."""

from __future__ import annotations

import logging

import pytest

from fleetd.store.sizecap import SizeCap, rows_per_txn, wal_limit_bytes


def test_a_large_cap_keeps_a_headroom_of_its_commits_not_a_share_of_itself() -> None:
    cap = 10 * 2**30
    size = SizeCap(cap, min(50_000, rows_per_txn(cap)))
    assert wal_limit_bytes(cap) == 4 * 2**20
    assert size.headroom < cap // 100  # 23 MiB: a 50,000-row commit and a 4 MiB WAL


def test_measured_maxima_raise_the_headroom_and_never_lower_it() -> None:
    size = SizeCap(32 * 2**20, 6_990)
    start = size.target()
    size.observe(3 * 2**20, 9 * 2**20)  # a flood's commit, a reader holding the WAL
    raised = size.target()
    size.observe(10_000, 100_000)
    assert raised < start and size.target() == raised
    assert size.target() == 32 * 2**20 - 12 * 2**20


def test_a_cap_too_small_for_its_commits_keeps_half_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    size = SizeCap(2 * 2**20, 1_000)
    with caplog.at_level(logging.WARNING, "fleetd.store.sizecap"):
        size.observe(600_000, 900_000)
        assert size.target() == 2**20
        assert size.target() == 2**20
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "raise store.max_bytes" in warned[0], warned
