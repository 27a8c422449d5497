"""Wall-clock steps of +1 h and -1 h while a real `fleetd agent` traces (issue 45 point
4). The agent alone sees the steps (tests/clockshift: its CLOCK_REALTIME shifted by a
file's seconds, re-read every 100 ms; its monotonic clock, BPF's, untouched); the
workload and this test read the true time. Then: no negative duration, every call the
workload made is stored at its own true time (the session's mapping stays continuous,
so the timeline keeps its order across both steps), the session records the steps, and
a skew estimate from samples taken across a step follows the clock as it reads after it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import stamped
from agents import agent, request

from fleetd.fleet import skew

from conftest import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent traces: needs root")

HOUR_S = 3600
RESAMPLE_S = 11.0  # the tracer samples the clock every 10 s


def shim(tmp: Path) -> Path:
    out = tmp / "clockshift.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(out),
                    str(REPO / "tests/clockshift/clockshift.c"), "-ldl"], check=True)
    return out


def time_sample(url: str) -> skew.Sample:
    t0 = time.time_ns()
    status, body, raw = request(url, None, path="/api/v1/time")
    t3 = time.time_ns()
    assert status == 200, raw
    return skew.Sample(t0, body["t1_ns"], body["t2_ns"], t3)


def test_clock_steps_keep_the_timeline_and_are_recorded(tmp_path: Path) -> None:
    shift = tmp_path / "shift"
    shift.write_text("0\n")
    env = {"LD_PRELOAD": str(shim(tmp_path)), "CLOCKSHIFT_FILE": str(shift)}
    stamps = tmp_path / "stamps.bin"
    db = tmp_path / "node.db"
    with stamped.running(stamps, 400, 300) as wl, agent(
            db, "gpu-01", None, "--plain-http", "--pid", str(wl.pid), "--sample", "1",
            "--no-host", "--cpu-sample-hz", "0", env=env) as a:
        up = time.time_ns()
        time.sleep(1.0)
        before = [time_sample(a.url) for _ in range(3)]
        shift.write_text(f"{HOUR_S}\n")  # +1 h
        time.sleep(0.3)
        after = time_sample(a.url)
        time.sleep(RESAMPLE_S)
        shift.write_text("0\n")  # and back: -1 h
        time.sleep(RESAMPLE_S)
        stopped = time.time_ns()
        assert a.stop() == 0
        text = a.log.read_text()
    made = stamped.calls(stamps)

    # The skew estimate follows the node's clock within the query that sees the step:
    # samples from before it describe a clock that is gone.
    est = skew.estimate([*before, after])
    assert est is not None and abs(est.offset_ns - HOUR_S * 1e9) < 1e9, est
    assert abs(skew.estimate(before).offset_ns) < 1e9  # type: ignore[union-attr]

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        negative = c.execute("SELECT count(*) FROM event_data WHERE dur_ns < 0").fetchone()[0]
        steps, net, ended = c.execute(
            "SELECT json_extract(drops, '$.clock_steps'), json_extract(drops, "
            "'$.clock_step_ns'), ended_ns FROM session_data").fetchone()
    assert negative == 0
    # Every call from the start to a second before the stop, stored at its true time:
    # nothing moved by an hour either way, nothing out of order.
    kept = stamped.stored(db, wl.pid)
    window = stamped.made_in(made, up + 10**8, stopped - 10**9)
    unmatched = stamped.unmatched(window, kept)
    assert len(window) > 5000 and not unmatched, (len(window), unmatched)
    assert kept[0] >= up - 10**9 and kept[-1] <= stopped + 10**9
    # The session marks both steps, and its end is on its own continuous time.
    assert steps == 2 and abs(net) < 10**9, (steps, net)
    assert abs(ended - stopped) < 5 * 10**9
    assert "wall clock was stepped +3600" in text and "wall clock was stepped -3600" in text
