"""The probes land on the very file a process maps, never on a file swapped in at its
path between the scan and the attach (fleetd.trace.host.libs.verified_file,
fleetd.trace.bpf.probes.Attacher).

A real process maps a copy of the venv's libcudart; the tracer scans it; then another
copy of libcudart (another inode, the same symbols) is renamed over that path, as a
container could do inside its own root, and a second process maps the swapped-in file.
Only then are the real programs attached, both ways (uprobe_multi links, per-symbol
uprobes). A uprobe is the kernel's breakpoint (int3) written into every mapping of the
probed inode: the first process's cudaLaunchKernel must carry it, the second's never;
and the calls each makes (both are targets) are counted for the first only. The old
attach, by the path ``/proc/PID/root/...``, probed the swapped-in file instead.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetd.store.catalog import BY_NAME
from fleetd.trace.bpf import probes
from fleetd.trace.bpf.bpfsrc import TARGET_SLOTS, ProgramOptions, compile_program, detach_all
from fleetd.trace.host import libs

from netbed import why_no_bpf

_WHY = why_no_bpf()
pytestmark = [pytest.mark.bpf, pytest.mark.timeout(900),
              pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

INT3 = 0xCC
CALLS = 25
# Maps the library given, prints where its cudaLaunchKernel is; then calls it as many
# times as each line of stdin says (it fails fast without a GPU), until stdin closes.
MAPPER = """
import ctypes, sys
rt = ctypes.CDLL(sys.argv[1])
print(ctypes.cast(rt.cudaLaunchKernel, ctypes.c_void_p).value, flush=True)
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p,
                                ctypes.c_size_t, ctypes.c_void_p]
for line in sys.stdin:
    for _ in range(int(line)):
        rt.cudaLaunchKernel(None, Dim3(1, 1, 1), Dim3(1, 1, 1), None, 0, None)
    print("done", flush=True)
"""


class Mapper:
    def __init__(self, lib: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(lib)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.launch = int(self.proc.stdout.readline())

    def launches(self, bpf: Any) -> int:
        """Calls ``CALLS`` times as a target; how many cudaLaunchKernel calls of this
        process the programs counted (the histogram's total)."""
        pid = self.proc.pid
        bpf[b"fl_targets"][ctypes.c_uint32(pid)] = ctypes.c_uint32(1)
        bpf[b"fl_target_slots"][ctypes.c_int(pid % TARGET_SLOTS)] = ctypes.c_uint64(pid + 1)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{CALLS}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "done\n"
        key = ctypes.c_uint64(pid << 32 | BY_NAME["cudaLaunchKernel"].code)
        got = bpf[b"fl_hist"].get(key)
        return 0 if got is None else int(got.count)

    def first_byte(self) -> int:
        """The first byte of cudaLaunchKernel as this process runs it."""
        with open(f"/proc/{self.proc.pid}/mem", "rb") as mem:
            mem.seek(self.launch)
            return mem.read(1)[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def bpf() -> Iterator[Any]:
    loaded, _ = compile_program(ProgramOptions(tracer_pid=os.getpid()))
    try:
        yield loaded
    finally:
        detach_all(loaded)


@pytest.fixture
def swapped(tmp_path: Path) -> Iterator[tuple[libs.Library, Mapper, Mapper]]:
    """(the scanned library, the process that maps it, a process mapping the file that
    was swapped in at its path after the scan)."""
    runtime = next(x.path for x in libs.search_usual_places() if x.kind == "cudart")
    lib, other = tmp_path / "libcudart.so.12", tmp_path / "incoming.so"
    shutil.copy(runtime, lib)
    shutil.copy(runtime, other)
    started: list[Mapper] = []
    try:
        started.append(Mapper(lib))
        found = [x for x in libs.scan_mapped(started[0].proc.pid).libs if x.kind == "cudart"]
        assert [x.ino for x in found] == [lib.stat().st_ino]
        os.rename(other, lib)  # the path names another file now
        started.append(Mapper(lib))
        assert started[0].first_byte() != INT3 and started[1].first_byte() != INT3, \
            "probed before the test attached (another tracer?)"
        yield found[0], started[0], started[1]
    finally:
        for m in started:
            m.stop()


Attach = Callable[[Any, libs.Library], tuple[probes.AttachReport, Callable[[], None]]]


def _multi(bpf: Any, lib: libs.Library) -> tuple[probes.AttachReport, Callable[[], None]]:
    attacher = probes.Attacher(bpf)
    return attacher.attach(lib, ("cuda",)), attacher.close


def _per_symbol(bpf: Any, lib: libs.Library) -> tuple[probes.AttachReport, Callable[[], None]]:
    report = probes.attach_library(bpf, lib, ("cuda",))

    def detach() -> None:
        for ev in list(bpf.uprobe_fds):
            bpf.detach_uprobe_event(ev)
    return report, detach


@pytest.mark.parametrize("attach", [_multi, _per_symbol], ids=["uprobe_multi", "per_symbol"])
def test_the_probes_land_on_the_mapped_file_not_the_one_swapped_in(
        bpf: Any, swapped: tuple[libs.Library, Mapper, Mapper], attach: Attach) -> None:
    lib, mapping, intruder = swapped
    report, detach = attach(bpf, lib)
    try:
        assert not report.failed, report.failed
        # Reported by the name the process mapped it under, not the descriptor's.
        assert "cudaLaunchKernel:cudaLaunchKernel" in report.attached[lib.path]
        assert lib.path.endswith("/libcudart.so.12")
        # (probed?, calls counted): the mapped file's, then the swapped-in file's
        got = [(m.first_byte() == INT3, m.launches(bpf)) for m in (mapping, intruder)]
        assert got == [(True, CALLS), (False, 0)]
    finally:
        detach()
    assert mapping.first_byte() != INT3, "detached, the probes stayed"


def test_a_library_whose_process_unmapped_it_is_refused_by_name(
        bpf: Any, swapped: tuple[libs.Library, Mapper, Mapper]) -> None:
    lib, mapping, intruder = swapped
    mapping.stop()
    report, detach = _multi(bpf, lib)
    detach()
    assert report.attached == {}
    [why] = report.failed[lib.path]
    assert why.startswith("*: not attached: ") and "no longer maps" in why, why
    assert intruder.first_byte() != INT3


def test_launch_probes_attached_again_land_on_the_mapped_file(
        bpf: Any, swapped: tuple[libs.Library, Mapper, Mapper]) -> None:
    """The always-on mode detaches the launch probes and attaches them again, later:
    through the file kept open from the attach, not through the path."""
    lib, mapping, intruder = swapped
    attacher = probes.Attacher(bpf, launch_entry=True)
    try:
        report = attacher.attach(lib, ("cuda",))
        if "+session" not in report.mechanism.get(lib.path, ""):
            pytest.skip(f"no uprobe session link here ({report.mechanism}): Linux 6.13+")
        assert attacher.set_launches(False)
        off = mapping.first_byte() == INT3
        assert attacher.set_launches(True)
        got = [(m.first_byte() == INT3, m.launches(bpf)) for m in (mapping, intruder)]
    finally:
        attacher.close()
    assert not off, "launch probes switched off, the breakpoint stayed"
    assert got == [(True, CALLS), (False, 0)]


def test_a_library_mapped_again_at_a_shown_path_keeps_both_files_launch_probes(
        bpf: Any, swapped: tuple[libs.Library, Mapper, Mapper]) -> None:
    """A library shown at a path attached before, now another file (replaced on disk
    and loaded again): its launch links go beside the first file's, not over them. The
    old attacher kept one entry per path: the first file's session link and kept file
    stayed open, out of the always-on switch (its breakpoint stayed when launches were
    off) and never closed."""
    lib, mapping, intruder = swapped
    [again] = [x for x in libs.scan_mapped(intruder.proc.pid).libs if x.kind == "cudart"]
    again = dataclasses.replace(again, path=lib.path)  # shown as the first one was
    assert again.ino != lib.ino
    fds = len(os.listdir("/proc/self/fd"))
    attacher = probes.Attacher(bpf, launch_entry=True)
    try:
        reports = [attacher.attach(x, ("cuda",)) for x in (lib, again)]
        if any("+session" not in r.mechanism.get(lib.path, "") for r in reports):
            pytest.skip(f"no uprobe session link here ({reports[0].mechanism}): Linux 6.13+")
        assert attacher.session_count == 2
        assert attacher.set_launches(False)
        off = [m.first_byte() == INT3 for m in (mapping, intruder)]
        assert attacher.set_launches(True)
        on = [(m.first_byte() == INT3, m.launches(bpf)) for m in (mapping, intruder)]
    finally:
        attacher.close()
    assert off == [False, False], "launches switched off, a breakpoint stayed"
    assert on == [(True, CALLS), (True, CALLS)]
    assert len(os.listdir("/proc/self/fd")) == fds, "links or kept files left open"
