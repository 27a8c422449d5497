"""Issue #19, item 11: the client commands never import BCC nor the agent extra.

Here BCC *is* importable (scripts/setup.sh links it into the venv), so a client command
that imported it, even inside ``try``, would show up in ``sys.modules``. The install
without BCC is tests/integration/test_packaging.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, build_db, cli_probe

PROBE = cli_probe([
    ["--help"], ["explain", "--db", "{db}", "--format", "json"],
    ["explain", "--db", "{db}", "--format", "html", "-o", "{work}/r.html"],
    ["ops", "--db", "{db}"], ["overview", "--db", "{db}"], ["stacks", "--db", "{db}"],
    ["query", "--db", "{db}", "SELECT count(*) FROM events"],
    ["merge", "{db}", "-o", "{work}/m.db"], ["export", "--db", "{db}", "-o", "{work}/t.json"],
    ["certs", "--dir", "{work}/pki", "init-ca"], ["completion", "bash"]]) + """
print(json.dumps({"codes": codes, "loaded": sorted(m for m in sys.modules
                                                   if m.split(".")[0] in ("bcc", "elftools"))}))
"""


def test_client_commands_import_neither_bcc_nor_pyelftools(tmp_path: Path) -> None:
    if importlib.util.find_spec("bcc") is None:
        pytest.skip("bcc is not importable here, so nothing could import it")
    db = build_db(tmp_path / "node.db")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(db), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["codes"] == [0] * 11, got
    assert got["loaded"] == [], got


def test_the_parser_loads_no_analyzer_and_no_http_client() -> None:
    """Every fleetd process builds the whole parser first; a command's heavy imports
    (the analyzers, aiohttp) wait until that command runs, so `fleetd --version`, `fleetd
    query` and the suite's thousand short commands do not pay for them."""
    code = ("import json, sys\nfrom fleetd.cli.main import build_parser\nbuild_parser()\n"
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    heavy = [m for m in loaded if m.split(".")[0] == "aiohttp" or m in (
        "fleetd.analyze.facade", "fleetd.analyze.explain", "fleetd.fleet.client",
        "fleetd.analyze.distributed.collectives", "fleetd.analyze.causes.chains")]
    assert heavy == [], heavy
