"""Mappings kept as the kernel reports them (issue #41, point 2's follow-up).

The kernel reports every executable mapping of a file by a candidate process
(``fl_rb_maps``: where, at which file offset, the name as opened). A process that maps
only files already seen and exits before the tracer reads its maps is still named: the
report is kept from the file's layout as another process's maps showed it. Real
processes and libraries; the reports are the ones the kernel would make, taken from
the process's own maps while it lived.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from test_symbols_after_exit import Child

from fleetd.trace.bpf.mapwatch import MAPPED, Mapped, parse_mapped
from fleetd.trace.enrich.stacks import OP_CUDA_LAUNCH, KernelNames
from fleetd.trace.enrich.symbols import FunctionSymbols, mappings


def _report(pid: int, func_addr: int, name: str) -> Mapped:
    """The kernel's report of the executable mapping that holds ``func_addr``."""
    m = next(m for m in mappings(pid) if m.executable and m.start <= func_addr < m.end)
    return Mapped(pid, m.start, m.end, m.offset, name)


def _libc_by_link(tmp_path: Path, pid: int, addr: int) -> str:
    """libc's path through a symlink, as a loader may open it (maps name it resolved)."""
    real = next(m.path for m in mappings(pid) if m.start <= addr < m.end)
    link = tmp_path / "libc-link.so.6"
    link.symlink_to(real)
    return str(link)


def test_a_mapping_reported_for_a_process_never_read_names_its_launch(tmp_path: Path
                                                                      ) -> None:
    child = Child("-", "abs")
    report = _report(child.pid, child.addr, _libc_by_link(tmp_path, child.pid, child.addr))
    syms = FunctionSymbols()
    kernels = KernelNames({}, syms)
    syms.remember(os.getpid())  # libc's layout, as another process's maps show it
    child.exit()  # never read: it exited before the tracer got to it
    assert kernels.name(child.pid, OP_CUDA_LAUNCH, child.addr) is None
    syms.note_mapped(report)
    assert syms.name(child.pid, child.addr) == ("abs", "libc.so.6")


def test_a_report_of_a_file_whose_layout_is_unknown_names_nothing(tmp_path: Path) -> None:
    child = Child("-", "abs")
    report = _report(child.pid, child.addr, _libc_by_link(tmp_path, child.pid, child.addr))
    child.exit()
    syms = FunctionSymbols()  # no process read yet: where libc's text sits is not known
    syms.note_mapped(report)
    assert syms.name(child.pid, child.addr) == (None, None)


def test_a_miss_first_catches_up_on_the_reports() -> None:
    """The tracer's thread names a launch before the watcher handed the report over:
    the miss asks for what is pending and names it."""
    child = Child("-", "abs")
    real = next(m.path for m in mappings(child.pid) if m.start <= child.addr < m.end)
    report = _report(child.pid, child.addr, real)
    syms = FunctionSymbols()
    syms.remember(os.getpid())
    child.exit()
    pending = [report]
    syms.catch_up = lambda: [syms.note_mapped(pending.pop()) for _ in list(pending)]
    assert syms.name(child.pid, child.addr) == ("abs", "libc.so.6")
    assert pending == []


def test_a_report_while_the_process_lives_keeps_all_its_maps() -> None:
    """The first report reads the maps: the executable and the loader, which exec
    mapped and nothing reported, are named after the exit too; a later report that
    read already shows reads nothing more."""
    child = Child("-", "abs")
    syms = FunctionSymbols()
    syms.note_mapped(_report(child.pid, child.addr, ""))
    first = syms._maps[child.pid]
    syms.note_mapped(_report(child.pid, child.addr, ""))
    assert syms._maps[child.pid] is first  # shown by the read already: not read again
    child.exit()
    assert syms.name(child.pid, child.addr) == ("abs", "libc.so.6")
    exe = os.path.realpath(f"/proc/{os.getpid()}/exe")  # the child runs the same python
    assert any(t.path == exe for t in first.texts), [t.path for t in first.texts]


def _without(syms: FunctionSymbols, pid: int, path: str) -> None:
    """Forget ``pid``'s mappings of ``path``, as if the last read came before them."""
    snap = syms._maps[pid]
    kept = [t for t in snap.texts if t.path != path]
    syms._maps[pid] = type(snap)(snap.read_at, kept, [t.start for t in kept])


def test_a_report_of_a_known_file_while_the_process_lives_is_placed_without_a_read(
        tmp_path: Path) -> None:
    child = Child("-", "abs")
    real = next(m.path for m in mappings(child.pid) if m.start <= child.addr < m.end)
    report = _report(child.pid, child.addr, _libc_by_link(tmp_path, child.pid, child.addr))
    syms = FunctionSymbols()
    syms.remember(child.pid)  # libc's layout learned from this very read
    _without(syms, child.pid, real)
    read_at = syms._maps[child.pid].read_at
    syms.note_mapped(report)
    after = syms._maps[child.pid]
    assert after.read_at == read_at  # placed from the layout: the maps were not read
    child.exit()
    assert syms.name(child.pid, child.addr) == ("abs", "libc.so.6")


def test_a_report_of_another_file_at_a_known_path_reads_the_maps(tmp_path: Path) -> None:
    """The layout learned for a path is not trusted for a mapping of another file there
    (another root's file of that name): map_files says which file it is."""
    child = Child("-", "abs")
    real = next(m.path for m in mappings(child.pid) if m.start <= child.addr < m.end)
    report = _report(child.pid, child.addr, real)
    syms = FunctionSymbols()
    syms.remember(child.pid)
    layout = syms._layouts[(real, report.offset)]
    syms._layouts[(real, report.offset)] = (layout[0], layout[1] + 1, layout[2])  # another
    _without(syms, child.pid, real)
    read_at = syms._maps[child.pid].read_at
    syms.note_mapped(report)
    assert syms._maps[child.pid].read_at > read_at  # read again: the maps are the truth
    child.exit()
    assert syms.name(child.pid, child.addr) == ("abs", "libc.so.6")


def test_a_report_ends_where_its_last_page_does() -> None:
    raw = MAPPED.pack(1, 42, 42, 0x7F0000001000, 4097, 0x1000) + b"/lib/libx.so\0junk"
    m = parse_mapped(raw.ljust(MAPPED.size + 256, b"\0"))
    assert m == Mapped(42, 0x7F0000001000, 0x7F0000001000 + 2 * mmap.PAGESIZE, 0x1000,
                       "/lib/libx.so")
