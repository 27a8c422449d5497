"""M3 (exposed host preparation) and per-phase thresholds of ``fleetd gpu``.

M3 is computed here from the Kineto source with plain JSON and exact integer times: host
preparation = the process's cpu_op and user_annotation ranges other than ProfilerStep#N,
exposed = the part of them outside every kernel, copy and set, inside the GPU window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_gpu_import import NSYS, RANKS, close, covered, gpu_json, kineto_source

from fleetd.cli.main import main

# Thresholds that no figure of these traces crosses: every line of evidence then comes
# from a phase's own thresholds.
NEVER = ["--threshold", "M1=0.999", "--threshold", "M2=0.999", "--threshold", "M4=0.001",
         "--threshold", "M3b=0.999", "--threshold", "M3c=0.999"]


@pytest.fixture(scope="module")
def dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("m3")
    out = {"rank": d / "rank0.db", "nsys": d / "nsys.db"}
    assert main(["import", str(RANKS[0]), "--db", str(out["rank"])]) == 0
    assert main(["import", str(NSYS), "--db", str(out["nsys"])]) == 0
    return out


def expected_m3(path: Path) -> dict[str, float]:
    gpu, launches, events = kineto_source(path)
    lo, hi = min(g["ts"] for g in gpu), max(g["end"] for g in gpu)
    pid = next(e["pid"] for e in events if e.get("cat") == "cuda_runtime")
    prep = [(max(lo, e["ts"] * 1000), min(hi, (e["ts"] + e["dur"]) * 1000))
            for e in events if e.get("cat") in ("cpu_op", "user_annotation")
            and e["pid"] == pid and not e["name"].startswith("ProfilerStep#")]
    prep = [(int(a), int(b)) for a, b in prep]
    busy = [(max(lo, g["ts"]), min(hi, g["end"])) for g in gpu]
    host, gpu_busy = covered(prep), covered(busy)
    exposed = covered(prep + busy) - gpu_busy  # |prep ∪ busy| - |busy| = |prep \\ busy|
    window = hi - lo
    return {"M3a": exposed / host, "M3b": exposed / window,
            "M3c": exposed / (window - gpu_busy), "exposed_ns": exposed, "host_prep_ns": host}


def test_m3_equals_an_independent_computation(dbs: dict[str, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    want = expected_m3(RANKS[0])
    (rank,) = gpu_json(capsys, dbs["rank"])["ranks"]
    for key in ("M3a", "M3b", "M3c"):
        assert close(rank["verdict"]["metrics"][key], want[key]), key
        assert rank["m3"][key] == rank["verdict"]["metrics"][key]
    assert close(rank["m3"]["exposed_ns"], want["exposed_ns"])
    assert close(rank["m3"]["host_prep_ns"], want["host_prep_ns"])
    assert rank["m3"]["reason"] is None
    # Both M3b and M3c above the defaults (0.05, 0.50): confirmed, and said so.
    assert want["M3b"] > 0.05 and want["M3c"] > 0.5
    assert rank["verdict"]["host_prep"] == "confirmed"
    assert any("host preparation confirmed" in e for e in rank["verdict"]["evidence"])


def test_m3_is_null_with_a_reason_without_host_ranges(
        dbs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    (rank,) = gpu_json(capsys, dbs["nsys"])["ranks"]  # CloverLeaf: no NVTX ranges
    assert [rank["verdict"]["metrics"][k] for k in ("M3a", "M3b", "M3c")] == [None] * 3
    assert "no host ranges" in rank["m3"]["reason"]
    assert rank["verdict"]["host_prep"] == "unknown"
    assert main(["gpu", "--db", str(dbs["nsys"])]) == 0
    assert "M3 (exposed host prep) not computed: no host ranges" in capsys.readouterr().out


def _steps(got: dict[str, Any]) -> dict[str, list[str]]:
    return {s["name"]: s["evidence"] for s in got["ranks"][0]["steps"]}


def test_phase_thresholds_apply_to_matching_steps_only(
        dbs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    quiet = gpu_json(capsys, dbs["rank"], *NEVER)
    rank = quiet["ranks"][0]
    assert rank["verdict"]["host_overhead"] == "NO"
    assert all(not ev for ev in _steps(quiet).values())
    # One step gets the default M1 back: only it crosses, and it raises the rank's verdict.
    one = gpu_json(capsys, dbs["rank"], *NEVER, "--threshold", "ProfilerStep#551:M1=0.3")
    steps = _steps(one)
    idle = {s["name"]: s["metrics"]["M1"] for s in one["ranks"][0]["steps"]}
    assert steps["ProfilerStep#551"] == [f"M1 GPU idle ratio {idle['ProfilerStep#551']:.3f} "
                                         "> 0.3"]
    assert steps["ProfilerStep#552"] == []
    v = one["ranks"][0]["verdict"]
    assert v["host_overhead"] == "YES" and v["evidence"] == []
    assert v["phases"] == [f"ProfilerStep#551: {steps['ProfilerStep#551'][0]}"]
    assert v["phase_thresholds"] == {"ProfilerStep#551": {"M1": 0.3}}
    assert v["thresholds"]["M1"] == 0.999  # the rank itself keeps the global one
    # A glob reaches every step.
    both = _steps(gpu_json(capsys, dbs["rank"], *NEVER, "--threshold", "ProfilerStep*:M4=0.6"))
    assert all(len(ev) == 1 and ev[0].startswith("M4 GPU utilization") for ev in both.values())


@pytest.mark.parametrize("bad", ["M9=1", ":M1=0.3", "a,b:M1=0.3", "M1=fast", "Step:M1"])
def test_bad_thresholds_are_usage_errors(dbs: dict[str, Path], bad: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu", "--db", str(dbs["rank"]), "--threshold", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"fleetd: error: invalid --threshold {bad!r}" and len(err) == 2
