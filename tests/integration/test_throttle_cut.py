"""A quota cut far below what the workload needs is the cause, even with a neighbour
inside it (#43): bench/detect.py's 3% cut of a rank's slice was named
``cpu_contention`` with the rank's own data loader as the culprit spending the quota,
because the loader held a fifth of the CPU time others held while the rank waited. What
the loader ran (0.31 s) could not make up for the 4.6 s the quota held the rank off, so
the quota is named (fleetd/analyze/causes/throttle.py, INSIDE_HELD); a neighbour that
does spend a quota the workload alone fits stays the culprit (test_throttle.py's busy
neighbour inside a 50% quota).

Here the reference workload (45% of a CPU) and a busy loop share a 3% quota: the loop
holds half of what the quota gives, far less than the time the workload is held off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_throttle import HIERARCHIES, _chains, explain_live

pytestmark = [pytest.mark.bpf]


@pytest.mark.parametrize("hierarchy", HIERARCHIES)
def test_a_quota_far_below_the_workload_is_the_cause_beside_a_neighbour_inside(
        tmp_path: Path, hierarchy: str) -> None:
    report = explain_live(tmp_path, 3_000, hog=True, hierarchy=hierarchy, first=True)
    mine = [c for c in _chains(report, "cpu_throttled")
            if c["victim"]["pid"] == report["pid"]]  # type: ignore[index]
    assert mine, report["chains"]
    [ch] = mine
    assert ch["detail"]["quota_us"] == 3_000 and ch["culprit"] is None  # type: ignore[index]
    spenders = [c for c in _chains(report, "cpu_contention")
                if (c.get("culprit") or {}).get("pid") == report["hog"]  # type: ignore[union-attr]
                and "quota" in c["detail"]]  # type: ignore[index]
    assert spenders == [], spenders
