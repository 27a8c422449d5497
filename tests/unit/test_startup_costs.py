"""First-call costs are start-up, not churn (issue #42.3).

A process's allocation calls before its first launch, the CUDA context's creation in the
first of them, are one LOW ``startup`` chain; ``alloc_churn`` judges only what comes
after. Checked on a real recording (the cloverleaf nsys import, whose first cudaMalloc
took 234 ms) against ``fleetd gpu``'s verdict on the same file, and on synthetic loops
with and without allocations after the first launch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from synth import MS, T0, US, Timeline, base, training_loop

from fleetd.analyze.explain import explain
from fleetd.cli.main import main

from conftest import REPO

CLOVERLEAF = REPO / "investigations" / "gpu" / "cloverleaf-nsys.db"


def _chains(report: Any, cause: str) -> list[dict[str, Any]]:
    return [c for c in report["chains"] if c["root_cause"] == cause]


def test_cloverleaf_first_malloc_is_startup_and_gpu_agrees(
        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["gpu", "--db", str(CLOVERLEAF), "--format", "json"]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert [r["verdict"]["host_overhead"] for r in gpu["ranks"]] == ["NO"]
    report = explain(CLOVERLEAF)
    [start] = _chains(report, "startup")
    assert start["severity"] == "LOW"
    assert start["detail"]["first_op"] == "cudaMalloc"
    assert 230e6 < start["detail"]["first_ns"] < 240e6
    assert "start-up" in start["summary"] and "234.3 ms" in start["summary"]
    # What came after the first launch is a few ms: never the HIGH churn it was called.
    assert all(c["severity"] == "LOW" for c in _chains(report, "alloc_churn"))
    assert not any(c["severity"] == "HIGH" for c in report["chains"])


def _loop_with(path: Path, first_ms: float, churn: bool) -> Path:
    """Set-up allocations (the first one slow: the context), then a steady loop, with
    or without a cudaMalloc/cudaFree pair every step."""
    tl = Timeline()
    base(tl)
    t = T0 - 400 * MS
    for i in range(30):
        t = tl.call("cudaMalloc", t, int(first_ms * MS) if i == 0 else 80 * US,
                    always=True) + 20 * US

    def per_step(tl: Timeline, step: int, t: int) -> int:
        for op in ("cudaMalloc", "cudaFree") if churn else ():
            t = tl.call(op, t, 500 * US, always=True) + 50 * US
        return t

    training_loop(tl, hook=per_step)
    return tl.write(path)


def test_slow_first_malloc_before_the_loop_is_startup(tmp_path: Path) -> None:
    report = explain(_loop_with(tmp_path / "s.db", 300, churn=False))
    [start] = _chains(report, "startup")
    assert start["severity"] == "LOW" and start["detail"]["calls"] == 30
    assert _chains(report, "alloc_churn") == []


def test_allocations_in_the_loop_stay_churn(tmp_path: Path) -> None:
    report = explain(_loop_with(tmp_path / "c.db", 300, churn=True))
    [churn] = _chains(report, "alloc_churn")
    assert churn["severity"] in ("HIGH", "MEDIUM")
    # The 300 ms context creation is not part of the churn's time.
    assert churn["detail"]["alloc_share"] < 0.2
    assert [c["severity"] for c in _chains(report, "startup")] == ["LOW"]
