"""Issue #19, item 14: the page of ``fleetd explain --format html``, loaded in a browser.

Headless Chromium (Debian's ``chromium``, installed by scripts/setup.sh) loads each page
from a file and prints the DOM it built (``--dump-dom``) and every console message
(``--enable-logging=stderr --v=0``: a script error, a blocked fetch and a
Content-Security-Policy violation all land there). A page passes when the DOM holds its
SVG charts and the strings from the nodes as text, and the console is silent. A control
page with a deliberate ``console.error`` shows that the harness does hear the console.

Two pages: a merged file of five synthetic nodes whose node, process and thread names
are hostile (``<script>``, ``<img onerror>``), and three live agents over mTLS
(``--nodes``; their op statistics come from a second fan-out), one of them serving
hostile process names.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import FLEETD, IN_CI, REPO

sys.path.insert(0, str(REPO / "tests"))

import explain_html_golden as golden  # noqa: E402
import synth  # noqa: E402
from agents import Pki, agent  # noqa: E402

from fleetd.store.merge import merge  # noqa: E402

pytestmark = pytest.mark.slow

CONSOLE = re.compile(r":CONSOLE[(:]")
XSS_NODE = "<script>console.error('xss-node')</script>"
XSS_COMM = "<img src=x onerror=\"console.error('xss-comm')\">"
XSS_THREAD = "</text></svg><script>console.error('xss-thread')</script>"


@dataclass
class Loaded:
    dom: str
    console: list[str]  # the page's console messages, one line each


def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        if IN_CI:
            pytest.fail("chromium is not installed: scripts/setup.sh installs it")
        pytest.skip("chromium is not installed (apt-get install chromium, or "
                    "scripts/setup.sh)")
    return found


def load(page: Path, tmp: Path) -> Loaded:
    """Load ``page`` in headless Chromium: the DOM after loading, and the console."""
    profile = tmp / f"chromium-{page.stem}"
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
           "--enable-logging=stderr", "--v=0", "--dump-dom", page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "</html>" in proc.stdout, proc.stderr[-3000:]
    return Loaded(proc.stdout, [x for x in proc.stderr.splitlines() if CONSOLE.search(x)])


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, timeout=300)


def test_the_harness_hears_the_console(tmp_path: Path) -> None:
    control = tmp_path / "control.html"
    control.write_text("<!DOCTYPE html><html><head><title>control</title></head><body>"
                       "<svg width=\"10\" height=\"10\"></svg>"
                       "<script>console.error('control-marker')</script></body></html>")
    got = load(control, tmp_path)
    assert "<svg" in got.dom
    assert any("control-marker" in line for line in got.console), got.console


def _assert_renders(got: Loaded, min_charts: int, *hostile: str) -> None:
    assert got.console == [], got.console  # no script error, no blocked fetch, no CSP
    assert got.dom.count("<svg") >= min_charts
    for section in ("stragglers", "threads", "ops", "chains"):
        assert f'id="{section}"' in got.dom
    assert "<script" not in got.dom.replace("&lt;script", "")
    for text in hostile:  # shown as text: escaped in the DOM Chromium built
        assert text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") \
            in got.dom, text


def _rename(db: Path, node: str, new: str) -> None:
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE nodes SET name = ? WHERE name = ?", (new, node))
    conn.close()


def _hostile_names(db: Path, pid: int, tid: int) -> None:
    """The culprit's process name and the GPU thread's name, as a node could send them."""
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE process_data SET comm = ? WHERE pid = ?", (XSS_COMM, pid))
        conn.execute("UPDATE task_data SET comm = ? WHERE tid = ?", (XSS_THREAD, tid))
    conn.close()


def test_a_merged_file_renders_in_chromium(tmp_path: Path) -> None:
    db = golden.build(tmp_path)
    _rename(db, "gpu-05", XSS_NODE)  # the cpu-hog node
    _hostile_names(db, synth.STRESS, synth.MAIN_TID)
    page = tmp_path / "report.html"
    proc = fleetd("explain", "--db", str(db), "--format", "html", "-o", str(page))
    assert proc.returncode == 0, proc.stderr
    assert "5 node(s)" in proc.stdout and "1 straggler(s)" in proc.stdout
    got = load(page, tmp_path)
    # Charts: stragglers, the thread breakdown, histograms per node, a timeline per chain.
    _assert_renders(got, 1 + 1 + 5 * 4 + 3, XSS_NODE, XSS_COMM, XSS_THREAD)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory,
          pki: Pki) -> Iterator[tuple[Path, list[str]]]:
    """Three agents serving synthetic nodes over mTLS: quiet, a sync every step, a hog
    whose culprit has a hostile name."""
    d = tmp_path_factory.mktemp("html-fleet")
    nodes = {"gpu-01": synth.quiet, "gpu-02": synth.host_sync, "gpu-03": synth.cpu_hog}
    with ExitStack() as stack:
        specs = []
        for name, make in nodes.items():
            raw = make(d / f"raw-{name}.db")
            db = d / f"{name}.db"
            merge([raw], db, [f"{raw}={name}"])  # each file under its own node name
            if name == "gpu-03":
                _hostile_names(db, synth.STRESS, synth.MAIN_TID)
            a = stack.enter_context(agent(db, name, pki, "--no-trace"))
            specs.append(f"{name}={a.url.removeprefix('https://')}")
        cert, key = pki.pair("laptop")
        yield d, ["--nodes", ",".join(specs), "--ca-cert", str(pki.ca), "--client-cert",
                  str(cert), "--client-key", str(key)]


def test_a_live_fleet_renders_in_chromium(fleet: tuple[Path, list[str]],
                                          tmp_path: Path) -> None:
    _, flags = fleet
    page = tmp_path / "fleet.html"
    proc = fleetd("explain", *flags, "--format", "html", "-o", str(page))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {page}") and "3 node(s)" in proc.stdout
    html = page.read_text()
    # The op histograms of every node, from the ops fan-out beside explain's.
    for node in ("gpu-01", "gpu-02", "gpu-03"):
        assert f"<h3>{node}</h3>" in html
    assert "latency histogram of cudaStreamSynchronize" in html
    assert "sync_p50_ns per node" in html  # gpu-02 syncs every step: the straggler
    got = load(page, tmp_path)
    _assert_renders(got, 1 + 1 + 3 * 4 + 2, XSS_COMM, XSS_THREAD)
    # The same refusal as for a local file.
    again = fleetd("explain", *flags, "--format", "html", "-o", str(page))
    assert again.returncode == 2 and "exists" in again.stderr


def screenshot(page: Path, tmp: Path, width: int = 1000, height: int = 1400) -> bytes:
    """A real PNG of the page as Chromium draws it."""
    png = tmp / f"{page.stem}.png"
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--disable-background-networking", "--disable-component-update", "--no-first-run",
           f"--user-data-dir={tmp / 'chromium-shot'}", f"--window-size={width},{height}",
           f"--screenshot={png}", page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp)})
    assert proc.returncode == 0 and png.exists(), proc.stderr[-2000:]
    return png.read_bytes()


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_an_imported_gpu_timeline_draws_its_gpu_chart_in_chromium(tmp_path: Path) -> None:
    """Issue 44.7: the GPU section of an imported nsys timeline, loaded and drawn."""
    page = tmp_path / "gpu.html"
    proc = fleetd("explain", "--db", str(REPO / "investigations" / "gpu" / "cloverleaf-nsys.db"),
                  "--format", "html", "-o", str(page))
    assert proc.returncode == 0, proc.stderr
    got = load(page, tmp_path)
    assert got.console == [], got.console
    assert 'id="gpu"' in got.dom and "M1-M5 of" in got.dom and "GPU time of" in got.dom
    shot = screenshot(page, tmp_path)
    assert _png_size(shot) == (1000, 1400)
    assert len(shot) > 20_000  # charts and text drawn, not an empty page
