"""`fleetd stacks` and `fleetd graphs` on a file, as a user runs them."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
from pathlib import Path

import synth
from mcp_data import LAUNCH_STACK_CLEAN, SYNC_STACK
from mcp_data import build as build_with_stacks

from conftest import FLEETD, REPO, assert_one_line_error


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=60)


def test_stacks_rank_code_paths_by_time(tmp_path: Path) -> None:
    db = build_with_stacks("cpu_hog", tmp_path / "s.db")
    proc = fleetd("stacks", "--db", str(db), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    rows = [dict(zip(obj["columns"], r, strict=True)) for r in obj["rows"]]
    assert [r["frames"][0] for r in rows] == [SYNC_STACK[0], "libcudart.so.12!"
                                              "cudaLaunchKernel+0x10"]
    assert rows[0]["total_ns"] >= rows[1]["total_ns"] and rows[0]["node"] == "gpu-01"
    assert obj["events_without_stack"] > 0 and obj["window"]["label"] == "whole recording"
    one = fleetd("stacks", "--db", str(db), "--op", "cudaStreamSynchronize", "--frames", "2",
                 "--format", "csv")
    [row] = list(csv.DictReader(io.StringIO(one.stdout)))
    assert row["ops"] == "cudaStreamSynchronize"
    assert row["frames"] == " <- ".join(SYNC_STACK[:2])


def test_stacks_table_cleans_hostile_frames(tmp_path: Path) -> None:
    db = build_with_stacks("cpu_hog", tmp_path / "s.db")
    proc = fleetd("stacks", "--db", str(db), "--op", "cudaLaunchKernel")
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\u202e" not in proc.stdout
    assert LAUNCH_STACK_CLEAN[0] in proc.stdout and "(1 row)" in proc.stdout


def test_stacks_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    db = build_with_stacks("quiet", tmp_path / "q.db")
    typo = fleetd("stacks", "--db", str(db), "--op", "cudaLaunchKernl")
    assert_one_line_error(typo, "unknown op 'cudaLaunchKernl'")
    assert "did you mean cudaLaunchKernel" in typo.stderr
    assert_one_line_error(fleetd("stacks", "--db", str(db), "--top", "0"), "--top '0'")
    none = fleetd("stacks", "--db", str(db), "--op", "cudaMemcpyAsync")
    assert none.returncode == 0 and "(0 rows)" in none.stdout and "note:" in none.stderr


def test_graphs_name_the_recapture_storm(tmp_path: Path) -> None:
    db = synth.build("graph_storm", tmp_path)
    proc = fleetd("graphs", "--db", str(db), "--format", "json", "--buckets", "5")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    [p] = obj["processes"]
    assert p["pid"] == synth.MAIN and len(p["timeline"]["rows"]) == 5
    row = dict(zip(obj["columns"], obj["rows"][0], strict=True))
    assert row["instantiations"] == 30 and row["captures"] == 31
    assert str(row["verdict"]).startswith("re-capturing")
    table = fleetd("graphs", "--db", str(db))
    assert "re-capturing" in table.stdout and "(1 row)" in table.stdout
    quiet = fleetd("graphs", "--db", str(synth.build("quiet", tmp_path)))
    assert quiet.returncode == 0 and "(0 rows)" in quiet.stdout and "note:" in quiet.stderr
