"""Kineto traces with long names (issue 40 point 8): valid files are accepted, and what the
importer holds per name is bounded by what it stores (MAX_NAME_CHARS), not by the file.

The files are the shipped rank-0 trace with its kernels renamed, written one event per
line as PyTorch writes them, large enough (over WHOLE_MAX) to be read piece by piece."""

from __future__ import annotations

import gzip
import json
import sqlite3
from pathlib import Path

import hostile_files as H
import pytest

from fleetd.ingest.kineto_text import WHOLE_MAX
from fleetd.ingest.session import MAX_NAME_CHARS

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "gpu" / "sampled_rank-0.json.gz"
KERNELS_IN_SAMPLE = 1154


def long_named(path: Path, name_bytes: int, kernels: int, pattern: str) -> Path:
    """The sample with its first ``kernels`` kernels named ``kernel_<i>_`` and then
    ``pattern`` repeated to ``name_bytes`` (distinct names); the other kernels dropped."""
    doc = json.loads(gzip.decompress(SAMPLE.read_bytes()))
    events = doc.pop("traceEvents")
    n = 0
    with path.open("w") as f:
        f.write("{\n" + "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n"
                                for k, v in doc.items()) + '  "traceEvents": [\n')
        lines = []
        for ev in events:
            if (ev.get("cat") or "").lower() == "kernel":
                if n >= kernels:
                    continue
                tag = f"kernel_{n}_"
                body = pattern * ((name_bytes - len(tag)) // len(pattern) + 1)
                ev = dict(ev, name=(tag + body)[:name_bytes])
                n += 1
            lines.append("  " + json.dumps(ev))
        f.write(",\n".join(lines) + '\n  ],\n  "baseTimeNanoseconds": 0\n}\n')
    return path


def imported_kernels(db: Path) -> list[str]:
    with sqlite3.connect(db) as c:
        return [n for (n,) in c.execute("SELECT kernel FROM gpu_kernels ORDER BY ts_ns")]


@pytest.mark.parametrize(("pattern", "name_bytes", "kernels"), [
    # A C++ name holds '}, {' (lambdas): each was a place the piece was cut and failed to
    # parse; doubling the piece per failure reached MAX_PIECE and refused the file
    # ("not valid JSON in traceEvents after byte 657163 (unexpected end of data ...)").
    ("}, {", 1 << 20, 40),
    ("void f<int, 2>(a::{lambda()#1}, {lambda()#2}) ", 1 << 20, 40),
    ('\\"}, {\\"', 1 << 20, 40),
    # Runs of spaces past 4 KiB inside a name were squeezed to a raw newline, which no
    # JSON string may hold ("unexpected control character in string").
    ("    ", 5_000_000, 4),
])
def test_a_valid_trace_with_long_names_is_accepted(tmp_path: Path, pattern: str,
                                                   name_bytes: int, kernels: int) -> None:
    src = long_named(tmp_path / "rank0.json", name_bytes, kernels, pattern)
    assert src.stat().st_size > WHOLE_MAX  # read piece by piece, not whole
    db = tmp_path / "out.db"
    r = H.measure(["import", str(src), "--db", str(db)], timeout=120)
    assert r["rc"] == 0, r["stderr"]
    names = imported_kernels(db)
    assert len(names) == kernels
    for i, name in enumerate(names):
        tag = f"kernel_{i}_"
        assert name.startswith(tag), name[:40]
        if pattern.isspace():  # a run of spaces that long is read as one space
            assert name[len(tag):].isspace(), name[:40]
        else:  # stored cut to MAX_NAME_CHARS, as written
            assert name == (tag + pattern * MAX_NAME_CHARS)[:MAX_NAME_CHARS]


def test_memory_does_not_grow_with_name_length(tmp_path: Path) -> None:
    """300 distinct 1 MiB kernel names (a 316 MB file): every name was held whole by the
    converter's caches (the full 1.21 GB file of 1,154 such names peaked at 1,350 MB);
    now each is cut to what is stored first (64 MB for that file)."""
    src = long_named(tmp_path / "rank0.json", 1 << 20, 300, "k")
    r = H.measure(["import", str(src), "--db", str(tmp_path / "out.db")], timeout=180)
    assert r["rc"] == 0, r["stderr"]
    assert r["peak_mb"] < 150, r["peak_mb"]  # the names alone are 300 MiB
    assert len(imported_kernels(tmp_path / "out.db")) == 300
    assert KERNELS_IN_SAMPLE > 300
