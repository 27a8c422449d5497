"""The compiled-program cache's files and instructions (fleetd/trace/bpf/bpfcache.py): the
key, the permissions a file needs to be used, corruption caught before use, and the
patching of map descriptors and load-time parameters. The live side (a warm start
loading from the cache and recording) is tests/integration/test_bpf_cache_live.py."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from fleetd.security.private_dir import UnsafePathError
from fleetd.trace.bpf import bpfcache
from fleetd.trace.bpf.bpfcache import CacheError, Entry, KeyInputs, TableSpec

SENTINEL = 0x3F1D5A00


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | (src << 4), off, imm)


def _ld_map(fd: int, dst: int = 1) -> bytes:
    """r<dst> = map by descriptor (BPF_LD_IMM64, src_reg BPF_PSEUDO_MAP_FD)."""
    return _insn(0x18, dst, 1, 0, fd) + _insn(0)


# if r1 == SENTINEL goto +1; r2 = map(fd 7); r0 = 0; exit
PROG = (_insn(0x15, 1, 0, 1, SENTINEL) + _ld_map(7, 2) + _insn(0xB7, 0, 0, 0, 0)
        + _insn(0x95))


def _entry(funcs: dict[str, bytes] | None = None) -> Entry:
    tables = (TableSpec(name="fl_targets", map_type=1, key_size=4, value_size=4,
                        max_entries=4096, flags=0, key_desc='"unsigned int"',
                        leaf_desc='"unsigned int"'),
              TableSpec(name="fl_rb_sys", map_type=27, key_size=0, value_size=0,
                        max_entries=1 << 20, flags=0, key_desc="", leaf_desc=""))
    return Entry("GPL", 0x60000, ("generated", "/c/kheaders/x", "tiny tree"), tables,
                 funcs if funcs is not None
                 else {"tracepoint__sched__sched_switch": bpfcache.fds_to_indices(PROG, {7: 0})})


def _inputs(**change: object) -> KeyInputs:
    base = KeyInputs(format=1, fleetd="0.1.0", bcc="0.26.0", libbcc="/usr/lib/libbcc.so:1:2",
                     machine="x86_64", release="6.1.0", proc_version="Linux version 6.1.0 #1",
                     kconfig="ab", headers="system (/lib/modules/6.1.0/build)",
                     source="int x;", cflags=["-DFL_SAMPLE_N=1"])
    return KeyInputs(**{**base, **change})  # type: ignore[typeddict-item]


def test_the_key_changes_with_everything_that_changes_the_compile() -> None:
    key = bpfcache.cache_key(_inputs())
    assert key == bpfcache.cache_key(_inputs()) and len(key) == 64
    changes: dict[str, object] = {
        "fleetd": "0.2.0", "bcc": "0.29.1", "libbcc": "/usr/lib/libbcc.so:1:3",
        "release": "6.8.0", "proc_version": "Linux version 6.1.0 #2", "kconfig": "cd",
        "headers": "generated (tiny tree)", "source": "int y;",
        "cflags": ["-DFL_SAMPLE_N=2"], "machine": "aarch64", "format": 2,
    }
    keys = {bpfcache.cache_key(_inputs(**{name: value})) for name, value in changes.items()}
    assert len(keys) == len(changes) and key not in keys


def test_descriptors_become_table_indices_and_back() -> None:
    stored = bpfcache.fds_to_indices(PROG, {7: 1})
    assert bpfcache.map_refs(stored) == [8 + 4]
    assert struct.unpack_from("<i", stored, 12)[0] == 1  # table 1, not descriptor 7
    loaded = bpfcache.indices_to_fds(stored, [40, 41])
    assert struct.unpack_from("<i", loaded, 12)[0] == 41
    assert bytes(loaded[:8]) == PROG[:8] and bytes(loaded[16:]) == PROG[16:]
    with pytest.raises(CacheError, match="map descriptor 9"):
        bpfcache.fds_to_indices(_ld_map(9), {7: 0})
    with pytest.raises(CacheError, match="table 5 of 2"):
        bpfcache.indices_to_fds(_ld_map(5), [40, 41])


def test_a_parameter_is_patched_where_it_was_compiled_and_nowhere_else() -> None:
    # The map reference's immediate holds SENTINEL too (as a descriptor): never patched.
    prog = bytearray(PROG + _ld_map(SENTINEL) + _insn(0x95))
    assert bpfcache.param_sites(prog, SENTINEL) == [4]
    bpfcache.patch_params(prog, {SENTINEL: 4242})
    assert struct.unpack_from("<i", prog, 4)[0] == 4242
    assert struct.unpack_from("<i", prog, 44)[0] == SENTINEL  # the map load's
    # (x >> 32) == PARAM compiles to x & 0xffffffff00000000 == SENTINEL << 32: the high
    # half is patched; a 64-bit constant with other bits beside the sentinel is refused.
    shifted = bytearray(_insn(0x18, 1, 0, 0, 0) + _insn(0, 0, 0, 0, SENTINEL))
    assert bpfcache.param_sites(shifted, SENTINEL) == [12]
    bpfcache.patch_params(shifted, {SENTINEL: 4242})
    assert struct.unpack_from("<ii", shifted, 4)[0] == 0
    assert struct.unpack_from("<i", shifted, 12)[0] == 4242
    for low, high in ((1, SENTINEL), (SENTINEL, 1)):
        wide = _insn(0x18, 1, 0, 0, low) + _insn(0, 0, 0, 0, high)
        with pytest.raises(CacheError, match="64-bit constant with other"):
            bpfcache.param_sites(wide, SENTINEL)
    # A comparison the compiler rewrote around the sentinel (x <= P as x < P + 1).
    with pytest.raises(CacheError, match="derived from it"):
        bpfcache.param_sites(_insn(0xA5, 1, 0, 1, SENTINEL + 1), SENTINEL)
    with pytest.raises(CacheError, match="multiple of 8"):
        bpfcache.map_refs(PROG[:-3])


def test_store_then_load_gives_the_entry_back_private_to_root(tmp_path: Path) -> None:
    entry = _entry()
    path = bpfcache.store(tmp_path, "k" * 64, entry)
    assert path.parent == tmp_path / "bpf"
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    assert bpfcache.load(tmp_path, "k" * 64) == entry
    assert bpfcache.load(tmp_path, "j" * 64) is None  # another key: a miss


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "json", "index"])
def test_a_corrupt_entry_is_discarded_with_a_log_line(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    key = "c" * 64
    entry = _entry({"f": bpfcache.fds_to_indices(PROG, {7: 0})})
    path = bpfcache.store(tmp_path, key, entry)
    data = path.read_bytes()
    if damage == "flip":  # one bit of an instruction, inside the base64 text
        at = data.index(b'"f":"') + 8
        data = data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
    elif damage == "truncate":
        data = data[:-40]
    elif damage == "magic":
        data = b"X" + data[1:]
    else:  # a well-formed checksum over a payload that is not a valid entry
        bad = (b"{}" if damage == "json" else bpfcache.encode(key, _entry(
            {"f": _ld_map(9)}))[len(bpfcache.MAGIC) + 65:])
        data = bpfcache.MAGIC + hashlib.sha256(bad).hexdigest().encode() + b"\n" + bad
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="fleetd.trace.bpf.bpfcache"):
        assert bpfcache.load(tmp_path, key) is None
    assert not path.exists(), "a bad entry is removed, so the next start compiles and keeps"
    [line] = [r.getMessage() for r in caplog.records]
    assert str(path) in line and "compiling instead" in line


def test_an_entry_for_another_key_is_not_used(tmp_path: Path) -> None:
    path = bpfcache.store(tmp_path, "a" * 64, _entry())
    path.rename(path.with_name("b" * 64 + ".prog"))
    assert bpfcache.load(tmp_path, "b" * 64) is None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_an_entry_others_may_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    path = bpfcache.store(tmp_path, "m" * 64, _entry())
    assert bpfcache.load(tmp_path, "m" * 64) == _entry()
    path.chmod(mode)
    assert bpfcache.load(tmp_path, "m" * 64) is None and not path.exists()


def test_an_entry_of_another_owner_or_a_link_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    path = bpfcache.store(tmp_path, "o" * 64, _entry())
    assert bpfcache.load(tmp_path, "o" * 64) == _entry()
    os.chown(path, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="fleetd.trace.bpf.bpfcache"):
        assert bpfcache.load(tmp_path, "o" * 64) is None
    assert "owned by uid 65534" in caplog.text
    real = bpfcache.store(tmp_path, "r" * 64, _entry())
    link = real.with_name("l" * 64 + ".prog")
    link.symlink_to(real)
    assert bpfcache.load(tmp_path, "l" * 64) is None
    assert real.exists(), "the link goes, never the file it points to"


def test_a_cache_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bpf").mkdir(mode=0o700)
    (tmp_path / "bpf").chmod(0o777)
    with pytest.raises(UnsafePathError, match="BPF program cache"):
        bpfcache.load(tmp_path, "d" * 64)
    with pytest.raises(UnsafePathError):
        bpfcache.store(tmp_path, "d" * 64, _entry())


def test_storing_replaces_an_entry_whole(tmp_path: Path) -> None:
    first = bpfcache.store(tmp_path, "w" * 64, _entry())
    second = bpfcache.store(tmp_path, "w" * 64, replace(_entry(), license="Dual BSD/GPL"))
    assert first == second
    loaded = bpfcache.load(tmp_path, "w" * 64)
    assert loaded is not None and loaded.license == "Dual BSD/GPL"
    assert sorted(p.name for p in (tmp_path / "bpf").iterdir()) == [first.name]
