"""Exact garbage collections where the interpreter has them: CPython's USDT probes
``python:gc__start`` and ``python:gc__done`` (Debian's and Ubuntu's system Python are
built with them; pyenv, conda and manylinux builds are not, and get the sampled
estimate, :mod:`fleetd.trace.enrich.oncpu`).

A USDT probe is a ``nop`` at a known address, described in the ELF's ``.note.stapsdt``
notes: its address, the address of ``.stapsdt.base`` at link time (a prelinked file
moves it), a semaphore (a u16 the probe's guard reads: CPython runs the probe only
while it is non-zero) and its arguments in GNU assembler syntax (``-4@112(%rsp)``: a
4-byte signed value at rsp + 112). fleetd puts a uprobe on each of the two, raises the
semaphore in every traced process that maps the file (``/proc/PID/mem``, as BCC's USDT
support does) and lowers it again at the end. ``bpf/oncpu.bpf.c`` pairs start and done
per thread; a collection of at least ``FL_GC_MIN_NS`` is a record with its generation.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from fleetd.security.procfs import regular_in_root
from fleetd.trace.bpf.probes import attach_uprobe_at

log = logging.getLogger("fleetd.trace.enrich.pyusdt")

NT_STAPSDT = 3
# struct fl_gc_event (bpf/oncpu.bpf.c): start, length, pid, tid, generation, kind.
GC_EVENT = struct.Struct("<QQIIiI")
# struct pt_regs (x86-64): byte offsets of the registers an argument may name.
PT_REGS = {"r15": 0, "r14": 8, "r13": 16, "r12": 24, "rbp": 32, "rbx": 40, "r11": 48,
           "r10": 56, "r9": 64, "r8": 72, "rax": 80, "rcx": 88, "rdx": 96, "rsi": 104,
           "rdi": 112, "rip": 128, "rsp": 152}
_ARG = re.compile(r"^-?(\d+)@(?:(-?\d+)?\(%(\w+)\)|%(\w+))$")


@dataclass(frozen=True, slots=True)
class Probe:
    name: str
    pc: int  # virtual address of the probe's nop
    semaphore: int  # virtual address of its u16 semaphore, 0 = none
    args: str
    offset: int = -1  # the nop's offset in the file (where its uprobe goes), -1 = none


@dataclass(frozen=True, slots=True)
class Arg:
    """Where a probe argument is: a register (its pt_regs offset), dereferenced at
    ``off`` when ``deref``."""

    reg: int
    off: int
    deref: bool
    size: int


def probes(path: str) -> dict[str, Probe]:
    """The ``python`` provider's probes of an ELF file, by name (empty: none)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    out: dict[str, Probe] = {}
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            notes = elf.get_section_by_name(".note.stapsdt")
            base_sec = elf.get_section_by_name(".stapsdt.base")
            if notes is None:
                return {}
            data = notes.data()
            actual_base = int(base_sec["sh_addr"]) if base_sec is not None else None
            loads = [(int(s["p_vaddr"]), int(s["p_filesz"]), int(s["p_offset"]))
                     for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
    except (OSError, ELFError) as exc:
        log.debug("no USDT notes read from %s: %s", path, exc)
        return {}
    at = 0
    while at + 12 <= len(data):
        namesz, descsz, kind = struct.unpack_from("<III", data, at)
        at += 12
        name = data[at:at + namesz]
        at += (namesz + 3) & ~3
        desc = data[at:at + descsz]
        at += (descsz + 3) & ~3
        if kind != NT_STAPSDT or not name.startswith(b"stapsdt") or len(desc) < 24:
            continue
        pc, base, sem = struct.unpack_from("<QQQ", desc, 0)
        provider, probe, args = (desc[24:].split(b"\0") + [b"", b"", b""])[:3]
        if provider != b"python":
            continue
        shift = actual_base - base if actual_base is not None and base else 0
        at_pc = pc + shift
        offset = next((at_pc - v + off for v, size, off in loads if v <= at_pc < v + size), -1)
        out[probe.decode()] = Probe(probe.decode(), at_pc, sem + shift if sem else 0,
                                    args.decode(errors="replace"), offset)
    return out


def parse_arg(spec: str) -> Arg | None:
    """The first argument of a probe (``-4@112(%rsp)``, ``-8@%r12``); None for a form
    fleetd does not read."""
    first = spec.split()[0] if spec.split() else ""
    m = _ARG.match(first)
    if m is None:
        return None
    size, off, mem_reg, reg = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    name = mem_reg or reg
    if name not in PT_REGS:
        return None
    return Arg(PT_REGS[name], int(off or 0), mem_reg is not None, size)


class Semaphores:
    """Raises a probe's semaphore in a process (so the probe runs) and lowers it again;
    what it raised is remembered per (pid, address)."""

    def __init__(self) -> None:
        self.raised: set[tuple[int, int]] = set()

    def _add(self, pid: int, addr: int, delta: int) -> bool:
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
        except OSError:
            return False
        try:
            (v,) = struct.unpack("<H", os.pread(fd, 2, addr))
            os.pwrite(fd, struct.pack("<H", max(0, min(0xFFFF, v + delta))), addr)
            return True
        except (OSError, struct.error) as exc:
            log.debug("semaphore %#x of pid %d: %s", addr, pid, exc)
            return False
        finally:
            os.close(fd)

    def up(self, pid: int, addr: int) -> bool:
        if (pid, addr) in self.raised:
            return True
        if self._add(pid, addr, 1):
            self.raised.add((pid, addr))
            return True
        return False

    def down_all(self) -> None:
        for pid, addr in list(self.raised):
            self._add(pid, addr, -1)  # a process gone meanwhile needs nothing
        self.raised.clear()


class GcProbes:
    """Per traced CPython with the probes: uprobes on its file (once per file), its
    argument layout in ``fl_gc_usdt``, its semaphores raised."""

    def __init__(self, bpf: Any) -> None:
        self.bpf = bpf
        self.args = bpf[b"fl_gc_usdt"]
        self._files: dict[str, dict[str, Probe] | None] = {}  # path -> probes attached
        self.pids: set[int] = set()  # processes whose collections are exact
        self.sems = Semaphores()

    def follow(self, pid: int, path: str, bias: int) -> bool:
        """Exact collections for ``pid`` (its CPython in ``path``, loaded ``bias`` above
        the file's addresses); False where the file has no usable probes."""
        if pid in self.pids:
            return True
        found = self._attach(path)
        if found is None:
            return False
        arg = parse_arg(found["gc__start"].args)
        if arg is None:
            return False
        leaf = self.args.Leaf()
        leaf.reg, leaf.off, leaf.deref, leaf.size = arg.reg, arg.off, int(arg.deref), arg.size
        self.args[ctypes.c_uint32(pid)] = leaf
        for p in found.values():
            if p.semaphore and not self.sems.up(pid, bias + p.semaphore):
                with contextlib.suppress(KeyError):
                    del self.args[ctypes.c_uint32(pid)]
                return False
        self.pids.add(pid)
        return True

    def _attach(self, path: str) -> dict[str, Probe] | None:
        if path in self._files:
            return self._files[path]
        found = probes(path)
        wanted: dict[str, Probe] = {k: found[k] for k in ("gc__start", "gc__done")
                                    if k in found}
        self._files[path] = None
        if len(wanted) != 2 or min(p.offset for p in wanted.values()) < 0:
            return None
        # With no reference counter (fleetd.trace.bpf.probes.attach_uprobe_at): the
        # semaphores are raised here, in each process, and counted by no one else.
        try:
            attach_uprobe_at(self.bpf, path.encode(), wanted["gc__start"].offset,
                             b"fl_gc_start")
            attach_uprobe_at(self.bpf, path.encode(), wanted["gc__done"].offset,
                             b"fl_gc_done")
        except Exception as exc:  # the kernel's refusal, or bcc's bare Exception
            log.info("no USDT GC probes on %s: %s", path, exc)
            return None
        self._files[path] = wanted
        return wanted

    def close(self) -> None:
        self.sems.down_all()


def load_bias(pid: int, path: str) -> int | None:
    """How far above its link-time addresses ``path`` is loaded in ``pid`` (0 for a
    fixed-address executable); None when it is not mapped or unreadable."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    start = None
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5] == path and int(parts[2], 16) == 0:
                    start = int(parts[0].split("-")[0], 16)
                    break
        if start is None:
            return None
        # Inside the process's root, a regular file only (fleetd.security.procfs).
        with regular_in_root(pid, path) as real:
            if real is None:
                return None
            with open(real, "rb") as f:
                vaddr = min(int(s["p_vaddr"]) for s in ELFFile(f).iter_segments()
                            if s["p_type"] == "PT_LOAD")
    except (OSError, ValueError, ELFError) as exc:
        log.debug("load address of %s in pid %d: %s", path, pid, exc)
        return None
    return start - (vaddr & ~0xFFF)
