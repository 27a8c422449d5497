"""Reads of files a traced process controls: resolved inside its root (openat2, and the
component walk used where openat2 is missing), regular files only, never blocking, at
most the caller's cap. On real files, links, a FIFO and devices."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from chroot_proc import chrooted

from fleetd.security import procfs

SA = "var/run/secrets/kubernetes.io/serviceaccount/namespace"


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, Path, int]]:
    """(the container's root, a secret beside it on the host, a descriptor of the root)."""
    root = tmp_path / "root"
    (root / SA).parent.mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc" / "ns").write_text("inside\n")
    secret = tmp_path / "secret"
    secret.write_text("host secret\n")
    secret.chmod(0o600)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    yield root, secret, fd
    os.close(fd)


both = pytest.mark.parametrize("walk", [False, True], ids=["openat2", "walk"])


@both
def test_a_regular_file_is_read(tree: tuple[Path, Path, int], walk: bool) -> None:
    root, _, fd = tree
    (root / SA).write_text("ml\n")
    assert procfs.read_under(fd, SA, 64, walk=walk) == b"ml\n"
    assert procfs.read_under(fd, "/" + SA, 64, walk=walk) == b"ml\n"


@both
def test_an_absolute_link_resolves_in_the_root(tree: tuple[Path, Path, int],
                                                walk: bool) -> None:
    root, secret, fd = tree
    (root / SA).symlink_to(secret)  # the host path: not there inside the root
    assert procfs.read_under(fd, SA, 64, walk=walk) is None
    (root / SA).unlink()
    (root / SA).symlink_to("/etc/ns")  # the container's own /etc/ns
    assert procfs.read_under(fd, SA, 64, walk=walk) == b"inside\n"


@both
def test_dotdot_never_climbs_out(tree: tuple[Path, Path, int], walk: bool) -> None:
    root, secret, fd = tree
    (root / SA).symlink_to("../" * 12 + str(secret).lstrip("/"))
    assert procfs.read_under(fd, SA, 64, walk=walk) is None
    (root / SA).unlink()
    (root / SA).symlink_to("../" * 12 + "etc/ns")  # clamped at the root: its /etc/ns
    assert procfs.read_under(fd, SA, 64, walk=walk) == b"inside\n"
    assert procfs.read_under(fd, "../../../" + str(secret), 64, walk=walk) is None


@both
def test_a_link_through_a_directory_link(tree: tuple[Path, Path, int], walk: bool) -> None:
    root, secret, fd = tree
    (root / "var" / "up").symlink_to(secret.parent)  # an absolute link to a host dir
    assert procfs.read_under(fd, f"var/up/{secret.name}", 64, walk=walk) is None
    (root / "var" / "rel").symlink_to("../etc")
    assert procfs.read_under(fd, "var/rel/ns", 64, walk=walk) == b"inside\n"


@both
def test_a_link_loop_ends(tree: tuple[Path, Path, int], walk: bool) -> None:
    root, _, fd = tree
    (root / "a").symlink_to("b")
    (root / "b").symlink_to("a")
    assert procfs.read_under(fd, "a", 64, walk=walk) is None


@both
def test_a_fifo_is_skipped_without_blocking(tree: tuple[Path, Path, int], walk: bool,
                                            caplog: pytest.LogCaptureFixture) -> None:
    root, _, fd = tree
    os.mkfifo(root / SA)
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.append(procfs.read_under(
        fd, SA, 64, pid=os.getpid() + 1000 * walk, walk=walk)), daemon=True)
    with caplog.at_level(logging.WARNING, logger=procfs.__name__):
        reader.start()
        reader.join(5)
    assert not reader.is_alive(), "blocked on a FIFO"
    assert got == [None]
    assert "not a regular file (a FIFO)" in caplog.text


@both
def test_devices_are_never_opened(tree: tuple[Path, Path, int], walk: bool,
                                  caplog: pytest.LogCaptureFixture) -> None:
    root, _, fd = tree
    (root / "dev").mkdir()
    os.mknod(root / "dev" / "zero", 0o666 | 0o020000, os.makedev(1, 5))
    (root / SA).symlink_to("/dev/zero")
    with caplog.at_level(logging.WARNING, logger=procfs.__name__):
        assert procfs.read_under(fd, SA, 64, pid=2_000_000 + walk, walk=walk) is None
    assert "a character device" in caplog.text
    assert procfs.read_under(fd, "etc", 64, walk=walk) is None  # a directory


@both
def test_reads_stop_at_the_cap(tree: tuple[Path, Path, int], walk: bool) -> None:
    root, _, fd = tree
    (root / SA).write_bytes(b"a" * (10 << 20))
    assert procfs.read_under(fd, SA, 64, walk=walk) == b"a" * 64
    assert procfs.read_under(fd, SA, 0, walk=walk) == b""


def test_a_chrooted_process_is_read_in_its_root(tree: tuple[Path, Path, int]) -> None:
    """/proc/PID/root of a real chrooted process: its namespace file, a link to the
    host's secret resolved in its root (absent there)."""
    root, secret, _ = tree
    (root / SA).write_text("team-a\n")
    (root / "etc" / "link").symlink_to(secret)
    with chrooted(root) as pid:
        assert procfs.read_in_root(pid, SA, 64) == b"team-a\n"
        assert procfs.read_in_root(pid, "etc/link", 64) is None
        assert procfs.read_in_root(pid, str(secret), 64) is None
    assert procfs.read_in_root(pid, SA, 64) is None  # gone: None, no exception


def test_a_whole_file_for_a_path_reader(tree: tuple[Path, Path, int]) -> None:
    """regular_in_root: a path an ELF parser can open, to the container's file only."""
    root, secret, _ = tree
    (root / "lib").mkdir()
    (root / "lib" / "libpython.so").write_bytes(b"\x7fELF" + b"\0" * 100_000)
    (root / "lib" / "host.so").symlink_to(secret)
    os.mkfifo(root / "lib" / "fifo.so")
    with chrooted(root) as pid:
        with procfs.regular_in_root(pid, "/lib/libpython.so") as real:
            assert real is not None and real.startswith("/proc/self/fd/")
            assert Path(real).read_bytes()[:4] == b"\x7fELF"
            assert len(Path(real).read_bytes()) == 100_004  # whole, not capped
        for hostile in ("/lib/host.so", "/lib/fifo.so", "/lib/absent.so"):
            with procfs.regular_in_root(pid, hostile) as real:
                assert real is None, hostile


def test_proc_files_are_capped_and_never_follow() -> None:
    me = os.getpid()
    env = procfs.read_proc(me, "environ", 10)
    assert env is not None and len(env) == 10
    assert procfs.read_proc_text(me, "comm", procfs.COMM_MAX) is not None
    tid = threading.get_native_id()
    assert procfs.read_proc(me, "comm", procfs.COMM_MAX, tid=tid) is not None
    assert procfs.read_proc(me, "cwd", 64) is None  # a link: not followed
    assert procfs.read_proc(2**22 + 7, "environ", 64) is None  # no such process
