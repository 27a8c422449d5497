"""Every command's default output fits the width it is given, on the shipped recordings,
and never splits a number: COLUMNS=80, 100 and 140 on a pipe, as a terminal would set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleetd.cli.main import main

from conftest import REPO

SCENARIOS = sorted((REPO / "investigations" / "scenarios").glob("*.db"))
GPU = REPO / "tests" / "data" / "gpu"
COMMANDS = [["ops"], ["ops", "--per-process"], ["explain"], ["overview"], ["stacks"],
            ["graphs"], ["collectives"], ["gpu"]]
NUMBER = re.compile(r"(?<![\w.])\d[\d.,]*\d(?![\w.])")


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The shipped GPU traces imported, as a user does before gpu/explain."""
    out = {}
    for trace in ("sampled_rank-0.json.gz", "perlmutter-cloverleaf-cuda.sqlite"):
        db = tmp_path_factory.mktemp("gpu") / "t.db"
        assert main(["import", str(GPU / trace), "--db", str(db)]) == 0
        out[trace] = db
    return out


def run(argv: list[str], columns: int | None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    if columns:
        monkeypatch.setenv("COLUMNS", str(columns))
    else:
        monkeypatch.delenv("COLUMNS", raising=False)
    code = main(argv)
    got = capsys.readouterr()
    assert code in (0, 3), (argv, got.err)
    return got.out


def _check(argv: list[str], monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture[str]) -> None:
    whole = set(NUMBER.findall(run(argv, None, monkeypatch, capsys)))  # no limit: in full
    for columns in (80, 100, 140):
        text = run(argv, columns, monkeypatch, capsys)
        long = [line for line in text.splitlines() if len(line) > columns]
        assert long == [], (columns, long)
        split = [n for n in NUMBER.findall(text) if n not in whole]
        assert split == [], (columns, split)


@pytest.mark.parametrize("db", SCENARIOS, ids=lambda p: p.stem)
def test_every_command_fits_on_each_recording(db: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    for command in COMMANDS:
        _check([*command, "--db", str(db)], monkeypatch, capsys)


def test_gpu_commands_fit_on_imported_traces(imported: dict[str, Path],
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for db in imported.values():
        for command in (["gpu"], ["explain"]):
            _check([*command, "--db", str(db)], monkeypatch, capsys)
    _check(["diff", str(GPU / "sampled_rank-0.json.gz"), str(GPU / "sampled_rank-1.json.gz")],
           monkeypatch, capsys)


def test_wide_shows_every_column(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    db = str(REPO / "investigations" / "scenarios" / "cpu_hog.db")
    narrow = run(["ops", "--db", db], 80, monkeypatch, capsys)
    assert "left out to fit" in narrow and "calls_per_s" not in narrow
    assert "cudaStreamSynchronize" in narrow  # a name column is never shortened first
    full = run(["ops", "--db", db, "--wide"], 80, monkeypatch, capsys)
    assert "calls_per_s" in full and "left out" not in full


def test_a_fix_whose_first_clause_is_long_keeps_its_indent() -> None:
    """A fix line is wrapped at clauses; when its first clause is itself too long it is
    cut at words, and the line's own indent stays in front (it was lost: the fix began
    at column 0 under an indented list)."""
    import io

    from fleetd.cli.output import Wrapped

    out = io.StringIO()
    w = Wrapped(out, 40)
    w.write("  fix:\n    - or gc.disable() for the training loop and gc.collect() at a step "
            "boundary (every N steps, while the GPU still has queued work)\n")
    w.flush()
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("    - or gc.disable()"), lines
    assert all(line.startswith("      ") for line in lines[2:]), lines
    assert all(len(line) <= 40 for line in lines), lines
