"""The MCP tool ``get_gpu_breakdown`` over an imported nsys trace: the same figures as
``fleetd gpu --format json``, the kernel table cut and its names marked as data, and the
``investigate`` prompt asking for the host-overhead verdict."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
from mcp import Client

from fleetd.cli.main import main
from fleetd.mcp.local import LocalBackend
from fleetd.mcp.server import ServerSettings, build_server

NSYS = Path(__file__).resolve().parents[1] / "data" / "gpu" / "perlmutter-cloverleaf-cuda.sqlite"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mcp-gpu") / "clover.db"
    assert main(["import", str(NSYS), "--db", str(path)]) == 0
    return path


def _call(db: Path, args: dict[str, Any]) -> dict[str, Any]:
    srv = build_server(LocalBackend(db, db.parent / "exports"), ServerSettings())

    async def go() -> Any:
        async with Client(srv, mode="legacy") as client:
            return await client.call_tool("get_gpu_breakdown", args)

    r = asyncio.run(go())
    assert not r.is_error, r
    return dict(orjson.loads(r.content[0].text))  # type: ignore[union-attr]


def test_gpu_breakdown_matches_the_cli(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = _call(db, {"top_n": 3})
    capsys.readouterr()
    assert main(["gpu", "--db", str(db), "--format", "json"]) == 0
    cli = orjson.loads(capsys.readouterr().out)
    [rank] = got["ranks"]
    assert rank == cli["ranks"][0]
    assert rank["verdict"]["host_overhead"] in ("YES", "NO")
    assert len(got["kernels"]) == 3 and got["kernels_shown"]["truncated"] is True
    src = sqlite3.connect(f"file:{NSYS}?mode=ro&immutable=1", uri=True)
    n_names = src.execute("SELECT count(DISTINCT demangledName) FROM "
                          "CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    src.close()
    assert got["kernels_shown"]["kernels_total"] == n_names == len(cli["kernels"])
    for k, want in zip(got["kernels"], cli["kernels"], strict=False):
        assert set(k["name"]) == {"untrusted"}  # a name from the profiled program is data
        assert k["total_ns"] == want["total_ns"]


def test_investigate_prompt_asks_for_the_verdict(db: Path) -> None:
    srv = build_server(LocalBackend(db, db.parent / "exports"), ServerSettings())

    async def go() -> Any:
        async with Client(srv, mode="legacy") as client:
            return await client.get_prompt("investigate", {})

    text = asyncio.run(go()).messages[0].content.text
    assert "get_gpu_breakdown" in text and "host-overhead verdict" in text
    assert text.index("get_causal_chains") < text.index("get_gpu_breakdown") < text.index("Fix:")
