"""The shipped recordings a newcomer without root tries `fleetd profile` and `fleetd
collectives` on (issue 44.5): investigations/showcase, recorded by
`tests/recorder.py --showcase`. Run as `nobody` from a copy, as a fresh clone is read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import FLEETD, REPO

SHOWCASE = REPO / "investigations" / "showcase"


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody can read (pytest's own sit under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="fleetd-showcase-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_user(tmp: Path, *args: str) -> dict[str, object]:
    """Run fleetd on a world-readable copy, as nobody when we can switch to it."""
    cmd = [FLEETD, *args]
    if os.geteuid() == 0 and shutil.which("setpriv"):
        cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp,
                       env={**os.environ, "HOME": str(tmp)})
    assert r.returncode == 0, r.stderr
    out: dict[str, object] = json.loads(r.stdout)
    return out


def _copy(tmp: Path, name: str) -> Path:
    db = tmp / name
    shutil.copy(SHOWCASE / name, db)
    db.chmod(0o644)
    return db


def test_profile_has_on_cpu_samples_with_python_frames(tmp: Path) -> None:
    got = _as_user(tmp, "profile", "--db", str(_copy(tmp, "profile.db")),
                   "--format", "json")
    assert isinstance(got["samples"], int) and got["samples"] > 20
    frames = json.dumps(got["top"])
    assert "train_loop.py:" in frames and "_gil_pulses" in frames


def test_collectives_names_the_late_rank(tmp: Path) -> None:
    got = _as_user(tmp, "collectives", "--db", str(_copy(tmp, "collectives.db")),
                   "--format", "json")
    [late] = got["stragglers"]  # type: ignore[misc]
    assert late["rank"] == 2 and late["matching"] == "torchrun"


@pytest.mark.parametrize("name", ["profile.db", "collectives.db"])
def test_the_recordings_are_small_and_self_contained(name: str) -> None:
    db = SHOWCASE / name
    assert db.stat().st_size < 1_000_000
    wal = db.with_name(name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0
