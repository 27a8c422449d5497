"""Typos are answered with the nearest name and the help of the command that was typed."""

from __future__ import annotations

import subprocess

import pytest

from conftest import FLEETD


@pytest.mark.parametrize(("argv", "said", "hint"), [
    (["explian"], "did you mean 'explain'?", "see 'fleetd --help'"),
    (["ops", "--perprocess"], "unrecognized arguments: --perprocess (did you mean "
     "--per-process?)", "see 'fleetd ops --help'"),
    (["certs", "issue-nod"], "did you mean 'issue-node'?", "see 'fleetd certs --help'"),
    (["explain", "--formt", "json"], "(did you mean --format?)", "see 'fleetd explain --help'"),
])
def test_a_typo_gets_the_nearest_name_and_its_commands_help(
        argv: list[str], said: str, hint: str) -> None:
    r = subprocess.run([FLEETD, *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    first, second = r.stderr.splitlines()
    assert first.startswith("fleetd: error: ") and said in first, r.stderr
    assert second == f"  hint: {hint}"


def test_nothing_close_gets_no_guess() -> None:
    r = subprocess.run([FLEETD, "zzzzqqq"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "did you mean" not in r.stderr
