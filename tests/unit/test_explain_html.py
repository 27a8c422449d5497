"""Issue #19, item 14: ``fleetd explain --format html``, the renderer and the command.

The page is a pure function of explain's JSON (fleetd/export/html.py): checked against
a golden file, against hostile strings in every field a node sends, and against
reports of the wrong shape. The browser check is
tests/integration/test_explain_html_browser.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from io import StringIO
from pathlib import Path
from typing import Any

from conftest import FLEETD, REPO, assert_one_line_error

sys.path.insert(0, str(REPO / "tests"))

import explain_html_golden as golden  # noqa: E402

from fleetd.export.html import write_report  # noqa: E402

SCENARIOS = REPO / "tests" / "data" / "scenarios"
HOSTILE = "<script>alert('x')</script><img src=x onerror=alert(1)>\"'&amp;"
# What the page may contain: no script, no embedded document, no form, no link out.
TAGS = {"html", "head", "meta", "title", "style", "body", "header", "footer", "nav",
        "section", "article", "details", "summary", "h1", "h2", "h3", "h4", "p", "a", "b",
        "i", "span", "code", "div", "ul", "li", "table", "tr", "th", "td", "figure",
        "figcaption", "svg", "text", "rect", "line"}


class Page(HTMLParser):
    """Every tag with its attributes, and the text, as a browser's tokenizer sees them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(page: str) -> Page:
    p = Page()
    p.feed(page)
    p.close()
    return p


def render(report: Any) -> str:
    buf = StringIO()
    write_report(report, buf)
    return buf.getvalue()


def golden_report() -> dict[str, Any]:
    report: dict[str, Any] = json.loads(golden.GOLDEN_JSON.read_bytes())
    return report


def test_page_matches_the_golden_file() -> None:
    page = render(golden_report()).encode()
    assert page == golden.GOLDEN_HTML.read_bytes(), (
        "the page changed; if on purpose: .venv/bin/python tests/explain_html_golden.py "
        "--write (the diff: .venv/bin/python tests/explain_html_golden.py)")


def test_the_golden_page_draws_every_section() -> None:
    page = golden.GOLDEN_HTML.read_text()
    report = golden_report()
    doc = parse(page)
    ids = {a.get("id") for _, a in doc.tags}
    assert {"stragglers", "threads", "ops", "chains"} <= ids
    labels = [a.get("aria-label") for t, a in doc.tags if t == "svg"]
    # The straggler chart: the flagged node's metric, each node against the median.
    flagged = [s for s in report["stragglers"] if s["flagged"]]
    assert [s["node"] for s in flagged] == ["gpu-03"]
    assert "sync_p50_ns per node" in labels and "fleet median 2.04 ms" in page
    assert labels.count("per-thread time breakdown") == 1
    hist = [x for x in labels if x and x.startswith("latency histogram of ")]
    per_node: dict[str, int] = {}
    for r in report["ops"]:
        per_node[r["node"]] = per_node.get(r["node"], 0) + 1
    assert len(hist) == sum(min(n, 12) for n in per_node.values()) >= 5 * 4
    assert "latency histogram of cudaStreamSynchronize" in hist
    assert labels.count("evidence timeline") == len(report["chains"])
    assert "estimated from in-kernel histograms" in page  # gpu-02 sampled its launches
    # No fetch of any kind, no script: the page stands alone.
    assert "<script" not in page.lower() and "url(" not in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def _hostile(value: Any) -> Any:
    """Every string of the report, hostile (keys stay: they are the renderer's own)."""
    if isinstance(value, str):
        return value + HOSTILE
    if isinstance(value, list):
        return [_hostile(v) for v in value]
    if isinstance(value, dict):
        return {k: _hostile(v) for k, v in value.items()}
    return value


def test_every_string_a_node_sends_is_escaped() -> None:
    report = golden_report()
    for c in report["chains"]:  # frames too: they come from the node's symbolizer
        for e in c["evidence"]:
            e["stack"] = ["train_step", "</li></ul><script>alert(2)</script>"]
    report["warnings"] = ["a warning", {"node": "n", "error": "e", "kind": "timeout"}]
    report["skew"] = {"gpu-01": {"offset_ms": "<b>1</b>", "error_ms": 0.2}}
    report["verdicts"] = {"gpu-01": "quiet"}
    page = render(_hostile(report))
    doc = parse(page)
    assert {t for t, _ in doc.tags} <= TAGS, {t for t, _ in doc.tags} - TAGS
    for tag, attrs in doc.tags:
        assert not [k for k in attrs if k.startswith("on")], (tag, attrs)
        if tag == "a":
            assert (attrs.get("href") or "").startswith("#"), attrs
    assert "<script" not in page.lower() and "<img" not in page.lower()
    text = "".join(doc.text)
    # The hostile strings are there, as text a reader sees (node names, comms, frames,
    # reasons, evidence, fixes, warnings).
    assert text.count("<script>alert('x')</script>") > 50
    assert "</li></ul><script>alert(2)</script>" in text
    escaped = "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&lt;img src=x onerror=alert(1)"
    assert escaped in page


def test_a_report_of_the_wrong_shape_still_renders() -> None:
    """A node may send anything: wrong types cost a row or a chart, never the page."""
    bad: dict[str, Any] = {
        "nodes": "gpu-01", "window": [], "verdict": None, "warnings": [None, 3, {"node": 1}],
        "chains": [{"severity": 5, "evidence": "x", "victim": [], "culprit": "str",
                    "culprits": [None], "fixes": None, "explained": "1"},
                   {"evidence": [{"ts_ns": "1", "dur_ns": None}, {"ts_ns": 10, "dur_ns": -5,
                                                                "spike": 1, "stack": "ab"}]},
                   None],
        "processes": [{"threads": [{"wall_ns": "1"}, {"wall_ns": 0}, {"wall_ns": 100,
                                                                   "running_ns": 400}]},
                      "x"],
        "ops": [{"p50_ns": "x"}, {"p50_ns": 0, "count": 1, "p95_ns": None, "max_ns": 0},
                {"p50_ns": 10, "count": 3, "p95_ns": 5, "p99_ns": 10**15, "max_ns": 10**15},
                {"p50_ns": True, "count": 2}],
        "stragglers": [{"metrics": {"m": 3}, "metric": "m", "flagged": True},
                       {"node": "a", "metric": "m", "metrics": {"m": {"value": -1}}},
                       None, {"score": "0.3", "flagged": "yes"}],
        "skew": {"a": None}, "verdicts": [], "collectives": {"communicators": [1]},
    }
    for report in (bad, {}, {"chains": [], "processes": [], "ops": [], "stragglers": []}):
        page = render(report)
        assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>\n")
        assert {t for t, _ in parse(page).tags} <= TAGS


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, timeout=120)


def test_explain_writes_the_page_and_never_over_a_file(tmp_path: Path) -> None:
    db = str(SCENARIOS / "cpu_hog.db")
    out = tmp_path / "report.html"
    proc = fleetd("explain", "--db", db, "--format", "html", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out} (") and "1 chain(s)" in proc.stdout
    assert "open it in a browser" in proc.stdout
    # The page is the renderer's drawing of what --format json prints.
    report = json.loads(fleetd("explain", "--db", db, "--format", "json").stdout)
    assert out.read_text() == render(report)
    before = out.stat().st_mtime_ns
    again = fleetd("explain", "--db", db, "--format", "html", "-o", str(out))
    assert_one_line_error(again, "report.html", "exists")
    assert "--force" in again.stderr and out.stat().st_mtime_ns == before
    forced = fleetd("explain", "--db", db, "--format", "html", "-o", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert out.read_text() == render(report)
    # Refused before any work, like `fleetd export -o`: a missing directory, a directory.
    assert_one_line_error(fleetd("explain", "--db", db, "--format", "html", "-o",
                                 str(tmp_path / "no" / "r.html")), "does not exist")
    assert_one_line_error(fleetd("explain", "--db", db, "--format", "html", "-o",
                                 str(tmp_path)), "is a directory")
    # Without -o the page goes to stdout; -o takes the other formats too.
    assert fleetd("explain", "--db", db, "--format", "html").stdout == render(report)
    js = tmp_path / "r.json"
    assert fleetd("explain", "--db", db, "--format", "json", "-o", str(js)).returncode == 0
    assert json.loads(js.read_text()) == report


# ---- issue 44.7: labels that never collide, log-scaled call bars, a GPU chart ------------

RECORDINGS = sorted((REPO / "investigations").rglob("*.db"))


def _explained(db: Path) -> dict[str, Any]:
    r = subprocess.run([FLEETD, "explain", "--db", str(db), "--format", "json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _collisions(page: str) -> list[str]:
    """Text of one row of a chart (same svg, same y) whose estimated extents overlap."""
    import re

    from fleetd.export.svg import extent as _extent

    found = []
    for n, svg in enumerate(re.findall(r"<svg.*?</svg>", page, flags=re.S)):
        rows: dict[str, list[tuple[float, float, str]]] = {}
        for x, y, anchor, text in re.findall(
                r'<text x="([\d.]+)" y="([\d.]+)" text-anchor="(\w+)"[^>]*>([^<]*)</text>', svg):
            left, right = _extent(float(x), text, anchor)
            rows.setdefault(y, []).append((left, right, text))
        for y, items in rows.items():
            items.sort()
            for (_, r1, t1), (l2, _, t2) in zip(items, items[1:], strict=False):
                if l2 < r1:
                    found.append(f"svg {n} y={y}: {t1!r} overlaps {t2!r}")
    return found


def test_axis_labels_drop_the_ones_that_would_collide() -> None:
    from fleetd.export.svg import axis_labels

    # Six decades in 310 px: '10 ms' (middle) and '100 ms' (end) used to touch.
    ticks = [(10 + i * 310 / 6, label, "start" if i == 0 else "end" if i == 6 else "middle")
             for i, label in enumerate(["100 ns", "1 us", "10 us", "100 us", "1 ms",
                                        "10 ms", "100 ms"])]
    kept = axis_labels(ticks)
    assert kept[0] == ticks[0] and kept[-1] == ticks[-1]
    assert ("10 ms" not in [t for _, t, _ in kept]) and len(kept) < len(ticks)
    page = render({"ops": [{"node": "n", "op": "op", "count": 10, "p50_ns": 150,
                            "p95_ns": 9e6, "p99_ns": 5e7, "max_ns": 9e7, "mean_ns": 100}]})
    assert "latency histogram of op" in page and not _collisions(page)


def test_no_chart_of_a_shipped_recording_has_colliding_labels() -> None:
    pages = [render(golden_report()), *(render(_explained(db)) for db in RECORDINGS)]
    assert len(pages) > 5
    for page in pages:
        assert not _collisions(page), _collisions(page)[:5]


def _chain_with(durs: list[float]) -> dict[str, Any]:
    evidence = [{"kind": "stall", "ts_ns": 1_700_000_000_000_000_000 + i * 10**9,
                 "dur_ns": d, "time": f"2023-11-14T22:13:2{i}.000000Z",
                 "text": f"stall {i}"} for i, d in enumerate(durs)]
    return {"chains": [{"severity": "HIGH", "root_cause": "cpu_contention",
                        "evidence": evidence, "victim": {"comm": "python", "pid": 1}}]}


def test_a_chains_calls_are_drawn_to_a_log_scale_with_their_values() -> None:
    import re

    page = render(_chain_with([234e6, 330e3]))
    fig = page[page.index("call durations"):page.index("evidence timeline")]
    widths = [float(w) for w in re.findall(r'<rect [^>]*width="([\d.]+)"', fig)]
    assert len(widths) == 2 and widths[0] > 1.5 * widths[1], widths
    assert ">234.00 ms<" in fig and ">330.0 us<" in fig, fig
    # One call: nothing to compare, no such chart.
    assert "call durations" not in render(_chain_with([5e6]))


def test_an_imported_gpu_timeline_gets_a_gpu_chart() -> None:
    report = _explained(REPO / "investigations" / "gpu" / "cloverleaf-nsys.db")
    [g] = report["gpu"]
    assert {"idle_pct", "compute_pct", "metrics", "thresholds"} <= set(g)
    page = render(report)
    assert 'id="gpu"' in page and 'href="#gpu"' in page
    assert "GPU time of" in page and "M1-M5 of" in page
    assert "counts &lt; 0.6" in page  # M4 counts below its threshold
    # Red only on the side that counts: M4 = 0.86 is above 0.6, which is no overhead.
    m4 = next(x for x in page.split("<rect") if "M4 =" in x)
    assert "#1e88e5" in m4
    # A host-side report has no GPU section.
    assert 'id="gpu"' not in render(golden_report())


def test_node_names_never_wrap() -> None:
    page = render(golden_report())
    assert "td.node { white-space: nowrap; }" in page and '<td class="node">' in page
