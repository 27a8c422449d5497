"""The rule for directories fleetd makes in a shared place, and for reading files that
may be hostile (fleetd/security/private_dir.py; issue 29, items 3 and 5)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from fleetd.security.private_dir import (
    DENY_ALL,
    UnsafePathError,
    create_file,
    private_dir,
    read_regular,
)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_missing_levels_are_made_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o777)  # would leave d--------- without the explicit chmod
    try:
        got = private_dir(tmp_path / "a" / "b" / "c", base=tmp_path)
    finally:
        os.umask(old)
    assert got == tmp_path / "a" / "b" / "c"
    for p in (tmp_path / "a", tmp_path / "a" / "b", got):
        assert _mode(p) == 0o700 and p.stat().st_uid == os.geteuid()
    assert private_dir(got, base=tmp_path) == got  # again: an existing one is fine


@pytest.mark.parametrize(("prepare", "needle"), [
    (lambda d, t: d.symlink_to(t), "it is a symbolic link"),
    (lambda d, t: d.write_text("x"), "it is not a directory"),
    (lambda d, t: (d.mkdir(), d.chmod(0o777)), "group or others may write it (mode 0777)"),
    (lambda d, t: (d.mkdir(), d.chmod(0o720)), "group or others may write it (mode 0720)"),
])
def test_a_level_someone_else_could_control_is_refused(tmp_path: Path, prepare: object,
                                                       needle: str) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    prepare(tmp_path / "x", target)  # type: ignore[operator]
    with pytest.raises(UnsafePathError) as info:
        private_dir(tmp_path / "x" / "leaf", base=tmp_path, what="test directory")
    assert needle in info.value.message and "\n" not in info.value.message
    assert f"'{tmp_path / 'x'}' above it" in info.value.message
    assert list(target.iterdir()) == []  # nothing made through the link


def test_the_leaf_may_deny_read_too(tmp_path: Path) -> None:
    (tmp_path / "tickets").mkdir(mode=0o700)
    (tmp_path / "tickets").chmod(0o750)
    private_dir(tmp_path / "tickets", base=tmp_path)  # write bits only: fine
    with pytest.raises(UnsafePathError, match="may read or write it"):
        private_dir(tmp_path / "tickets", base=tmp_path, deny=DENY_ALL)


@pytest.mark.skipif(os.geteuid() != 0, reason="another owner needs root")
def test_another_owner_is_refused_and_the_base_may_be_roots(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    os.chown(d, 54321, 54321)
    with pytest.raises(UnsafePathError, match="owned by uid 54321, not by this user"):
        private_dir(d, base=tmp_path)
    os.chown(tmp_path, 54321, 54321)  # a base of another (non-root) user: refused
    with pytest.raises(UnsafePathError, match="neither this user .* nor root"):
        private_dir(tmp_path / "e", base=tmp_path)
    os.chown(tmp_path, 0, 0)


def test_a_base_others_may_write_needs_the_sticky_bit(tmp_path: Path) -> None:
    base = tmp_path / "shared"
    base.mkdir()
    base.chmod(0o777)
    with pytest.raises(UnsafePathError, match="no sticky bit"):
        private_dir(base / "mine", base=base)
    base.chmod(0o1777)  # like /tmp: what we make there, nobody else can rename
    assert _mode(private_dir(base / "mine", base=base)) == 0o700
    with pytest.raises(UnsafePathError, match="is not below"):
        private_dir(tmp_path / "elsewhere", base=base)


def test_create_file_never_follows_a_link_nor_replaces_a_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    for name in ("link", "victim"):
        with pytest.raises(FileExistsError):
            create_file(tmp_path / name)
    assert victim.read_text() == "keep"
    fd = create_file(tmp_path / "new")
    os.close(fd)
    assert _mode(tmp_path / "new") == 0o600


def test_read_regular_refuses_links_fifos_devices_and_big_files(tmp_path: Path) -> None:
    (tmp_path / "ok").write_bytes(b"x" * 10)
    assert read_regular(tmp_path / "ok", 10) == b"x" * 10
    with pytest.raises(UnsafePathError, match="is 10 bytes, over the limit of 9"):
        read_regular(tmp_path / "ok", 9)
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    started = time.monotonic()
    for name, needle in (("zero", "is a symbolic link"), ("fifo", "is a FIFO")):
        with pytest.raises(UnsafePathError, match=needle):
            read_regular(tmp_path / name, 1024)
    with pytest.raises(UnsafePathError, match="is a character device"):
        read_regular(Path("/dev/zero"), 1024)
    assert time.monotonic() - started < 1
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 10)
