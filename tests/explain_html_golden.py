"""The ``explain_html`` scenario: five synthetic nodes merged into one file, explained,
and drawn as the HTML page of ``fleetd explain --format html``.

Golden files, in ``tests/data/explain_html/``:

- ``explain.json``: what ``fleetd explain --db merged.db --format json`` printed for the
  scenario when the goldens were last written (the renderer's input);
- ``report.html``: the page :func:`fleetd.export.html.write_report` draws from it.

The comparison renders the stored JSON again, so it tests the renderer alone: a change
to the analysis does not make it fail, a change to the page does. They change only
through this script:

    .venv/bin/python tests/explain_html_golden.py --write    # rebuild both from the scenario
    .venv/bin/python tests/explain_html_golden.py            # compare, exit 1 on a difference

The scenario (tests/synth.py timelines, 6 s each, one node name per input through
``merge --force-node``): gpu-01 quiet; gpu-02 quiet with 1-in-4 sampled launches (its
percentiles come from the in-kernel histograms); gpu-03 a sync every step (the flagged
straggler, on sync_p50_ns); gpu-04 a sidecar holding the GPU thread in D state
(lock_wait, HIGH); gpu-05 a CPU hog preempting the syncs (cpu_contention, HIGH).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import synth  # noqa: E402
from export_golden import write_or_compare  # noqa: E402

from fleetd.cli.main import main as fleetd_main  # noqa: E402
from fleetd.export.html import write_report  # noqa: E402
from fleetd.store.merge import merge  # noqa: E402

GOLDEN_DIR = ROOT / "tests" / "data" / "explain_html"
GOLDEN_JSON = GOLDEN_DIR / "explain.json"
GOLDEN_HTML = GOLDEN_DIR / "report.html"

NODES: tuple[tuple[str, Callable[[Path], Path]], ...] = (
    ("gpu-01", synth.quiet),
    ("gpu-02", lambda p: synth.quiet(p, sample=4)),
    ("gpu-03", synth.host_sync),
    ("gpu-04", synth.lock_wait),
    ("gpu-05", synth.cpu_hog),
)


def build(tmp: Path, names: dict[str, str] | None = None) -> Path:
    """The five nodes merged into ``tmp/merged.db``; ``names`` renames nodes."""
    inputs, forced = [], []
    for node, make in NODES:
        path = make(tmp / f"{node}.db")
        inputs.append(path)
        forced.append(f"{path}={(names or {}).get(node, node)}")
    out = tmp / "merged.db"
    merge(inputs, out, forced)
    return out


def explain_json(db: Path, out: Path) -> bytes:
    rc = fleetd_main(["explain", "--db", str(db), "--format", "json", "-o", str(out)])
    assert rc == 0, rc
    return out.read_bytes()


def render(report: dict[str, Any]) -> bytes:
    buf = StringIO()
    write_report(report, buf)
    return buf.getvalue().encode()


def main(argv: list[str]) -> int:
    if "--write" in argv:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            data = explain_json(build(Path(d)), Path(d) / "explain.json")
        write_or_compare(GOLDEN_JSON, data, True)
        return write_or_compare(GOLDEN_HTML, render(json.loads(data)), True)
    return write_or_compare(GOLDEN_HTML, render(json.loads(GOLDEN_JSON.read_bytes())), False)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
