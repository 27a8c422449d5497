"""Entry-only launches and the always-on mode (#36) in the books: aggregate rows and op
statistics say which durations were measured and which figures are scaled, and never
turn an untimed call into a 0."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fleetd.analyze.pernode.opstats import _row
from fleetd.analyze.reading.data import Hist
from fleetd.store.catalog import BY_NAME
from fleetd.trace.accounting import ENTRY_ONLY_CODES, Histograms
from fleetd.trace.bpf.bpfsrc import NBUCKETS, probe_wrappers
from fleetd.trace.bpf.probes import SPECS
from fleetd.trace.dutycycle import DutyCycle

LAUNCH = BY_NAME["cudaLaunchKernel"].code
SYNC = BY_NAME["cudaStreamSynchronize"].code


def _hist(count: int, buckets: dict[int, tuple[int, int]], errors: int = 0) -> Any:
    b = [SimpleNamespace(count=buckets.get(i, (0, 0))[0], sum=buckets.get(i, (0, 0))[1])
         for i in range(NBUCKETS)]
    return SimpleNamespace(count=count, sum=sum(s for _, s in buckets.values()),
                           errors=errors, b=b)


class _Bpf:
    """The one map close_window reads: fl_hist, (pid << 32 | op) -> struct fl_hist."""

    def __init__(self, hists: dict[tuple[int, int], Any]) -> None:
        self._entries = [(SimpleNamespace(value=pid << 32 | op), h)
                         for (pid, op), h in hists.items()]

    def __getitem__(self, name: bytes) -> _Bpf:
        assert name == b"fl_hist"
        return self

    def items(self) -> list[tuple[Any, Any]]:
        return self._entries


def _rows(hists: dict[tuple[int, int], Any]) -> dict[tuple[int, int], tuple[int, int]]:
    rows = Histograms().close_window(_Bpf(hists), 1, lambda t: t, 10**9)
    return {(r[4], r[5]): (r[6], r[7]) for r in rows}


def test_entry_only_ops_are_the_sampled_launch_types() -> None:
    names = {s.op for s in SPECS if s.entry_only}
    assert names == {"cudaLaunchKernel", "cudaMemcpyAsync", "cuLaunchKernel",
                     "cuLaunchKernelEx", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2"}
    assert SYNC not in ENTRY_ONLY_CODES and LAUNCH in ENTRY_ONLY_CODES
    text = probe_wrappers({"cuda", "driver"})
    body = text[text.index("int fl_sess_multi"):]
    assert "OP_CUDALAUNCHKERNEL" in body and "OP_CUDASTREAMSYNCHRONIZE" not in body


def test_untimed_launches_get_their_own_row_and_an_estimated_sum() -> None:
    # 1,000 launches counted, 10 timed at 5 us each; a sync with every call timed
    rows = _rows({(7, LAUNCH): _hist(1000, {12: (10, 50_000)}, errors=2),
                  (7, SYNC): _hist(4, {20: (4, 4_000_000)})})
    assert rows[(LAUNCH, -3)] == (990, 0)
    assert rows[(LAUNCH, -1)] == (1000, 5_000_000)  # 50 us scaled by 1000 / 10
    assert rows[(LAUNCH, 12)] == (10, 50_000) and rows[(LAUNCH, -2)] == (2, 0)
    assert (SYNC, -3) not in rows and rows[(SYNC, -1)] == (4, 4_000_000)


def test_no_timed_launch_leaves_the_durations_unknown_not_zero() -> None:
    rows = _rows({(7, LAUNCH): _hist(50, {})})
    assert rows[(LAUNCH, -3)] == (50, 0) and rows[(LAUNCH, -1)] == (50, 0)
    h = Hist(count=50, total=0, untimed=50)
    node = SimpleNamespace(name="n")
    r = _row(node, 7, LAUNCH, None, h, 1.0, "python")  # type: ignore[arg-type]
    assert r["stats_from"] == "timed_sample" and r["count"] == 50
    assert r["total_ns"] is None and r["mean_ns"] is None and r["p50_ns"] is None


def test_a_timed_sample_gives_estimates_marked_as_such() -> None:
    h = Hist(count=1000, total=5_000_000, untimed=990)
    h.add_bucket(12, 10, 50_000)
    node = SimpleNamespace(name="n")
    r = _row(node, 7, LAUNCH, None, h, 1.0, "python")  # type: ignore[arg-type]
    assert r["stats_from"] == "timed_sample" and r["count"] == 1000
    assert r["total_ns"] == 5_000_000 and r["mean_ns"] == 5000 and r["p50_ns"] == 5000


# ---- the always-on mode's duty cycle -------------------------------------------------


class _Switch:
    def __init__(self, has: bool = True) -> None:
        self.calls: list[bool] = []
        self.has = has

    def set_launches(self, on: bool) -> bool:
        self.calls.append(on)
        return self.has


def test_duty_cycle_switches_and_counts_the_on_time() -> None:
    sw = _Switch()
    d = DutyCycle(sw, on_ns=100, period_ns=1000, start_ns=0)
    for now in (50, 120, 500, 999):
        d.tick(now)
    assert sw.calls == [False]  # off once past the on-time (a poll late: 120)
    d.tick(1010)
    assert sw.calls == [False, True]
    assert d.take_on_ns(1050, 1050) == 120 + 40  # the current on-period up to now
    d.tick(1105)
    assert sw.calls == [False, True, False]
    assert d.take_on_ns(2000, 950) == 55
    d.tick(5500)  # polls stalled for periods: the next on-period starts at once
    assert sw.calls[-1] is True and d.take_on_ns(5600, 100) is None  # on all along


def test_duty_cycle_without_launch_links_traces_continuously() -> None:
    sw = _Switch(has=False)
    d = DutyCycle(sw, on_ns=100, period_ns=1000, start_ns=0)
    d.tick(150)
    d.tick(1200)
    assert sw.calls == [False] and d.take_on_ns(2000, 2000) is None


def test_duty_scaled_rows_are_marked() -> None:
    hists = {(7, LAUNCH): _hist(100, {12: (1, 5000)}, errors=1),
             (7, SYNC): _hist(4, {20: (4, 4_000_000)})}
    h = Histograms()
    h.launch_on = lambda now, window: 10**8  # on 0.1 s of the 1 s window
    rows = {(r[4], r[5]): (r[6], r[7])
            for r in h.close_window(_Bpf(hists), 1, lambda t: t, 10**9)}
    assert rows[(LAUNCH, -1)] == (1000, 5_000_000) and rows[(LAUNCH, -3)] == (990, 0)
    assert rows[(LAUNCH, 12)] == (10, 50_000) and rows[(LAUNCH, -2)] == (10, 0)
    assert rows[(LAUNCH, -4)] == (10**8, 10**9)
    assert rows[(SYNC, -1)] == (4, 4_000_000) and (SYNC, -4) not in rows
