"""explain's first reads on two CPUs (fleetd.analyze.pernode.preload): the op statistics
and the rules' walk of the span read by a forked child on its own connection (or the
walk by a thread) are those the process reads itself, and a child that fails costs
only the time. The size bar is lowered so the shipped scenarios
(real ``fleetd trace`` output) take the forked path."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import fleetd.analyze.pernode.preload as preload_mod
from fleetd.analyze.causes.rules import dense_plan
from fleetd.analyze.facade import Analysis
from fleetd.analyze.pernode.preload import preload
from fleetd.analyze.reading.nodeview import NodeView
from fleetd.analyze.reading.spanreads import SpanRow
from fleetd.store.db import open_reader

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "tests" / "data" / "scenarios" / "host_sync.db"

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="the forked path needs two CPUs; CI has two")


def _analysis() -> Iterator[Analysis]:
    conn = open_reader(SCENARIO)
    try:
        yield Analysis.of(conn)
    finally:
        conn.close()


# Two analyses of the scenario, each on its own connection: one forked, one read here.
forked = pytest.fixture(_analysis, name="forked")
here = pytest.fixture(_analysis, name="here")


@pytest.fixture
def low_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scenario's window takes the forked path."""
    monkeypatch.setattr(preload_mod, "FORK_FROM_EVENTS", 1)


def test_forked_op_statistics_are_those_read_here(low_bar: None, forked: Analysis,
                                                  here: Analysis) -> None:
    preload(forked.slices, lambda: open_reader(SCENARIO))
    preload(here.slices)
    for a, b in zip(forked.slices, here.slices, strict=True):
        # The child's answer was taken: this process never read the durations.
        assert "_op_events" not in a.__dict__ and "_op_events" in b.__dict__
        assert a.ops == b.ops and a.ops
        assert a.op_stats(None, False) == b.op_stats(None, False)
        assert a.threads == b.threads


def test_a_child_that_fails_leaves_the_reading_here(low_bar: None, forked: Analysis,
                                                    here: Analysis, tmp_path: Path) -> None:
    # The file cannot be opened again (gone): the child exits 1, nothing is taken.
    preload(forked.slices, lambda: open_reader(tmp_path / "gone.db"))
    preload(here.slices)
    sl = forked.slices[0]
    assert "_op_events" in sl.__dict__  # read here after all
    assert sl.ops == here.slices[0].ops
    assert sl.op_stats(None, False) == here.slices[0].op_stats(None, False)


def test_a_small_window_is_not_forked(forked: Analysis) -> None:
    preload(forked.slices, lambda: (_ for _ in ()).throw(AssertionError("forked")))
    assert "_op_events" in forked.slices[0].__dict__


def test_explain_forked_prints_what_it_prints_alone(tmp_path: Path) -> None:
    """Through the command: the size bar lowered in the process itself, the JSON of
    ``fleetd explain --db`` the same as without the fork."""
    code = ("import sys, fleetd.analyze.pernode.preload as p; p.FORK_FROM_EVENTS = {bar}; "
            "from fleetd.cli.main import main; sys.argv = ['fleetd', 'explain', '--db', "
            f"{str(SCENARIO)!r}, '--format', 'json', '--quiet']; sys.exit(main())")

    def explain(bar: int) -> str:
        return subprocess.run([sys.executable, "-c", code.format(bar=bar)], check=True,
                              capture_output=True, text=True, timeout=300).stdout

    assert explain(1) == explain(10**12)


def _view(analysis: Analysis) -> tuple[NodeView, tuple[list[tuple[int, ...]], int, int,
                                                        list[int]]]:
    sl = analysis.slices[0]
    return (NodeView(sl.conn, sl.node, sl.window, sl.tasks, sl.names, sl.sums,
                     sl.stack_rows), dense_plan(sl.span, sl.sums))


def _dense(view: NodeView, plan: tuple[list[tuple[int, ...]], int, int, list[int]]
           ) -> tuple[list[dict[int, list[SpanRow]]], object]:
    """The rules' walk as the rules ask for it: each op set's calls per process, and
    the sleepers' sleep rows."""
    sets, t0, t1, tids = plan
    calls = [dict(view.calls_by_pid(ops, t0, t1, tuple(sets), tids)) for ops in sets]
    return calls, view.sleep_rows(tids, t0, t1)


def test_the_rules_walk_read_by_the_child_is_the_one_read_here(
        low_bar: None, forked: Analysis, here: Analysis) -> None:
    preload(forked.slices, lambda: open_reader(SCENARIO))
    sl = forked.slices[0]
    assert sl.calls_ahead is not None  # host_sync's process calls CUDA
    view, plan = _view(forked)
    view.await_calls(sl.calls_ahead)
    statements: list[str] = []
    forked.conn.set_trace_callback(statements.append)
    got = _dense(view, plan)
    forked.conn.set_trace_callback(None)
    assert not [s for s in statements if "event_data" in s]  # nothing read again
    want = _dense(*_view(here))
    assert got == want and any(got[0])


def test_a_child_that_fails_after_the_op_statistics_leaves_the_walk_here(
        low_bar: None, forked: Analysis, here: Analysis,
        monkeypatch: pytest.MonkeyPatch) -> None:

    def broken(*_: object) -> None:
        raise RuntimeError("the child fails in its second part")

    monkeypatch.setattr(preload_mod, "dense_plan", broken)  # inherited by the child
    preload(forked.slices, lambda: open_reader(SCENARIO))
    sl = forked.slices[0]
    assert "_op_events" not in sl.__dict__  # the first part was taken
    assert sl.calls_ahead is not None
    view, plan = _view(forked)
    view.await_calls(sl.calls_ahead)
    assert _dense(view, plan) == _dense(*_view(here))


def test_the_rules_walk_read_in_a_thread_is_the_one_read_here(forked: Analysis,
                                                              here: Analysis) -> None:
    view, plan = _view(forked)
    sets, t0, t1, tids = plan
    view.prefetch_calls(lambda: open_reader(SCENARIO), sets[0], t0, t1, tuple(sets),
                        tids)
    assert _dense(view, plan) == _dense(*_view(here))
