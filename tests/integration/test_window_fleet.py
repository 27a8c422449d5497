"""One window, parsed once (#46 item 3), end to end: the same ``--from``/``--to`` over a
local file and over a live agent serving a copy of it (real mTLS, real process) select
the same rows, ``--to`` inclusive on both sides; a bad window sent straight to the node
is a 400 quoting it."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from agents import Agent, Pki, agent, client_ssl, request

from conftest import FLEETD, REPO

SCENARIO = REPO / "tests" / "data" / "scenarios" / "cpu_hog.db"
NODE = "gpu-01"


@pytest.fixture(scope="module")
def served(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Agent]]:
    db = tmp_path_factory.mktemp("window") / "node.db"
    shutil.copyfile(SCENARIO, db)
    c = sqlite3.connect(db)  # named as a node of the session's PKI
    try:
        c.execute("UPDATE nodes SET name = ?", (NODE,))
        c.commit()
    finally:
        c.close()
    with agent(db, NODE, pki, "--no-trace") as a:
        yield db, a


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def _tls(pki: Pki) -> list[str]:
    cert, key = pki.pair("laptop")
    return ["--ca-cert", str(pki.ca), "--client-cert", str(cert), "--client-key", str(key)]


def _syncs(out: str) -> int:
    rows = json.loads(out)
    cols, values = rows["columns"], rows["rows"]
    found = [dict(zip(cols, r, strict=True)) for r in values]
    return sum(int(r["count"]) for r in found if r["op"] == "cudaStreamSynchronize")


def test_a_window_selects_the_same_rows_locally_and_on_a_node(
        pki: Pki, served: tuple[Path, Agent]) -> None:
    db, node = served
    with sqlite3.connect(SCENARIO) as c:
        syncs = [int(r[0]) for r in c.execute(
            "SELECT ts_ns FROM events WHERE op = 'cudaStreamSynchronize' ORDER BY ts_ns")]
    first, edge = str(syncs[0]), str(syncs[9])  # --to sits exactly on the tenth call
    local = fleetd("ops", "--db", str(SCENARIO), "--from", first, "--to", edge, "--format", "json")
    assert local.returncode == 0, local.stderr
    address = node.url.removeprefix("https://")
    # Same machine, same clock: no correction, so the edge stays on the call.
    fleet = fleetd("ops", "--nodes", address, *_tls(pki), "--no-clock-correction",
                   "--from", first, "--to", edge, "--format", "json")
    assert fleet.returncode == 0, fleet.stderr
    assert _syncs(local.stdout) == _syncs(fleet.stdout) == 10
    # The fleet answer names the window in the user's words.
    explain = fleetd("explain", "--nodes", address, *_tls(pki), "--no-clock-correction",
                     "--from", first, "--to", edge, "--format", "json")
    assert explain.returncode == 0, explain.stderr
    assert json.loads(explain.stdout)["window"] == {"label": f"{first} .. {edge}"}


def test_a_bad_window_sent_to_a_node_is_a_400_quoting_it(
        pki: Pki, served: tuple[Path, Agent]) -> None:
    _, node = served
    status, body, _ = request(node.url, client_ssl(pki), path="/api/v1/ops?to=yesterday-ish")
    assert status == 400 and body["error"]["code"] == "bad_request"
    assert "yesterday-ish" in body["error"]["message"]
    status, body, _ = request(node.url, client_ssl(pki),
                              path="/api/v1/ops?from=1750000060&to=1750000000")
    assert status == 400 and "is not before --to '1750000000'" in body["error"]["message"]
