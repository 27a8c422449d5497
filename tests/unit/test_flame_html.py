"""explain --format html draws the feeding thread's flame graph (an icicle: root on top)
from host_cpu_bound's ``detail.flame``: every frame escaped, every stack as wide as its
share of the samples."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest

from fleetd.export.html_frames import FLAME_W, flame_graph
from fleetd.trace.enrich.oncpu import OP_CPU_SAMPLE

PERIOD_49 = 1_000_000_000 // 49
HOSTILE = "<script>alert(1)</script> (/w/evil.py:1)"
STACKS = {  # innermost first, as the tracer stores them
    "hot": (["Workload._cpu (/w/train_loop.py:243)", "Workload.step (/w/train_loop.py:302)"],
            170),
    "collate": (["collate (/w/data.py:40)", "Workload.step (/w/train_loop.py:302)"], 50),
    "evil": ([HOSTILE, "Workload.step (/w/train_loop.py:302)"], 30),
    "sync": (["cudaStreamSynchronize (libcudart.so.12)",
              "Workload.step (/w/train_loop.py:310)"], 10),
}
_RECT = re.compile(r'<rect x="([\d.]+)" y="\d+" width="([\d.]+)" height="\d+" fill="[^"]+" '
                   r'data-depth="(\d+)" data-samples="(\d+)"/>')


def _report(tmp_path: Path) -> dict[str, Any]:
    from synth import MAIN, MAIN_TID, T0, Timeline, base, training_loop

    from fleetd.analyze.explain import explain
    from fleetd.store.writer import BatchWriter
    from fleetd.trace.enrich.stacks import stack_hash

    tl = Timeline()
    base(tl)
    training_loop(tl)
    db = tl.write(tmp_path / "r.db")
    with BatchWriter(db, "gpu-01") as w:
        w.add_stacks([(stack_hash(f), f) for f, _ in STACKS.values()])
        w.add_events([(T0, 6 * 10**9, MAIN, MAIN_TID, OP_CPU_SAMPLE, 0, PERIOD_49, 0, n, 0,
                       stack_hash(f)) for f, n in STACKS.values()])  # type: ignore[arg-type]
    return explain(db)


def _page(report: dict[str, Any]) -> str:
    from fleetd.export.html import write_report

    out = io.StringIO()
    write_report(report, out)
    return out.getvalue()


def test_the_report_draws_the_flame_graph_with_every_stack_in_proportion(
        tmp_path: Path) -> None:
    report = _report(tmp_path)
    ch = next(c for c in report["chains"] if c["root_cause"] == "host_cpu_bound")
    flame = ch["detail"]["flame"]
    total = sum(n for _, n in STACKS.values())
    assert flame["samples"] == total
    page = _page(report)
    assert f"Flame graph ({total} on-CPU samples of the thread" in page
    assert "Top frames (share of the thread's on-CPU samples)" in page  # beside the bars
    rects = [(float(x), float(w), int(d), int(n)) for x, w, d, n in _RECT.findall(page)]
    # Each stack's innermost frame is a box at its depth, as wide as its samples.
    leaves = sorted((d, n, w) for _, w, d, n in rects if d == 2)
    assert sorted(n for _, n, _ in leaves) == sorted(n for _, n in STACKS.values())
    for _, n, w in leaves:
        assert w == pytest.approx(FLAME_W * n / total, abs=1e-3)
    # The root spans everything; a caller is as wide as its callees together.
    assert (0.0, FLAME_W, 0, total) in [(x, w, d, n) for x, w, d, n in rects]
    step302 = next(w for _, w, d, n in rects if d == 1 and n == 250)
    assert step302 == pytest.approx(FLAME_W * 250 / total, abs=1e-3)
    # Boxes of one row do not overlap and fill the row.
    for depth in (1, 2):
        row = sorted((x, w) for x, w, d, _ in rects if d == depth)
        for (x0, w0), (x1, _) in zip(row, row[1:], strict=False):
            assert x1 == pytest.approx(x0 + w0, abs=2e-3)
        assert sum(w for _, w in row) == pytest.approx(FLAME_W, abs=5e-3)


def test_a_hostile_frame_name_is_escaped(tmp_path: Path) -> None:
    page = _page(_report(tmp_path))
    flame = page[page.index("<h4>Flame graph"):]
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; (evil.py:1): 30 samples" in flame


def test_no_stacks_no_flame_graph() -> None:
    assert flame_graph({}) == ""
    assert flame_graph({"flame": {"stacks": [{"frames": ["a"], "samples": -3},
                                             {"frames": "a;b", "samples": 4}]}}) == ""
    got = flame_graph({"flame": {"stacks": [{"frames": ["main", "f"], "samples": 3},
                                            {"frames": ["main"], "samples": 1}]}})
    assert 'data-depth="1" data-samples="4"' in got and 'data-samples="3"' in got


def test_mcp_chains_leave_the_flame_stacks_to_get_cpu_profile(tmp_path: Path) -> None:
    from fleetd.mcp.local import compact_chain

    ch = next(c for c in _report(tmp_path)["chains"] if c["root_cause"] == "host_cpu_bound")
    got = compact_chain(ch, 3)
    assert "flame" not in got["detail"] and got["detail"]["top_frames"] == ch["detail"][
        "top_frames"]
    assert "flame" in ch["detail"]  # the report itself keeps them


def test_the_report_keeps_the_heaviest_stacks_and_the_rest_as_one() -> None:
    from fleetd.analyze.reading.profile import FLAME_CHARS, FLAME_STACKS, StackCount, flame_stacks

    stacks = [StackCount("n", 1, 1, (f"f{i} (/w/m.py:{i})", "x" * 1000), 1000 - i, 0)
              for i in range(FLAME_STACKS + 5)]
    got = flame_stacks(stacks)
    assert got["samples"] == sum(s.samples for s in stacks)
    assert len(got["stacks"]) == FLAME_STACKS + 1
    assert got["stacks"][-1] == {"frames": ["[5 other stacks]"],
                                 "samples": sum(s.samples for s in stacks[FLAME_STACKS:])}
    assert got["stacks"][0]["frames"] == ["x" * FLAME_CHARS, "f0 (m.py:0)"]
    assert sum(s["samples"] for s in got["stacks"]) == got["samples"]
