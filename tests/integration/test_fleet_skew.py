"""Clock skew on a namespace fleet: one host's clock runs 2.5 s ahead (libfaketime).

That host records its events with its own (shifted) clock and serves them from an agent
under the same clock. The fleet client must estimate the offset within 1 ms and move
the host's timestamps back into real time, unless told not to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, build_db
from netbed import FAKETIME_LIB, NetBed, why_unavailable

_WHY = why_unavailable() or (None if Path(FAKETIME_LIB).exists()
                             else f"libfaketime is not installed ({FAKETIME_LIB})")
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

SHIFT_S = 2.5
# Monotonic time stays real: only the wall clock is wrong, as on a badly synced host.
FAKED = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"+{SHIFT_S}s",
         "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
EVENTS = 200  # 1 ms apart, ending when written
SQL = ("SELECT node, min(ts_ns) AS first_ts_ns, max(ts_ns) AS last_ts_ns, count(*) AS n "
       "FROM events GROUP BY node")


def _write_db_under(env: dict[str, str], path: Path, node: str) -> tuple[int, int]:
    """Write a database in a process with this clock, its events stamped like a tracer's:
    ``EVENTS`` events 1 ms apart, the last one at the writer's "now" minus 1 ms.

    Returns the real wall-clock interval in which that "now" was read. The writer's
    monotonic clock is not faked, so its monotonic readings around the stamping map onto
    real wall time through one (monotonic, wall) pair read here.
    """
    code = ("import sys, time; sys.path.insert(0, 'tests'); from pathlib import Path; "
            "from conftest import synthetic_events; "
            "from fleetd.store.writer import BatchWriter; "
            f"m0 = time.monotonic_ns(); rows = synthetic_events({EVENTS}); "
            "m1 = time.monotonic_ns(); "
            f"w = BatchWriter(Path({str(path)!r}), {node!r}); "
            "w.add_processes([{'pid': 4242, 'comm': 'train_loop'}]); "
            "w.add_events(rows); w.close(); print(m0, m1)")
    mono, wall = time.monotonic_ns(), time.time_ns()
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, text=True,
                         capture_output=True, env={**os.environ, **env}, timeout=60).stdout
    m0, m1 = (int(x) for x in out.split()[-2:])
    return wall + (m0 - mono), wall + (m1 - mono)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from netbed import netbed

    tmp = tmp_path_factory.mktemp("skew")
    with netbed(tmp / "bed", 3) as bed:
        shifted = bed.hosts[1]
        real_span = _write_db_under(FAKED, tmp / f"{shifted.name}.db", shifted.name)
        for h in bed.hosts:
            if h is shifted:
                bed.start_agent(h, db=tmp / f"{h.name}.db", env=FAKED)
            else:
                bed.start_agent(h, db=build_db(tmp / f"{h.name}.db", node=h.name, n=EVENTS))
        bed.wait_agents()
        yield bed, shifted, real_span


def _query(bed: NetBed, *extra: str) -> dict[str, Any]:
    proc = bed.client("query", "--nodes", bed.nodes_arg(), *bed.client_tls_args(), *extra,
                      "--format", "json")
    assert proc.returncode == 0, proc.stderr
    obj: dict[str, Any] = json.loads(proc.stdout)
    return obj


def _by_node(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r[0]: dict(zip(obj["columns"], r, strict=True)) for r in obj["rows"]}


def test_offset_is_estimated_within_a_millisecond(fleet: Any) -> None:
    bed, shifted, _ = fleet
    obj = _query(bed, SQL)
    skew = obj["skew"]
    print(skew)
    assert set(skew) == {h.name for h in bed.hosts}
    assert abs(skew[shifted.name]["offset_ms"] - SHIFT_S * 1000) < 1.0, skew
    for h in bed.hosts:
        if h is not shifted:
            assert abs(skew[h.name]["offset_ms"]) < 1.0, skew
        assert 0 < skew[h.name]["error_ms"] < 5.0, skew
    warned = [w for w in obj["warnings"] if w["kind"] == "skew"]
    assert [w["node"] for w in warned] == [shifted.name]
    assert "ahead" in warned[0]["error"] and "corrected" in warned[0]["error"]


def test_timestamps_are_corrected_into_real_time(fleet: Any) -> None:
    bed, shifted, (stamped_from, stamped_to) = fleet
    corrected = _by_node(_query(bed, SQL))[shifted.name]
    raw = _by_node(_query(bed, SQL, "--no-skew-correct"))[shifted.name]
    # The last event was stamped with the writer's clock 1 ms before its "now", read in
    # [stamped_from, stamped_to] of real time. As recorded, it lies 2.5 s later.
    slack = 2_000_000  # the offset's error (well under 1 ms) plus the readings' own
    last = 1_000_000
    assert stamped_from - slack <= corrected["last_ts_ns"] + last <= stamped_to + slack, (
        corrected, stamped_from, stamped_to)
    shift = raw["last_ts_ns"] - corrected["last_ts_ns"]
    assert abs(shift - SHIFT_S * 1e9) < 1e6
    assert stamped_from + SHIFT_S * 1e9 - slack <= raw["last_ts_ns"] + last
    assert raw["first_ts_ns"] - corrected["first_ts_ns"] == shift  # one offset per node
    assert corrected["last_ts_ns"] - corrected["first_ts_ns"] == (EVENTS - 1) * 1_000_000
    assert raw["n"] == corrected["n"] == EVENTS


def test_every_ts_column_is_corrected_row_by_row(fleet: Any) -> None:
    bed, shifted, _ = fleet
    sql = "SELECT ts_ns, dur_ns FROM events ORDER BY ts_ns LIMIT 20"
    fixed = [r for r in _query(bed, sql)["rows"] if r[0] == shifted.name]
    raw = [r for r in _query(bed, sql, "--no-skew-correct")["rows"] if r[0] == shifted.name]
    assert len(fixed) == len(raw) == 20
    shifts = {r[1] - f[1] for r, f in zip(raw, fixed, strict=True)}
    assert len(shifts) == 1 and abs(shifts.pop() - SHIFT_S * 1e9) < 1e6
    assert [r[2] for r in raw] == [f[2] for f in fixed]  # durations are not clock readings


def test_show_skew_prints_offsets_and_threshold_is_honoured(fleet: Any) -> None:
    bed, shifted, _ = fleet
    proc = bed.client("query", "--nodes", bed.nodes_arg(), *bed.client_tls_args(), SQL,
                      "--show-skew", "--clock-skew-threshold", "5s")
    assert proc.returncode == 0, proc.stderr
    assert "clock skew" in proc.stderr and shifted.name in proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith(shifted.name))
    # The 1 ms accuracy is the test above's; here the printed offset must hold the true
    # shift within the error it prints beside it (a loaded CI run printed 2497.93 ms
    # with an error of 2.497 ms).
    offset_ms, error_ms = float(line.split()[1]), float(line.split()[2])
    assert abs(offset_ms - SHIFT_S * 1000) <= max(1.0, error_ms), line
    assert "fleetd: warning" not in proc.stderr  # 2.5 s is under a 5 s threshold
