"""The client's NDJSON reader (fleetd/wire/query.py) on byte streams cut anywhere:
every broken or hostile stream is a named failure of its node, never another error."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from fleetd.wire.failure import NodeFailed
from fleetd.wire.query import QueryStream

HEAD = b'{"node":"n1","columns":["a","b"],"limits":{"max_rows":1000}}\n'


def _read(body: bytes, cap: int = 1 << 20, pieces: int = 7, seed: int = 0) -> dict[str, Any]:
    """Feed ``body`` cut at random places, as the network would."""
    rng = random.Random(seed)
    if len(body) < 2:
        reader = QueryStream(cap)
        reader.feed(body)
        return reader.finish()
    cuts = sorted(rng.sample(range(1, len(body)), min(pieces, len(body) - 1)))
    reader = QueryStream(cap)
    for lo, hi in zip([0, *cuts], [*cuts, len(body)], strict=True):
        if not reader.feed(body[lo:hi]):
            break
    return reader.finish()


def _rows(n: int) -> bytes:
    return b"".join(orjson.dumps([i, f"s{i}"]) + b"\n" for i in range(n))


def _end(n: int, **kw: object) -> bytes:
    return orjson.dumps({"end": True, "rows": n, "truncated": False, **kw}) + b"\n"


@pytest.mark.parametrize("seed", range(5))
def test_a_stream_cut_anywhere_reads_as_the_answer(seed: int) -> None:
    got = _read(HEAD + _rows(300) + _end(300, elapsed_ms=1.5), seed=seed)
    assert got["columns"] == ["a", "b"] and got["node"] == "n1"
    assert got["rows"] == [[i, f"s{i}"] for i in range(300)]
    assert got["truncated"] is False and got["elapsed_ms"] == 1.5


def test_a_line_longer_than_any_piece_is_read_whole() -> None:
    long = b'["' + b"x" * 300_000 + b'", 1]\n'
    got = _read(HEAD + long + _end(1), pieces=200)
    assert len(got["rows"][0][0]) == 300_000


def test_more_rows_than_the_header_allows_are_cut_and_marked() -> None:
    head = b'{"node":"n1","columns":["a","b"],"limits":{"max_rows":10}}\n'
    got = _read(head + _rows(50) + _end(50))
    assert len(got["rows"]) == 10 and got["truncated"] is True
    assert got["truncated_reason"] == "rows"


@pytest.mark.parametrize(("body", "said"), [
    (HEAD + _rows(3), "without its trailer"),
    (b"", "no header"),
    (b'[1, 2]\n', "no header object first"),
    (HEAD + b'[1]\n' + _end(1), "not a list of 2 values"),
    (HEAD + b'[1, 1e999]\n' + _end(1), "not JSON"),
    (HEAD + b'[1, 18446744073709551615]\n' + _end(1), "SQLite cannot hold"),
    (HEAD + _rows(2) + _end(5), "counts 5 rows, after 2"),
    (HEAD + _rows(1) + _end(1) + _rows(1), "after the trailer"),
    (HEAD + b"\x1b[2J garbage\n", "not JSON"),
    (HEAD + b'{"error": {"code": "timeout", "message": "stopped\\u001b[2J"}}\n', "stopped?[2J"),
])
def test_broken_streams_fail_with_a_reason(body: bytes, said: str) -> None:
    with pytest.raises(NodeFailed) as err:
        _read(body)
    assert said in err.value.failure.message, err.value.failure.message
    assert "\x1b" not in err.value.failure.text()


def test_the_byte_cap_counts_bytes_as_they_arrive() -> None:
    reader = QueryStream(cap=10_000)
    reader.feed(HEAD)
    with pytest.raises(NodeFailed) as err:
        for _ in range(100):
            reader.feed(b"A" * 1000)  # one endless line: no newline ever
    assert err.value.failure.kind == "too_large"
