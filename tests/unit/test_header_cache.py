"""The kernel-header cache is private: headers found there are compiled into programs
loaded as root, so a cache another user prepared is refused, never used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleetd.errors import FleetdError
from fleetd.trace.host import headers


def test_a_symlinked_cache_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    (tmp_path / "cache").symlink_to(elsewhere)
    monkeypatch.setenv("FLEETD_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FleetdError) as exc:
        headers.cache_dir()
    assert "header cache" in exc.value.message and "FLEETD_CACHE_DIR" in (exc.value.hint or "")


def test_a_cache_others_may_write_is_refused(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    monkeypatch.setenv("FLEETD_CACHE_DIR", str(cache))
    with pytest.raises(FleetdError):
        headers.cache_dir()


def test_a_new_cache_is_made_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETD_CACHE_DIR", str(tmp_path / "new" / "cache"))
    got = headers.cache_dir()
    assert got.is_dir() and (got.stat().st_mode & 0o777) == 0o700
