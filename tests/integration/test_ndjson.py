"""Issue 17 item 3 / issue 20 item 3, agent side: query answers streamed as NDJSON under
the row, byte and time limits; a dropped stream frees its reader; light routes answer
while every reader slot is taken. One real agent over mTLS for the module."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from agents import Agent, Pki, client_ssl, request, serving

NDJSON = {"Accept": "application/x-ndjson"}
# Rows slowly: one every 20k steps of a counter, so a short time limit ends it mid-way.
SLOW_ROWS = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
             "SELECT x FROM c WHERE x % 20000 = 0")
FOREVER = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Agent]:
    with serving(tmp_path_factory.mktemp("nd"), "gpu-01", pki, 3000) as a:
        yield a


def _stream(node: Agent, pki: Pki, body: dict[str, Any]) -> tuple[int, str, list[Any]]:
    status, _, raw = request(node.url, client_ssl(pki), "POST", "/api/v1/query", json=body,
                             headers=NDJSON)
    return status, raw.decode(), [json.loads(x) for x in raw.splitlines()] if raw else []


def test_stream_has_header_rows_and_trailer_equal_to_the_json_answer(node: Agent,
                                                                     pki: Pki) -> None:
    body = {"sql": "SELECT id, op, dur_ns, stack FROM events ORDER BY rowkey"}
    status, _, lines = _stream(node, pki, body)
    header, rows, trailer = lines[0], lines[1:-1], lines[-1]
    assert status == 200 and header["node"] == "gpu-01"
    assert header["columns"] == ["id", "op", "dur_ns", "stack"]
    assert header["limits"]["max_rows"] == 10_000
    assert trailer["end"] is True and trailer["rows"] == 3000 and trailer["truncated"] is False
    _, plain, _ = request(node.url, client_ssl(pki), "POST", "/api/v1/query", json=body)
    assert rows == plain["rows"]  # the default answer is still one JSON document


@pytest.mark.parametrize(("limit", "reason"), [({"max_rows": 7}, "rows"),
                                               ({"max_bytes": 5000}, "bytes")])
def test_limits_cut_the_stream_and_the_trailer_says_so(node: Agent, pki: Pki,
                                                       limit: dict[str, int],
                                                       reason: str) -> None:
    status, raw, lines = _stream(node, pki, {"sql": "SELECT * FROM events", **limit})
    trailer = lines[-1]
    assert status == 200 and trailer["truncated"] is True
    assert trailer["truncated_reason"] == reason and trailer["rows"] == len(lines) - 2
    assert len(raw) < 5000 + 2000 if reason == "bytes" else len(lines) == 9


def test_errors_before_the_first_row_are_json_and_after_it_in_the_trailer(
        node: Agent, pki: Pki) -> None:
    status, err, _ = request(node.url, client_ssl(pki), "POST", "/api/v1/query",
                             json={"sql": "DELETE FROM event_data"}, headers=NDJSON)
    assert status == 403 and err["error"]["code"] == "forbidden"
    status, _, lines = _stream(node, pki, {"sql": SLOW_ROWS, "timeout_s": 0.5})
    assert status == 200 and isinstance(lines[1], list)  # rows came before the limit
    assert lines[-1]["error"]["code"] == "timeout", lines[-1]


async def _abandon(url: str, ssl: Any) -> None:
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/api/v1/query", ssl=ssl, headers=NDJSON,
                   json={"sql": "SELECT e.id, f.id FROM event_data e, event_data f"}) as r:
        await r.content.read(1000)  # a few rows of millions, then hang up


def test_an_abandoned_stream_frees_its_reader(node: Agent, pki: Pki) -> None:
    ssl = client_ssl(pki)

    async def go() -> None:
        for _ in range(3):  # 12 abandoned: more than the 8 readers and the share of 4
            await asyncio.gather(*(_abandon(node.url, ssl) for _ in range(4)))

    asyncio.run(go())
    t = time.monotonic()
    status, res, _ = request(node.url, ssl, "POST", "/api/v1/query",
                             json={"sql": "SELECT count(*) FROM event_data"})
    assert status == 200 and res["rows"] == [[3000]], res
    assert time.monotonic() - t < 3


def test_light_routes_answer_while_every_reader_is_busy(node: Agent, pki: Pki) -> None:
    # Before the light lane, /metrics waited up to 2 s for a query's slot.
    async def go() -> tuple[list[int], list[float]]:
        slow = []
        for who in ("laptop", "other"):  # each client may hold half of the 8 readers
            s = aiohttp.ClientSession()
            ssl = client_ssl(pki, who)
            slow += [asyncio.ensure_future(s.post(node.url + "/api/v1/query", ssl=ssl,
                                                  json={"sql": FOREVER, "timeout_s": 3}))
                     for _ in range(4)]
            slow.append(s)  # type: ignore[arg-type]
        await asyncio.sleep(0.8)  # every slot taken now
        light = []
        async with aiohttp.ClientSession() as s:
            for path in ("/api/v1/health", "/api/v1/time", "/metrics"):
                t = time.monotonic()
                async with s.get(node.url + path, ssl=client_ssl(pki)) as r:
                    await r.read()
                    assert r.status == 200, path
                light.append(time.monotonic() - t)
        statuses = []
        for item in slow:
            if isinstance(item, aiohttp.ClientSession):
                continue
            resp = await item
            statuses.append(resp.status)
            resp.release()
        for item in slow:
            if isinstance(item, aiohttp.ClientSession):
                await item.close()
        return statuses, light

    statuses, light = asyncio.run(go())
    assert statuses == [408] * 8, statuses  # they did hold every slot meanwhile
    assert max(light) < 0.5, light
