"""The always-on mode (#36) live: real BPF, the real CUDA runtime, ``fleetd trace --mode
always-on`` (launch probes 1 s of every 10 s, everything else continuous).

The hog and the interpreter-lock scenarios get the verdict and culprit that full tracing
gives them (the scenarios' expectations, which tests/integration/test_recorder.py checks
in full mode), because their evidence (scheduler, waits, the sync calls) is continuous;
the launch statistics are scaled from the on-time and say so (aggregate bucket -4).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from recorder import SCENARIOS, explain, problems, record

from fleetd.store.catalog import BY_NAME

pytestmark = [pytest.mark.bpf, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="records with eBPF: needs root")]

LAUNCH = BY_NAME["cudaLaunchKernel"].code
SYNC = BY_NAME["cudaStreamSynchronize"].code


@pytest.mark.parametrize("name", ["cpu_hog", "gil_contention"])
def test_always_on_gives_full_modes_verdict(name: str, tmp_path: Path) -> None:
    sc = SCENARIOS[name]
    db = record(sc, tmp_path, seconds=5, trace_args=("--mode", "always-on"))
    report = explain(db)
    assert problems(sc, report) == [], [(c["severity"], c["summary"]) for c in report["chains"]]
    with sqlite3.connect(db) as c:
        marks = c.execute("SELECT count, sum FROM aggregate_data WHERE op = ? AND bucket = -4",
                          (LAUNCH,)).fetchall()
        syncs = c.execute("SELECT count(*) FROM aggregate_data WHERE op = ? AND bucket = -4",
                          (SYNC,)).fetchone()[0]
    # launches: on about 1 s of the window (a poll late at most), scaled; syncs: never
    assert marks and all(0.9e9 <= on < 1.5e9 and on < window for on, window in marks), marks
    assert syncs == 0
