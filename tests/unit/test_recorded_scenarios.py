"""Diagnoses of the real recordings in tests/data/scenarios (made by tests/recorder.py).

Each database was recorded on one of our CPU-only machines with the reference workload,
the real CUDA runtime and the real tracer; ``fleetd explain`` must name the injected
problem's root cause and culprit, cite evidence that exists in the file, and propose a
fix; the quiet baseline must have no HIGH chain.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from perfetto_check import load, validate
from recorder import (
    DEFAULT_FLEET_OUT,
    DEFAULT_OUT,
    FLEET,
    SCENARIOS,
    Scenario,
    explain,
    fleet_problems,
    problems,
    verdict,
)

from conftest import FLEETD

MAX_BYTES = 1 << 20  # "small": each recording stays under 1 MiB


@cache
def _report(name: str) -> dict[str, Any]:
    return explain(DEFAULT_OUT / f"{name}.db")


def _workload_pid(db: Path) -> int:
    """The traced process: the one that made the CUDA calls."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        (pid,) = c.execute("SELECT pid FROM events WHERE source = 'cuda' GROUP BY pid "
                           "ORDER BY count(*) DESC LIMIT 1").fetchone()
    return int(pid)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_recording_is_small_and_real(name: str) -> None:
    db = DEFAULT_OUT / f"{name}.db"
    assert db.exists(), f"missing {db}: sudo .venv/bin/python tests/recorder.py {name}"
    assert db.stat().st_size < MAX_BYTES
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        (errors,) = c.execute("SELECT count(*) FROM events WHERE source = 'cuda' "
                              "AND ret IN (35, 100)").fetchone()
        (calls,) = c.execute("SELECT count(*) FROM events WHERE source = 'cuda'").fetchone()
        (host,) = c.execute("SELECT count(*) FROM events WHERE source = 'sched'").fetchone()
    # Recorded over the real runtime without a GPU: every stored call failed with
    # no-driver/no-device, and the scheduler probes saw the same process.
    assert calls > 100 and errors == calls
    assert host > 0


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s.expect_root])
def test_explain_names_cause_and_culprit(name: str) -> None:
    sc = SCENARIOS[name]
    report = _report(name)
    assert problems(sc, report) == []
    chain = verdict(sc, report)
    assert chain is not None
    assert chain["victim"]["pid"] == _workload_pid(DEFAULT_OUT / f"{name}.db")
    assert chain["fixes"] and all(isinstance(f, str) and len(f) > 20 for f in chain["fixes"])
    _evidence_is_in_the_file(DEFAULT_OUT / f"{name}.db", chain)


def _evidence_is_in_the_file(db: Path, chain: dict[str, Any]) -> None:
    """Every cited event is in the file; spikes, stalls and off-CPU intervals as cited."""
    assert chain["evidence"]
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        for e in chain["evidence"]:
            if "id" not in e:
                continue
            row = c.execute("SELECT ts_ns, dur_ns FROM events WHERE id = ?",
                            (e["id"],)).fetchone()
            assert row is not None, e["id"]
            if "ts_ns" in e and e["kind"] in ("spike", "stall", "off_cpu"):
                assert row == (e["ts_ns"], e["dur_ns"])


def test_quiet_baseline_has_no_high_chain() -> None:
    report = _report("quiet")
    assert problems(SCENARIOS["quiet"], report) == []
    assert not [c for c in report["chains"] if c["severity"] == "HIGH"]


@pytest.mark.parametrize("name", ["cpu_hog", "lock_wait", "block_io", "dataloader"])
def test_culprit_is_what_was_injected_not_a_bystander(name: str) -> None:
    """The check is not vacuous: another scenario's report fails this scenario's check."""
    sc = SCENARIOS[name]
    assert problems(sc, _report("quiet"))
    other = "cpu_hog" if name != "cpu_hog" else "lock_wait"
    assert problems(sc, _report(other))


def test_expectations_cover_every_root_cause_the_issue_names() -> None:
    wanted = {"cpu_contention", "dataloader_oversubscription", "host_sync", "block_io",
              "lock_wait", "alloc_churn", "lock_contention", "data_starvation"}
    assert {s.expect_root for s in SCENARIOS.values()} - {None} == wanted
    assert all(isinstance(s, Scenario) and s.about for s in SCENARIOS.values())


def test_readme_lists_every_recording() -> None:
    text = (DEFAULT_OUT / "README.md").read_text()
    for name in SCENARIOS:
        assert f"`{name}.db`" in text


def test_fleet_set_names_the_straggler_and_merges_again_to_the_same_rows(
        tmp_path: Path) -> None:
    """investigations/fleet: three node recordings and their merge (recorder --fleet)."""
    out = DEFAULT_FLEET_OUT
    report = explain(out / "cluster.db")
    assert fleet_problems(report) == []
    assert sorted(report["nodes"]) == list(FLEET)
    again = tmp_path / "again.db"
    done = subprocess.run([FLEETD, "merge", *(str(out / f"{n}.db") for n in FLEET), "-o",
                           str(again)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    q = "SELECT node, count(*), sum(dur_ns) FROM events GROUP BY node ORDER BY node"
    with sqlite3.connect(f"file:{out / 'cluster.db'}?mode=ro", uri=True) as a, \
            sqlite3.connect(f"file:{again}?mode=ro", uri=True) as b:
        assert a.execute(q).fetchall() == b.execute(q).fetchall()
    assert (out / "cluster.db").stat().st_size < 2 * MAX_BYTES


def test_fleet_merge_opens_as_one_timeline(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json.gz"
    done = subprocess.run([FLEETD, "export", "--format", "perfetto", "--db",
                           str(DEFAULT_FLEET_OUT / "cluster.db"), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    s = validate(load(out))
    assert sorted(s.processes.values()) == list(FLEET)
    # The straggler's chain is on the timeline, as a marker naming the hog.
    assert any("cpu-hog" in json.dumps(m, default=str) for m in s.markers)


WALL_KEYS = ("running_ns", "runq_ns", "irq_ns", "d_state_ns", "lock_ns", "data_ns",
             "timer_ns", "gpu_sync_ns", "other_ns")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_breakdown_columns_add_up_to_the_wall_time(name: str) -> None:
    """Per thread, the time split (sleeps by wait reason included) is the wall time."""
    threads = [t for p in _report(name)["processes"] for t in p["threads"]]
    assert threads
    for t in threads:
        total = sum(int(t[k]) for k in WALL_KEYS)
        assert abs(total - int(t["wall_ns"])) <= 0.01 * int(t["wall_ns"]), (t, total)
