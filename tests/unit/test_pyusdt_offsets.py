"""Where the GC USDT probes' uprobes go: the file offset of each probe's ``nop``.

The probes are now attached at file offsets (fleetd.trace.bpf.probes.attach_uprobe_at),
not through BCC's address translation; Debian's python3 is a fixed-address executable
(text at 0x400000), where a virtual address is not a file offset.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetd.trace.enrich.pyusdt import probes

SYS_PY = Path("/usr/bin/python3")


def test_each_probe_offset_is_its_nop_in_the_file() -> None:
    found = probes(str(SYS_PY)) if SYS_PY.exists() else {}
    if not found:
        pytest.skip(f"{SYS_PY} has no python USDT probes")
    data = SYS_PY.resolve().read_bytes()
    assert {"gc__start", "gc__done"} <= set(found)
    for probe in found.values():
        assert 0 <= probe.offset < len(data), probe
        assert data[probe.offset] == 0x90, (probe, hex(data[probe.offset]))  # nop
