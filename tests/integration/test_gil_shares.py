"""The interpreter-lock chain states what the breakdown shows, at every intensity.

The reference workload feeds the CUDA runtime from its main thread while a pure-Python
thread of the same process (``py-busy``) computes: without pause (heavy) or for 30 % of
every 10 ms (light), traced live with eBPF. The lock_contention chain must state the
feeding thread's lock column of the per-thread breakdown (within 2 points), name the
busy thread, and be HIGH exactly when that share is above the HIGH bar; without the
busy thread there is no lock chain and nothing of the workload's own making is HIGH.
(On 2 shared cores the light thread's share varies from run to run: the assertions
hold for whatever share the breakdown measured.)
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from recorder import BASE, Scenario, explain, record

from fleetd.analyze.causes.chains import severity

pytestmark = [pytest.mark.bpf, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="records with eBPF: needs root")]

SECONDS = 4.0
HIGH_SHARE = 0.05  # chains.severity: HIGH from 5 % of wall time (with half explained)
MIN_SHARE = 0.01  # contention.MIN_IMPACT: below this a wait is noise, no chain
INTENSITIES = {"heavy": ("--gil-thread",), "light": ("--gil-thread", "--gil-duty", "0.3")}


def _feeder(report: dict[str, Any]) -> dict[str, Any]:
    """The thread with the most time in CUDA calls: the one that feeds the GPU."""
    threads = [t for p in report["processes"] for t in p["threads"]]
    return max(threads, key=lambda t: int(t["in_cuda_ns"]))


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("gil-shares")
    out = {name: explain(record(Scenario(name, name, (*BASE, *args)), tmp, SECONDS))
           for name, args in INTENSITIES.items()}
    out["control"] = explain(record(Scenario("control", "no busy thread", BASE), tmp, SECONDS))
    return out


@pytest.mark.parametrize("name", list(INTENSITIES))
def test_the_lock_chain_states_the_breakdowns_lock_column(
        reports: dict[str, dict[str, Any]], name: str) -> None:
    report = reports[name]
    feeder = _feeder(report)
    share = int(feeder["lock_ns"]) / int(feeder["wall_ns"])
    chains = [c for c in report["chains"] if c["root_cause"] == "lock_contention"]
    if name == "heavy":
        assert share > HIGH_SHARE, report["verdict"]
    if share < MIN_SHARE:
        assert not chains, [c["summary"] for c in chains]
        return
    [c] = chains
    assert c["victim"]["tid"] == feeder["tid"]
    assert abs(float(c["impact"]) - share) <= 0.02, (c["summary"], share)
    assert f"{float(c['impact']):.1%}" in c["summary"]
    assert c["severity"] == severity(float(c["explained"]), float(c["impact"]))
    assert (c["severity"] == "HIGH") == (share >= HIGH_SHARE and c["explained"] >= 0.5), c
    assert c["culprit"]["thread"] == "py-busy" and c["culprit"]["tid"] != c["victim"]["tid"]
    assert c["culprit"]["pid"] == c["victim"]["pid"]
    assert c["detail"]["gil"] is True


def test_the_heavier_thread_costs_more(reports: dict[str, dict[str, Any]]) -> None:
    heavy, light = (_feeder(reports[n]) for n in ("heavy", "light"))
    assert heavy["lock_ns"] / heavy["wall_ns"] > light["lock_ns"] / light["wall_ns"]


def test_without_the_busy_thread_nothing_is_high(reports: dict[str, dict[str, Any]]) -> None:
    """Nothing of the workload's own making is HIGH. (A machine busy with other work
    can still queue the thread for its CPU: that chain blames the other process.)"""
    report = reports["control"]
    assert not [c for c in report["chains"] if c["root_cause"] == "lock_contention"]
    own = [c["summary"] for c in report["chains"] if c["severity"] == "HIGH" and (
        c["root_cause"] != "cpu_contention" or (c["culprit"] or {}).get("self", True))]
    assert not own, own

