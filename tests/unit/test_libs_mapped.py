"""A mapped library is read through the very file the process maps
(fleetd.trace.host.libs.scan_mapped): a process that swaps the file at the mapped path
between the tracer's check and its open (a container does it inside its own root)
cannot make the tracer read, classify or probe another file, nor hide the one it maps.

A real process maps a copy of libcudart; another swaps that copy's name with a file
that is no CUDA library (renameat2 RENAME_EXCHANGE, as fast as it can), so every path the
maps line names is, a moment later, the other file. Every scan must still find the
mapped inode as the runtime: the old check-then-open, which stat'ed the path and then
opened it again, saw the other file or no runtime at all in most scans.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetd.trace.host import libs

SCANS = 1000
# Swaps the names of two files in one directory for as long as it runs.
SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = (os.fsencode(p) for p in sys.argv[1:3])
AT_FDCWD, RENAME_EXCHANGE = -100, 2
while True:
    if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
        sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""
# Maps the library given and waits for its stdin to close.
MAPPER = "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print(flush=True); sys.stdin.read()"


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[tuple[int, tuple[int, int], Path, Path]]:
    """(pid of a process mapping a copy of libcudart, that copy's (dev, inode), its path,
    the other file's path)."""
    lib, other = tmp_path / "libcudart.so.12", tmp_path / "libother.so"
    runtime = next(x.path for x in libs.search_usual_places() if x.kind == "cudart")
    shutil.copy(runtime, lib)
    shutil.copy("/bin/true", other)
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(lib)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "\n"
        st = lib.stat()
        yield proc.pid, (st.st_dev, st.st_ino), lib, other
    finally:
        _stop(proc)


def test_the_mapped_file_is_found_while_its_path_names_it(
        mapped: tuple[int, tuple[int, int], Path, Path]) -> None:
    pid, key, lib, _ = mapped
    found = [x for x in libs.scan_mapped(pid).libs if (x.dev, x.ino) == key]
    assert [(x.kind, x.path) for x in found] == [("cudart", f"/proc/{pid}/root{lib}")]


def test_a_file_swapped_in_at_the_mapped_path_is_never_taken_for_it(
        mapped: tuple[int, tuple[int, int], Path, Path]) -> None:
    pid, key, lib, other = mapped
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(lib), str(other)],
                               stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)  # swapping
        wrong = []
        for _ in range(SCANS):
            # Each scan reads the file again (the module remembers a mapped inode's kinds,
            # which would hide a wrong read after the first).
            libs._classified.clear()
            found = [(x.kind, x.dev, x.ino) for x in libs.scan_mapped(pid).libs]
            if found != [("cudart", *key)]:
                wrong.append(found)
        assert swapper.poll() is None, swapper.communicate()[1]
    finally:
        _stop(swapper)
    assert not wrong, f"{len(wrong)} of {SCANS} scans: {wrong[:3]}"
