"""`fleetd explain` and `fleetd ops` as a user runs them: formats, windows, mistakes."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
from pathlib import Path

from synth import MAIN, STRESS, build

from fleetd.store.db import open_reader

from conftest import FLEETD, REPO, assert_one_line_error


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=60)


def test_explain_json(tmp_path: Path) -> None:
    db = build("cpu_hog", tmp_path)
    proc = fleetd("explain", "--db", str(db), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert set(obj) >= {"chains", "processes", "ops", "window", "verdict", "quiet", "warnings"}
    top = obj["chains"][0]
    assert top["root_cause"] == "cpu_contention" and top["severity"] == "HIGH"
    assert top["culprit"]["pid"] == STRESS and top["victim"]["pid"] == MAIN
    assert obj["quiet"] is False


def test_explain_table_shows_evidence_fix_and_breakdown(tmp_path: Path) -> None:
    db = build("lock_wait", tmp_path)
    proc = fleetd("explain", "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "[HIGH] lock_wait" in out and "culprit: halolet pid 3000" in out
    assert "evidence:" in out and "fix:" in out and "woken by halolet" in out
    assert "per-process breakdown" in out and "python3" in out
    assert out.index("[HIGH]") < out.index("per-process breakdown")


def test_explain_quiet_says_so(tmp_path: Path) -> None:
    proc = fleetd("explain", "--db", str(build("quiet", tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert "verdict: quiet: no host-side cause" in proc.stdout
    assert "[HIGH]" not in proc.stdout


def test_explain_since_on_an_old_recording_says_so(tmp_path: Path) -> None:
    db = build("cpu_hog", tmp_path)
    proc = fleetd("explain", "--db", str(db), "--since", "5m")
    assert proc.returncode == 0
    assert "no events in the last 5m" in proc.stderr and "h ago" in proc.stderr
    assert "[HIGH]" not in proc.stdout
    obj = json.loads(fleetd("explain", "--db", str(db), "--since", "5m", "--format",
                            "json").stdout)
    assert obj["chains"] == [] and obj["warnings"]
    assert obj["verdict"].startswith("no data in the window")


def test_explain_from_to_window(tmp_path: Path) -> None:
    db = build("cpu_hog", tmp_path)
    conn = open_reader(db)
    lo, hi = conn.execute("SELECT min(ts_ns), max(ts_ns) FROM event_data").fetchone()
    conn.close()
    mid = str((lo + hi) // 2)
    full = json.loads(fleetd("explain", "--db", str(db), "--format", "json").stdout)
    half = json.loads(fleetd("explain", "--db", str(db), "--from", mid, "--format",
                             "json").stdout)
    n_full = full["chains"][0]["detail"]["spikes"]
    n_half = half["chains"][0]["detail"]["spikes"]
    assert 0 < n_half < n_full
    assert all(int(e["ts_ns"]) >= int(mid) for e in half["chains"][0]["evidence"]
               if e["kind"] == "spike")


def test_explain_store_keeps_history(tmp_path: Path) -> None:
    db = build("cpu_hog", tmp_path)
    for _ in range(2):
        assert fleetd("explain", "--db", str(db), "--store", "--format", "json").returncode == 0
    conn = open_reader(db)
    try:
        latest = conn.execute("SELECT root_cause, culprit_comm, version FROM chains "
                              "ORDER BY severity, root_cause").fetchall()
        versions = conn.execute("SELECT count(*) FROM chain_history").fetchone()[0]
    finally:
        conn.close()
    assert ("cpu_contention", "stress", 2) in latest
    assert versions == 2 * len(latest)


def test_ops_formats(tmp_path: Path) -> None:
    db = build("quiet", tmp_path)
    obj = json.loads(fleetd("ops", "--db", str(db), "--format", "json").stdout)
    rows = [dict(zip(obj["columns"], r, strict=True)) for r in obj["rows"]]
    launch = next(r for r in rows if r["op"] == "cudaLaunchKernel")
    assert launch["stats_from"] == "events" and launch["count"] == 600 * 20 + 2
    assert "pid" not in obj["columns"]
    per = json.loads(fleetd("ops", "--db", str(db), "--per-process", "--format",
                            "json").stdout)
    assert "pid" in per["columns"]
    text = fleetd("ops", "--db", str(db), "--format", "csv").stdout
    header = next(csv.reader(io.StringIO(text)))
    assert header[:2] == ["node", "op"]
    table = fleetd("ops", "--db", str(db)).stdout
    assert "cudaStreamSynchronize" in table and " ms" in table


def test_bad_input_is_one_clear_error(tmp_path: Path) -> None:
    db = build("quiet", tmp_path)
    assert_one_line_error(fleetd("explain", "--db", str(db), "--since", "5 minutes"),
                      "'5 minutes'")
    assert_one_line_error(fleetd("explain", "--db", str(db), "--format", "yaml"), "'yaml'")
    assert_one_line_error(fleetd("ops", "--db", str(db), "--format", "xml"), "'xml'")
    assert_one_line_error(fleetd("explain", "--db", str(db), "--since", "5m", "--from", "now-1h"),
                      "--since")
    assert_one_line_error(fleetd("explain", "--db", str(db), "--from", "2026-01-02",
                             "--to", "2026-01-01"), "not before")
    assert_one_line_error(fleetd("explain", "--db", str(tmp_path / "missing.db")), "missing.db")
    assert_one_line_error(fleetd("ops", "--db", str(db), "--to", "yesterday"), "'yesterday'")
    proc = fleetd("explain", "--db", str(db), "--pid", "abc")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "invalid pid 'abc'" in proc.stderr
