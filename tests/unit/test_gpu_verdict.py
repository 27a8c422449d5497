"""One GPU verdict: ``gpu`` and ``explain`` on one imported trace say the same thing, a
trace without scheduler data says so, and the words behind TKLQT and M1-M5 are printed
where the table output first uses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetd.cli.main import main

from conftest import REPO

RANK0 = REPO / "tests" / "data" / "gpu" / "sampled_rank-0.json.gz"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gv") / "k.db"
    assert main(["import", str(RANK0), "--db", str(path)]) == 0
    return path


def _out(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


def test_gpu_and_explain_give_one_verdict(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu = json.loads(_out(capsys, ["gpu", "--db", str(db), "--format", "json"]))
    explain = json.loads(_out(capsys, ["explain", "--db", str(db), "--format", "json"]))
    [rank] = gpu["ranks"]
    assert rank["verdict"]["host_overhead"] == "YES"
    assert rank["summary"].startswith("host-bound")
    assert [g["summary"] for g in explain["gpu"]] == [rank["summary"]]
    assert rank["summary"] in explain["verdict"] and not explain["verdict"].startswith("quiet")
    text = _out(capsys, ["gpu", "--db", str(db)])
    # The verdict line does not set "host overhead YES" against a bare "GPU-bound".
    head = next(line for line in text.splitlines() if "pid 4037 device" in line)
    assert "host-bound" in head and ": GPU-bound" not in text
    assert "TKLQT (total kernel launch and queuing time)" in text
    assert "M1-M5 (the nsys host-overhead metrics" in text


def test_no_scheduler_data_is_said_not_shown_as_running(
        db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = _out(capsys, ["explain", "--db", str(db)])
    assert "no scheduler data in this recording" in text
    assert "100.0%" not in text
