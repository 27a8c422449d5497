"""Files the writers of -o create (export, explain --format html, profile, stacks): a
symbolic link at the path is refused, never written through nor replaced, and root's
files are its own only (issue 40.5; docs/security.md)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import FLEETD, REPO, assert_one_line_error

QUIET = REPO / "investigations" / "scenarios" / "quiet.db"
WRITERS = [
    ["export", "--db", str(QUIET)],
    ["explain", "--db", str(QUIET), "--format", "html"],
    ["stacks", "--db", str(QUIET), "--format", "folded"],
]


@pytest.mark.parametrize("cmd", WRITERS, ids=lambda c: c[0])
def test_a_link_at_the_output_is_refused_and_left_alone(tmp_path: Path, cmd: list[str]) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    r = subprocess.run([FLEETD, *cmd, "-o", str(link), "--force"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert_one_line_error(r, "is a symbolic link")
    assert link.is_symlink() and target.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() != 0, reason="root's files: 0600")
@pytest.mark.parametrize("cmd", WRITERS, ids=lambda c: c[0])
def test_roots_outputs_are_its_own(tmp_path: Path, cmd: list[str]) -> None:
    out = tmp_path / "out"
    r = subprocess.run([FLEETD, *cmd, "-o", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mode & 0o777 == 0o600
