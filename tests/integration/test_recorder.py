"""The recorder end to end on this machine: record two scenarios live and diagnose them.

The stored recordings (tests/data/scenarios) prove the diagnosis on one machine and one
day; this proves that recording them still works here, with this kernel, and that the
fresh databases get the same verdicts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from recorder import SCENARIOS, explain, problems, record
from shield import others_yield

pytestmark = [pytest.mark.bpf, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="records with eBPF: needs root")]


@pytest.mark.parametrize("name", ["cpu_hog", "lock_wait"])
def test_live_recording_gets_the_right_diagnosis(name: str, tmp_path: Path) -> None:
    sc = SCENARIOS[name]
    # Recorded under the shield (tests/shield.py): on a busy node the hog's victim is
    # otherwise rightly found preempted by whatever else runs there (busy-node.sh's
    # loops took half of its queued time), not by the hog the scenario injects.
    with others_yield():
        db = record(sc, tmp_path, seconds=5)
    assert db.stat().st_size < 1 << 20
    assert not Path(f"{db}-wal").exists()  # compacted into one file
    report = explain(db)
    assert problems(sc, report) == [], [(c["severity"], c["summary"]) for c in report["chains"]]
