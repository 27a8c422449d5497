"""The bundle's unpacker (scripts/bundle_unpack.py, issue 40.6): it verifies the archive's
.sha256 before unpacking, and writes nothing outside its destination whatever the archive
holds, through Python's lzma and through the xz program alike.

Each hostile archive is a real .tar.xz built here with tarfile; the unpacker runs as the
node runs it, ``python3 fleetd-bundle-unpack.py ARCHIVE DEST`` in a subprocess.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import REPO

UNPACK = REPO / "scripts" / "bundle_unpack.py"

Member = tuple[tarfile.TarInfo, bytes | None]


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode = len(data), mode
    return ti, data


def _link(name: str, target: str, hard: bool = False) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    ti.linkname = target
    return ti, None


def _dir(name: str) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode = tarfile.DIRTYPE, 0o755
    return ti, None


def _fifo(name: str) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.FIFOTYPE
    return ti, None


def _archive(where: Path, members: list[Member], checksum: bool = True) -> Path:
    out = where / "fleetd-bundle-py3.11-x86_64.tar.xz"
    with tarfile.open(out, "w:xz") as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    if checksum:
        digest = hashlib.sha256(out.read_bytes()).hexdigest()
        (where / (out.name + ".sha256")).write_text(f"{digest}  {out.name}\n")
    return out


def _run(*args: str | Path, env: dict[str, str] | None = None,
         python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, str(UNPACK), *map(str, args)], capture_output=True,
                          text=True, timeout=60, env=env)


def _outside(tmp: Path) -> list[str]:
    """Everything under tmp/outside: the unpacker must never write there."""
    return sorted(str(p.relative_to(tmp)) for p in (tmp / "outside").rglob("*"))


@pytest.fixture
def box(tmp_path: Path) -> Path:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_text("keep me")
    (tmp_path / "src").mkdir()
    return tmp_path


GOOD: list[Member] = [
    _dir("fleetd-bundle"), _dir("fleetd-bundle/bin"),
    _file("fleetd-bundle/bin/fleetd", b"#!/bin/sh\n", 0o4755),
    _link("fleetd-bundle/bin/fleetd-python", "fleetd"),
    _file("fleetd-bundle/lib/python/fleetd/__init__.py", b"# fleetd\n"),
    _link("fleetd-bundle/lib/python/again.py", "fleetd-bundle/lib/python/fleetd/__init__.py",
          hard=True),  # a hard link names its file by the archive path
]


def test_a_verified_bundle_unpacks_with_its_links_and_without_setuid(box: Path) -> None:
    archive = _archive(box / "src", GOOD)
    r = _run(archive, box / "dest")
    assert r.returncode == 0, r.stderr
    b = box / "dest" / "fleetd-bundle"
    assert (b / "bin" / "fleetd").read_bytes() == b"#!/bin/sh\n"
    assert os.readlink(b / "bin" / "fleetd-python") == "fleetd"
    assert (b / "lib/python/again.py").stat().st_ino == \
        (b / "lib/python/fleetd/__init__.py").stat().st_ino
    assert (b / "bin" / "fleetd").stat().st_mode & 0o7777 == 0o755  # setuid dropped
    assert "matches" in r.stderr and "unpacked" in r.stderr
    assert _run("--check", archive).returncode == 0


def test_an_archive_of_several_xz_streams_unpacks_whole(box: Path) -> None:
    """make bundle writes one xz stream per layer, one after the other (bundle_tool pack):
    every stream is read, by lzma and by the xz program alike."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for ti, data in (_file("fleetd-bundle/a", b"first layer"),
                         _file("fleetd-bundle/b", b"second layer")):
            tf.addfile(ti, io.BytesIO(data))
    raw = buf.getvalue()
    cut = 512 + 512  # the first member's header and its one block of data
    archive = box / "src" / "fleetd-bundle-py3.11-x86_64.tar.xz"
    archive.write_bytes(lzma.compress(raw[:cut]) + lzma.compress(raw[cut:]))
    (box / "src" / (archive.name + ".sha256")).write_text(
        f"{hashlib.sha256(archive.read_bytes()).hexdigest()}  {archive.name}\n")
    py, env = _no_lzma_python(box)
    for dest, kw in (("dest", {}), ("dest-xz", {"env": env, "python": py})):
        r = _run(archive, box / dest, **kw)  # type: ignore[arg-type]
        assert r.returncode == 0, r.stderr
        assert (box / dest / "fleetd-bundle" / "b").read_bytes() == b"second layer"


HOSTILE: dict[str, tuple[list[Member], str]] = {
    "dotdot": ([_file("fleetd-bundle/../../outside/evil")], "outside the destination"),
    "absolute": ([_file("/tmp/fleetd-unpack-test-absolute")], "outside the destination"),
    "link out, then through it": ([_link("fleetd-bundle/esc", "../../outside"),
                                   _file("fleetd-bundle/esc/evil")], "outside the destination"),
    "absolute link": ([_link("fleetd-bundle/abs", "/etc")], "absolute"),
    "write through an inside link": ([_dir("fleetd-bundle"), _dir("fleetd-bundle/d"),
                                      _link("fleetd-bundle/l", "d"),
                                      _file("fleetd-bundle/l/x")], "through the link"),
    "hard link outside": ([_link("fleetd-bundle/h", "../outside/victim", hard=True)],
                          "outside the destination"),
    "hard link to nothing earlier": ([_link("fleetd-bundle/h", "fleetd-bundle/nope",
                                            hard=True)], "no earlier file"),
    "fifo": ([_fifo("fleetd-bundle/pipe")], "FIFO"),
    "twice": ([_file("fleetd-bundle/a"), _file("fleetd-bundle/a")], "twice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_member_is_refused_and_nothing_lands_outside(box: Path, case: str) -> None:
    members, why = HOSTILE[case]
    archive = _archive(box / "src", members)
    r = _run(archive, box / "dest")
    assert r.returncode == 1, (case, r.stdout, r.stderr)
    assert why in r.stderr, r.stderr
    assert r.stderr.count("\n") == 2 and "Traceback" not in r.stderr  # match, then refusal
    assert _outside(box) == ["outside/victim"]
    assert (box / "outside" / "victim").read_text() == "keep me"
    assert not Path("/tmp/fleetd-unpack-test-absolute").exists()
    assert not (box / "dest").exists()  # a refused archive leaves no partial tree


def _no_lzma_python(tmp: Path) -> tuple[str, dict[str, str]]:
    """The node's python3 built without liblzma: an ``import lzma`` that fails."""
    shadow = tmp / "nolzma"
    shadow.mkdir()
    (shadow / "lzma.py").write_text("raise ImportError('built without liblzma')\n")
    return sys.executable, {**os.environ, "PYTHONPATH": str(shadow)}


def test_without_lzma_the_xz_program_reads_it_with_the_same_checks(box: Path) -> None:
    py, env = _no_lzma_python(box)
    good = _archive(box / "src", GOOD)
    r = _run(good, box / "dest", env=env, python=py)
    assert r.returncode == 0, r.stderr
    assert (box / "dest/fleetd-bundle/bin/fleetd").exists()
    (box / "bad").mkdir()
    bad = _archive(box / "bad", HOSTILE["link out, then through it"][0])
    r = _run(bad, box / "dest2", env=env, python=py)
    assert r.returncode == 1 and "outside the destination" in r.stderr, r.stderr
    assert _outside(box) == ["outside/victim"]


def test_without_lzma_or_xz_it_says_what_to_install(box: Path) -> None:
    py, env = _no_lzma_python(box)
    env["PATH"] = str(box / "empty-path")
    archive = _archive(box / "src", GOOD)
    r = _run(archive, box / "dest", env=env, python=py)
    assert r.returncode == 1 and "xz-utils" in r.stderr, r.stderr


Tamper = Callable[[Path], None]
TAMPER: dict[str, tuple[Tamper, str]] = {
    "altered": (lambda a: a.write_bytes(a.read_bytes()[:-1] + b"\0"), "does not match"),
    "no checksum": (lambda a: a.with_name(a.name + ".sha256").unlink(), "no checksum file"),
    "other name": (lambda a: a.with_name(a.name + ".sha256").write_text(
        "0" * 64 + "  other.tar.xz\n"), "no SHA-256 line"),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_an_unverified_archive_is_refused_before_anything_is_written(box: Path,
                                                                     case: str) -> None:
    archive = _archive(box / "src", GOOD)
    tamper, why = TAMPER[case]
    tamper(archive)
    r = _run(archive, box / "dest")
    assert r.returncode == 1 and why in r.stderr, r.stderr
    assert not (box / "dest").exists()
    assert _run("--check", archive).returncode == 1


def test_sha256sum_agrees_with_the_checksum_file(box: Path) -> None:
    if shutil.which("sha256sum") is None:
        pytest.skip("no sha256sum (coreutils)")
    archive = _archive(box / "src", GOOD)
    r = subprocess.run(["sha256sum", "-c", archive.name + ".sha256"], cwd=archive.parent,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_gpu_check_refuses_a_tampered_archive_before_unpacking(box: Path) -> None:
    """scripts/gpu-check.sh goes through the same unpacker: a bad archive stops it."""
    archive = _archive(box / "src", GOOD)
    archive.write_bytes(archive.read_bytes() + b"tail")
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(box), "OUT": str(box / "out")}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), str(archive)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "does not match its checksum" in r.stderr and "was not unpacked" in r.stderr
    assert not list(box.glob("fleetd-bundle.*"))  # the fresh directory went too
