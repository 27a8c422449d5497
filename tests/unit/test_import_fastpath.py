"""The fast paths of ``fleetd import`` give the database the plain paths give.

Kineto JSON is parsed in pieces (fleetd.ingest.kineto_text._pieces) unless its layout does not
allow it; the writer leaves ids to SQLite when no other node's rows lie above them, and
builds the ts_ns indexes after a bulk load into a new file. Each test here compares the
fast path with the plain one (a whole-document parse, ids given row by row) table by
table, or checks a refusal: a value beyond 64-bit integers is one error line, exit 2,
and nothing written, also beside a good file.
"""

from __future__ import annotations

import gc
import gzip
import hashlib
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from fleetd.cli.main import main
from fleetd.ingest import import_traces, kineto_text

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
RANK0 = DATA / "sampled_rank-0.json.gz"
RANK1 = DATA / "sampled_rank-1.json.gz"
NSYS = DATA / "perlmutter-cloverleaf-cuda.sqlite"
TABLES = ("event_data", "event_args", "gpu_data", "annotation_data", "gpu_names",
          "session_data", "process_data", "task_data")


def content(db: Path, node_seq: bool = False) -> dict[str, Any]:
    """Every row of the import tables, in id order; ids as seqs with node_seq."""
    c = sqlite3.connect(db)
    out: dict[str, Any] = {}
    for t in TABLES:
        cols = [r[1] for r in c.execute(f"PRAGMA table_info({t})")]
        rows = c.execute(f"SELECT * FROM {t} ORDER BY {', '.join(cols)}").fetchall()
        if node_seq and t in ("event_data", "event_args", "gpu_data", "annotation_data"):
            rows = sorted((r[0] & ((1 << 40) - 1), *r[1:]) for r in rows)
        out[t] = rows
    c.close()
    return out


def events(path: Path) -> dict[str, Any]:
    return dict(json.loads(gzip.decompress(path.read_bytes())))


def whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain path: the document parsed in one piece."""
    monkeypatch.setattr(kineto_text, "_split_document", lambda text, clock: None)


def test_pieces_give_the_whole_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fast, small = tmp_path / "fast.db", tmp_path / "small.db"
    import_traces([RANK0, RANK1], fast)
    pieces: list[int] = []
    real = kineto_text._pieces

    def counted(*args: Any) -> Any:
        for items in real(*args):
            pieces.append(len(items))
            yield items

    with monkeypatch.context() as m:
        m.setattr(kineto_text, "CHUNK_BYTES", 150)  # a piece per event or two
        m.setattr(kineto_text, "_pieces", counted)
        import_traces([RANK0, RANK1], small)
    assert len(pieces) > 4000 and sum(pieces) == sum(
        len(events(r)["traceEvents"]) for r in (RANK0, RANK1))
    whole(monkeypatch)
    plain = tmp_path / "plain.db"
    import_traces([RANK0, RANK1], plain)
    assert content(fast) == content(plain) == content(small)
    assert sum(len(v) for v in content(fast).values()) > 9000


def _tricky(tmp: Path, decoy: bool = False) -> Path:
    """Bytes that look like a boundary between events inside strings and nested objects,
    pretty-printed, fractional times, ']' after the array; with a decoy, the key named
    first inside a nested object (passed over: the text before it does not parse as the
    start of the top-level object, so the pieces start at the real array)."""
    doc = events(RANK0)
    evs = doc["traceEvents"][::7]
    for i, e in enumerate(evs):
        if i % 5 == 0:
            e["name"] = e.get("name", "") + '},{"ph": "X"}, {'
        if i % 9 == 0:
            e["args"] = dict(e.get("args") or {}, nested=[{"a": 1}, {"b": "},{"}], c=[])
        if i % 4 == 0 and isinstance(e.get("ts"), int):
            e["ts"] += 0.125
    body = ",\n".join("  " + json.dumps(e, indent=1) for e in evs)
    head = '"meta": {"traceEvents": [{"a": "]"}]}, ' if decoy else ""
    p = tmp / f"tricky{'-decoy' if decoy else ''}.json"
    p.write_text(f'{{"note": "\\"traceEvents\\": [", {head}\n'
                 f' "distributedInfo": {{"rank": 0}},\n "traceEvents": [\n{body}\n],\n'
                 ' "traceName": "x]y", "tail": [1, {"z": [2]}]}\n')
    return p


def _decoy(tmp: Path) -> Path:
    return _tricky(tmp, decoy=True)


def _duplicate_key(tmp: Path) -> Path:
    evs = events(RANK0)["traceEvents"][::11]
    p = tmp / "twice.json"
    p.write_text('{"traceEvents": [{"ph": "X", "cat": "cuda_runtime", "name": "first", '
                 '"pid": 1, "tid": 1, "ts": 1, "dur": 1}], "traceEvents": '
                 + json.dumps(evs) + "}")
    return p


def _bare_array(tmp: Path) -> Path:
    p = tmp / "bare.json"
    p.write_text("  [ " + ", ".join(json.dumps(e) for e in events(RANK1)["traceEvents"][::5])
                 + " ]\n")
    return p


@pytest.mark.parametrize(("make", "in_pieces"), [
    (_tricky, True), (_bare_array, True), (_decoy, True), (_duplicate_key, False)])
@pytest.mark.parametrize("chunk", [1, 64, 64 << 10])
def test_odd_layouts_give_the_whole_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          make: Any, in_pieces: bool, chunk: int) -> None:
    src = make(tmp_path)
    fast, plain = tmp_path / "fast.db", tmp_path / "plain.db"
    whole_parses: list[Path] = []
    real = kineto_text._load

    def load(source: Any, text: bytes) -> Any:
        whole_parses.append(source.path)
        return real(source, text)

    with monkeypatch.context() as m:
        m.setattr(kineto_text, "CHUNK_BYTES", chunk)
        m.setattr(kineto_text, "_load", load)
        import_traces([src], fast)
    assert whole_parses == ([] if in_pieces else [src])
    whole(monkeypatch)
    import_traces([src], plain)
    got = content(fast)
    assert got == content(plain)
    assert len(got["gpu_data"]) > 50 and len(got["annotation_data"]) > 100


def _session_rows(db: Path, node: str, sha: str) -> dict[str, list[Any]]:
    """One import's rows through the views, without ids: kernels with their launch call
    (wrong links show as other calls), annotations."""
    c = sqlite3.connect(db)
    session = c.execute("SELECT session FROM imports WHERE node = ? AND sha256 = ?",
                        (node, sha)).fetchone()[0]
    launches = c.execute(
        "SELECT l.kind, l.name, l.correlation, l.launch_op, l.launch_ts_ns, l.launch_dur_ns, "
        "l.tid, l.ts_ns, l.dur_ns, l.pid, l.device, l.stream FROM gpu_launches l "
        "JOIN gpu_activity a ON a.id = l.id WHERE a.node = ? AND a.session = ?",
        (node, session)).fetchall()
    notes = c.execute("SELECT ts_ns, dur_ns, pid, tid, kind, name FROM annotations "
                      "WHERE node = ? AND session = ?", (node, session)).fetchall()
    c.close()
    return {"launches": sorted(launches), "annotations": sorted(notes)}


def _seqs(db: Path, table: str, node: str) -> list[int]:
    c = sqlite3.connect(db)
    key = c.execute("SELECT id FROM nodes WHERE name = ?", (node,)).fetchone()[0]
    lo = key << 40
    got = [r[0] - lo for r in c.execute(
        f"SELECT id FROM {table} WHERE id BETWEEN ? AND ? ORDER BY id", (lo, lo + (1 << 40) - 1))]
    c.close()
    return got


def test_ids_below_another_nodes_rows_are_given_one_by_one(tmp_path: Path) -> None:
    """rank-1 imported under node a after node b (a larger node key) got rows: its ids
    cannot come from SQLite (the largest id is b's), so they are given row by row, and
    the rows read through the views as those of a fresh import."""
    alone, shared = tmp_path / "alone.db", tmp_path / "shared.db"
    import_traces([RANK1], alone, "a")
    import_traces([RANK0], shared, "a")
    import_traces([NSYS], shared, "b")
    c = sqlite3.connect(shared)
    top = {t: c.execute(f"SELECT max(id) >> 40 FROM {t}").fetchone()[0]
           for t in ("event_data", "gpu_data")}
    c.close()
    assert top == {"event_data": 2, "gpu_data": 2}  # node b's rows lie above node a's
    (report,) = import_traces([RANK1], shared, "a")
    assert report.outcome.added["gpu"] > 1000
    sha = hashlib.sha256(RANK1.read_bytes()).hexdigest()
    want, got = _session_rows(alone, "a", sha), _session_rows(shared, "a", sha)
    assert got == want and len(got["launches"]) > 1000
    for table in ("event_data", "gpu_data", "annotation_data"):
        seqs = _seqs(shared, table, "a")  # rank-0's then rank-1's, no gap, no overlap
        assert seqs == list(range(1, len(seqs) + 1))
        assert len(seqs) > len(_seqs(alone, table, "a"))


def test_a_new_file_gets_its_indexes_and_wal(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    reports = import_traces([RANK0, NSYS], db)
    c = sqlite3.connect(db)
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    indexes = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'index' "
                                       "AND name IN ('event_ts', 'gpu_ts', 'annotation_ts')")}
    assert indexes == {"event_ts", "gpu_ts", "annotation_ts"}
    assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    plan = " ".join(str(r) for r in c.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM gpu_data WHERE ts_ns > 5"))
    assert "gpu_ts" in plan
    for r in reports:
        assert set(r.timings) == {"parse", "convert", "insert", "index"}
        assert all(v >= 0 for v in r.timings.values())
    assert reports[0].timings["parse"] > 0 and reports[1].timings["index"] > 0
    assert gc.isenabled()


def _big_value(tmp: Path, where: str) -> Path:
    doc = events(RANK0)
    for e in doc["traceEvents"]:
        if where == "grid" and e.get("cat") == "kernel":
            e["args"]["grid"] = [2**64 - 1, 1, 1]
            break
        if where == "ts" and e.get("cat") == "cuda_runtime":
            e["ts"] = 1e300
            break
        if where == "pid" and e.get("cat") == "cpu_op":
            e["pid"] = 2**63
            break
    if where == "rank":
        doc["distributedInfo"]["rank"] = 2**64 - 1
    p = tmp / f"big-{where}.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.mark.parametrize("where", ["grid", "ts", "pid", "rank"])
def test_values_beyond_64_bits_are_refused_and_nothing_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    bad = _big_value(tmp_path, where)
    db = tmp_path / "out.db"
    for files in ([bad], [RANK1, bad]):
        assert main(["import", *map(str, files), "--db", str(db)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2 and "Traceback" not in lines[0], lines
        assert lines[0].startswith(f"fleetd: error: {bad}: holds a value")
        assert not db.exists()
    # an existing database keeps its rows (opening it may migrate its schema, as always)
    shutil.copy(DATA.parent / "scenarios" / "quiet.db", db)
    before = _rows(db)
    assert main(["import", str(RANK1), str(bad), "--db", str(db), "--node", "x"]) == 2
    assert _rows(db) == before and before["event_data"]
    assert gc.isenabled()


def _rows(db: Path) -> dict[str, Any]:
    """What a failed import must not change (the columns every schema version has)."""
    c = sqlite3.connect(db)
    got: dict[str, Any] = {t: sorted(c.execute(f"SELECT * FROM {t}").fetchall(), key=repr)
                           for t in ("event_data", "event_args", "gpu_data", "annotation_data")}
    got["nodes"] = c.execute("SELECT id, name FROM nodes ORDER BY id").fetchall()
    got["sessions"] = c.execute("SELECT node, seq, started_ns, targets FROM session_data "
                                "ORDER BY node, seq").fetchall()
    c.close()
    return got


@pytest.mark.parametrize(("text", "rc"), [
    ('{"traceEvents": []}', 0),
    ("[]", 0),
    ('{"traceEvents": [{"ph": "M"}], "baseTimeNanoseconds": 1}', 0),
    # only JSON's own whitespace may stand between two events (\\f is no JSON)
    ('{"traceEvents": [{"ph": "X"}\f, {"ph": "X"}]}', 2),
    ('\f{"traceEvents": []}', 2),
    ('{"traceEvents": [{"ph": "X"}, {"ph": "X"}]', 2),
])
def test_edges_of_the_split(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch, text: str, rc: int) -> None:
    monkeypatch.setattr(kineto_text, "CHUNK_BYTES", 1)
    src = tmp_path / "edge.json"
    src.write_text(text)
    db = tmp_path / "edge.db"
    assert main(["import", str(src), "--db", str(db)]) == rc
    err = capsys.readouterr().err
    if rc:
        assert "not valid JSON" in err and not db.exists()
    else:
        assert "GPU metrics are unavailable" in err
