"""``fleetd trace`` start-up in a pipe is never silent for long (#44.3): each stage the
tracer names is a line at once and a plain line follows every few seconds while it
lasts (a cold compile takes tens of seconds on a loaded machine); --quiet prints none.
Real BPF: a fresh FLEETD_CACHE_DIR so the programs are compiled, then reused."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from fleetd.cli.progress import EVERY_S

from conftest import FLEETD

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="tracing needs root")]


def trace(tmp_path: Path, cache: Path, *extra: str) -> tuple[list[tuple[float, str]], int]:
    """stderr lines of a 1-second system-wide trace, each with when it arrived."""
    env = {**os.environ, "FLEETD_CACHE_DIR": str(cache)}
    proc = subprocess.Popen([FLEETD, *extra, "trace", "--duration", "1s", "--no-host",
                             "--db", str(tmp_path / f"t{time.monotonic_ns()}.db")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stderr is not None
    t0 = time.monotonic()
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stderr]
    return lines, proc.wait(600)


def test_start_up_prints_a_line_every_few_seconds_and_none_when_quiet(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    lines, code = trace(tmp_path, cache)
    assert code == 0, lines
    text = [t for _, t in lines]
    starting = [(at, t) for at, t in lines if t.startswith("fleetd: starting")]
    assert any("compiling the BPF programs" in t for _, t in starting), text
    assert not any("\r" in t for t in text)
    # From the first line (Python's own start-up comes before it) to the announcement,
    # no gap longer than the pace, with slack for a loaded machine.
    up_to = next(i for i, t in enumerate(text) if not t.startswith("fleetd: starting"))
    stamps = [at for at, _ in lines[:up_to + 1]]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert max(gaps) <= EVERY_S + 3, list(zip(gaps, text, strict=False))
    if stamps[-1] > EVERY_S + 1:  # a start-up this long has its periodic lines
        assert any(t.endswith(" s") or " s, " in t for _, t in starting), text
    quiet, code = trace(tmp_path, cache, "--quiet")  # the cache's programs: quick
    assert code == 0, quiet
    assert not [t for _, t in quiet if t.startswith("fleetd: starting")], quiet
    # A warm start says it loads the cache's programs, and never that it compiles.
    warm, code = trace(tmp_path, cache)
    said = [t for _, t in warm if t.startswith("fleetd: starting")]
    assert code == 0 and any("from the compiled-program cache" in t for t in said), warm
    assert not any("compiling" in t for t in said), warm
