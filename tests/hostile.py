"""Hostile SQL, shared by the store's guard tests and the node API's tests."""

from __future__ import annotations

import orjson

RUNAWAY_CTE = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
)

# (statement, the error code it must get). Each is refused or stopped with a message.
HOSTILE: list[tuple[str, str]] = [
    ("DELETE FROM event_data", "forbidden"),
    ("DELETE FROM events", "forbidden"),
    ("INSERT INTO nodes(name, uid, created_ns) VALUES ('x', 'y', 1)", "forbidden"),
    ("REPLACE INTO meta VALUES ('a', 'b')", "forbidden"),
    ("UPDATE nodes SET name = 'evil'", "forbidden"),
    ("DROP TABLE event_data", "forbidden"),
    ("DROP VIEW events", "forbidden"),
    ("CREATE TABLE evil(x)", "forbidden"),
    ("CREATE TEMP TABLE evil(x)", "forbidden"),
    ("CREATE TEMP VIEW v AS SELECT 1", "forbidden"),
    ("CREATE INDEX evil ON event_data(pid)", "forbidden"),
    ("CREATE TRIGGER t AFTER INSERT ON meta BEGIN DELETE FROM meta; END", "forbidden"),
    ("CREATE VIRTUAL TABLE v USING fts5(a)", "forbidden"),
    ("ALTER TABLE nodes ADD COLUMN evil TEXT", "forbidden"),
    ("ATTACH DATABASE '/tmp/fleetd-evil.db' AS evil", "forbidden"),
    ("DETACH DATABASE main", "forbidden"),
    ("PRAGMA journal_mode = DELETE", "forbidden"),
    ("PRAGMA user_version = 99", "forbidden"),
    ("PRAGMA writable_schema = ON", "forbidden"),
    ("PRAGMA query_only = 0", "forbidden"),
    ("PRAGMA wal_checkpoint(TRUNCATE)", "forbidden"),
    ("SELECT load_extension('/tmp/evil.so')", "forbidden"),
    ("SELECT fts3_tokenizer('simple')", "forbidden"),
    ("SELECT 1; DELETE FROM event_data", "forbidden"),
    ("SELECT 1; SELECT 2", "forbidden"),
    ("WITH x AS (SELECT 1) DELETE FROM meta", "forbidden"),
    ("BEGIN IMMEDIATE", "forbidden"),
    ("COMMIT", "forbidden"),
    ("SAVEPOINT s1", "forbidden"),
    ("VACUUM", "forbidden"),
    ("VACUUM INTO '/tmp/fleetd-evil-copy.db'", "forbidden"),
    ("REINDEX", "forbidden"),
    ("ANALYZE", "forbidden"),
    (RUNAWAY_CTE, "timeout"),
    ("SELECT count(*) FROM event_data a, event_data b, event_data c, event_data d", "timeout"),
    ("SELECT randomblob(1000000000)", "too_large"),
    ("SELECT zeroblob(2000000000)", "too_large"),
    ("SELECT replace(hex(zeroblob(3000000)), '0', '00')", "too_large"),
    ("SELECT group_concat(hex(randomblob(1000))) FROM (WITH RECURSIVE c(x) AS (SELECT 1 "
     "UNION ALL SELECT x + 1 FROM c WHERE x < 8000) SELECT x FROM c)", "too_large"),
    ("SELECT writefile('/tmp/fleetd-evil.txt', 'x')", "bad_query"),
    ("SELEC * FROM events", "bad_query"),
    ("", "bad_query"),
    ("-- only a comment", "bad_query"),
    ("SELECT 1" + " " * 70_000, "too_large"),
]

_STATUS = {"forbidden": 403, "timeout": 408, "too_large": 413, "bad_query": 400}


def _body(sql: str) -> bytes:
    return orjson.dumps({"sql": sql, "timeout_s": 1})


# (raw request body, HTTP status, error code): the SQL table, then malformed requests.
HOSTILE_OVER_HTTP: list[tuple[bytes, int, str]] = [
    (_body(sql), _STATUS[code], code) for sql, code in HOSTILE
] + [
    (b"x" * (200 * 1024), 413, "too_large"),
    (orjson.dumps({"sql": "SELECT 1", "params": ["x" * 100_000]}), 413, "too_large"),
    (b"{not json", 400, "bad_request"),
    (b"[1, 2, 3]", 400, "bad_request"),
    (b"{}", 400, "bad_request"),
    (orjson.dumps({"sql": 42}), 400, "bad_request"),
    (orjson.dumps({"sql": "SELECT 1", "params": "oops"}), 400, "bad_request"),
    (orjson.dumps({"sql": "SELECT 1", "max_rows": -5}), 400, "bad_request"),
    (orjson.dumps({"sql": "SELECT 1", "timeout_s": "forever"}), 400, "bad_request"),
    (orjson.dumps({"sql": "SELECT 1", "drop_table": True}), 400, "bad_request"),
    (orjson.dumps({"sql": "SELECT ?, ?", "params": [1]}), 400, "bad_query"),
]
