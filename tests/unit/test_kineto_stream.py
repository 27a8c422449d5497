"""Kineto imports in bounded memory, and Kineto files of other PyTorch versions (issue 29
item 2, issue 28 item 3).

- A 1 GB plain Kineto-shaped trace imports in a process whose peak RSS stays far below
  the file's size (whole-file parsing needed more than twice the file: 740 MB for 334 MB).
- Compressed files that expand to gigabytes (whitespace, junk, empty objects) are refused
  in seconds and in bounded memory; plain whitespace is read in bounded memory too; one
  size limit holds for plain and gzipped text, and a memory ceiling gives one line.
- Mutated copies of the real rank-0 trace (bytes that are not UTF-8, no distributedInfo,
  fields as early PyTorch profilers named and typed them, the base time after the events,
  escaped lone surrogates, an unclosed bare array) import with warnings, with the kernel
  count and GPU idle of the original (where the data is the same: the same rows); a
  Chrome trace of another tool is refused with a hint that fits.
- Reading in pieces gives the database a whole parse gives, whatever the read size, the
  piece size, the flush size and the whitespace.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetd.cli.main import main
from fleetd.ingest import import_traces, kineto_events, kineto_stage, kineto_text, session

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "gpu"
RANK0 = DATA / "sampled_rank-0.json.gz"
TABLES = ("event_data", "event_args", "gpu_data", "annotation_data", "gpu_names",
          "process_data", "task_data")
BIG_MB = int(os.environ.get("FLEETD_BIG_TRACE_MB", "1000"))  # the bounded-memory test


def content(db: Path) -> dict[str, Any]:
    """The rows an import writes, without the session (source path, hash, node) and the
    processes' rank (a file without distributedInfo has none)."""
    c = sqlite3.connect(db)
    out = {}
    for t in TABLES:
        cols = [r[1] for r in c.execute(f"PRAGMA table_info({t})")
                if r[1] not in ("rank", "world_size")]
        out[t] = c.execute(f"SELECT {', '.join(cols)} FROM {t} ORDER BY "
                           f"{', '.join(cols)}").fetchall()
    c.close()
    return out


def doc0() -> dict[str, Any]:
    return dict(json.loads(gzip.decompress(RANK0.read_bytes())))


# The child reports its own high-water mark (VmHWM of the memory it got at exec): the
# rusage a parent sees also counts the parent's memory the child had before exec (Linux
# keeps maxrss across execve), which in a long test run is the test runner's, not ours.
_PEAK = """
import atexit, sys
from pathlib import Path
out = sys.argv.pop(1)
def peak():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            Path(out).write_text(line.split()[1])
atexit.register(peak)
from fleetd.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def measure(argv: list[str], timeout: float = 300) -> tuple[int, str, float, float]:
    """(exit code, stderr, seconds, peak RSS in MB) of ``fleetd argv`` in a process of
    its own, its peak as that process measured it."""
    with tempfile.TemporaryDirectory() as tmp:
        err_path, peak_path = Path(tmp) / "err", Path(tmp) / "peak"
        with err_path.open("wb") as err:
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _PEAK, str(peak_path), *argv],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                  timeout=timeout)
            seconds = time.perf_counter() - t0
        text = err_path.read_text(errors="replace")
        assert peak_path.exists(), f"the child did not report its peak: {text[-2000:]}"
        peak_kb = int(peak_path.read_text())
    return proc.returncode, text, seconds, peak_kb / 1024


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


def gpu_figures(db: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, float]:
    assert main(["gpu", "--db", str(db), "--format", "json"]) == 0
    (rank,) = orjson.loads(capsys.readouterr().out)["ranks"]
    return int(rank["kernels"]), float(rank["idle_pct"])


# ---- a large plain trace, in bounded memory --------------------------------------------


def write_big(path: Path, size: int) -> dict[str, int]:
    """The rank-0 trace repeated (times and correlations shifted) to ``size`` bytes of
    plain JSON, a copy at a time (the dicts of one copy changed in place); the counts
    of each category written."""
    doc = doc0()
    events = doc.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    one = [e for e in events if e.get("ph") == "X" and isinstance(e.get("pid"), int)]
    ts0 = [e["ts"] for e in one]
    args = [(e["args"], e["args"]["correlation"]) for e in one
            if isinstance(e.get("args"), dict) and "correlation" in e["args"]]
    span = math.ceil(max(e["ts"] + e["dur"] for e in one) - min(ts0)) + 1000
    per = {c: sum(1 for e in one if e.get("cat") == c) for c in (
        "kernel", "cuda_runtime", "gpu_memcpy", "gpu_memset", "cpu_op", "user_annotation")}
    head = orjson.dumps(doc)[:-1] + b', "traceEvents": ['
    copies = 0
    with path.open("wb") as f:
        f.write(head + orjson.dumps(meta)[1:-1])
        written = len(head)
        while written < size:
            for e, t in zip(one, ts0, strict=True):
                e["ts"] = t + copies * span
            for a, corr in args:
                a["correlation"] = corr + copies * 10_000_000
            blob = b",\n" + orjson.dumps(one)[1:-1]
            f.write(blob)
            written += len(blob)
            copies += 1
        f.write(b"]}\n")
    return {k: v * copies for k, v in per.items()}


def test_a_1gb_plain_trace_imports_in_bounded_memory(tmp_path: Path) -> None:
    src, db = tmp_path / "big.json", tmp_path / "big.db"
    counts = write_big(src, BIG_MB * 1_000_000)
    size_mb = src.stat().st_size / 1e6
    rc, err, seconds, peak = measure(["import", str(src), "--db", str(db)], timeout=600)
    assert rc == 0, err
    print(f"{size_mb:.0f} MB plain trace: imported in {seconds:.1f} s, peak RSS {peak:.0f} MB")
    # whole-file parsing holds the text and more than as much again in objects: a bound
    # below half the file's size fails it; the streamed import peaks near 125 MB
    assert peak < min(400, size_mb / 2), peak
    src.unlink()
    c = sqlite3.connect(db)
    got = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
           for t in ("event_data", "gpu_data", "annotation_data")}
    c.close()
    assert got == {"event_data": counts["cuda_runtime"],
                   "gpu_data": counts["kernel"] + counts["gpu_memcpy"] + counts["gpu_memset"],
                   "annotation_data": counts["cpu_op"] + counts["user_annotation"]}


# ---- files that expand: refused fast, in bounded memory -------------------------------


def gzip_bomb(path: Path, head: bytes, unit: bytes, tail: bytes, total: int = 2 << 30) -> Path:
    """``head``, ``unit`` repeated to ``total`` bytes, ``tail``, gzipped in about 2 MB: a
    gzip member of 1 MiB of units written again and again (gzip files may hold many
    members), so making it takes no time."""
    member = gzip.compress(unit * ((1 << 20) // len(unit)), 9)
    with path.open("wb") as f:
        f.write(gzip.compress(head))
        for _ in range(total >> 20):
            f.write(member)
        f.write(gzip.compress(tail))
    return path


@pytest.mark.parametrize(("name", "head", "unit", "says"), [
    ("whitespace", b'{"traceEvents": [', b" ", "expands more than 100x"),
    ("newlines", b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, '
     b'"dur": 1}', b"\n\t", "expands more than 100x"),
    ("junk", b'{"traceEvents": [', b"junk", "not valid JSON in traceEvents"),
    ("empty-objects", b'{"traceEvents": [', b"{},", "expands more than 100x"),
    ("before-the-document", b"", b" ", "expands more than 100x"),
])
def test_a_small_gzip_that_expands_to_2gib_is_refused_fast_and_bounded(
        tmp_path: Path, name: str, head: bytes, unit: bytes, says: str) -> None:
    bomb = gzip_bomb(tmp_path / f"{name}.json.gz", head, unit, b"{}]}")
    assert bomb.stat().st_size < 3 << 20
    db = tmp_path / "out.db"
    rc, err, seconds, peak = measure(["-q", "import", str(bomb), "--db", str(db), "--format",
                                      "kineto"])  # -q: no progress line before the error
    lines = err.strip().splitlines()
    assert rc == 2 and says in lines[0] and len(lines) == 2, err
    assert "Traceback" not in err and not db.exists()
    # before: 6,341 MB and 140 s for 2 GiB; now it stops after 32 MiB of text
    assert seconds < 20 and peak < 300, (seconds, peak)


def test_a_plain_file_of_whitespace_is_read_in_bounded_memory(tmp_path: Path) -> None:
    src = tmp_path / "spaces.json"
    with src.open("wb") as f:
        f.write(b" " * (1 << 20) + b'{"traceEvents": [')
        block = b" \n" * (1 << 19)
        for _ in range(256):  # 256 MiB of whitespace (1 GB took 3.1 GB and 67 s before)
            f.write(block)
        f.write(b"]}")
    rc, err, seconds, peak = measure(["import", str(src), "--db", str(tmp_path / "o.db"),
                                      "--format", "kineto"])
    assert rc == 0 and "no GPU events" in err, err
    assert peak < 150, peak


def test_one_size_limit_for_plain_and_gzipped_text(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    plain = tmp_path / "rank0.json"
    plain.write_bytes(gzip.decompress(RANK0.read_bytes()))
    monkeypatch.setattr(session, "MAX_JSON_BYTES", 1 << 20)
    for src in (plain, RANK0):
        rc, err = run(["import", str(src), "--db", str(tmp_path / "o.db")], capsys)
        assert rc == 2 and f"more than {1 << 20} bytes" in err, err
        assert not (tmp_path / "o.db").exists()


def test_the_memory_ceiling_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kineto_stage, "MAX_RSS_BYTES", 1 << 20)
    monkeypatch.setattr(kineto_events, "_RSS_EVERY", 1)
    rc, err = run(["import", str(RANK0), "--db", str(tmp_path / "o.db")], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2, err
    assert "would take more than 1 MiB of memory" in lines[0]
    assert not (tmp_path / "o.db").exists()


def test_several_gzip_members_and_corrupt_data(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    text = gzip.decompress(RANK0.read_bytes())
    parts = tmp_path / "members.json.gz"
    third = len(text) // 3
    parts.write_bytes(b"".join(gzip.compress(text[i:i + third])
                               for i in range(0, len(text), third)))
    one, many = tmp_path / "one.db", tmp_path / "many.db"
    import_traces([RANK0], one)
    import_traces([parts], many)
    assert content(one) == content(many)
    bad = tmp_path / "corrupt.json.gz"
    raw = bytearray(RANK0.read_bytes())
    raw[5000:5010] = b"\xff" * 10
    bad.write_bytes(bytes(raw))
    rc, err = run(["import", str(bad), "--db", str(tmp_path / "x.db")], capsys)
    assert rc == 2 and "corrupt gzip data" in err.splitlines()[0], err


# ---- files of other PyTorch versions ----------------------------------------------------


def _bad_utf8(tmp: Path) -> tuple[Path, int]:
    """Kernel, op and process names with bytes that are not UTF-8 (3 sequences each)."""
    doc = doc0()
    hit = 0
    for i, e in enumerate(doc["traceEvents"]):
        if i % 40 == 0 and e.get("cat") in ("kernel", "cpu_op"):
            e["name"] += "@BAD@"
            hit += 1
        if e.get("ph") == "M" and e.get("name") == "process_name":
            e["args"]["name"] += "@BAD@"
            hit += 1
    doc["traceName"] = "/tmp/@BAD@/trace.json"
    raw = orjson.dumps(doc).replace(b"@BAD@", b"\xff\xfe\x80")
    p = tmp / "bad-utf8.json"
    p.write_bytes(raw)
    return p, 3 * (hit + 1)


def _no_distributed_info(tmp: Path) -> Path:
    doc = doc0()
    del doc["distributedInfo"]
    p = tmp / "nodist.json.gz"
    p.write_bytes(gzip.compress(orjson.dumps(doc)))
    return p


_EARLY_CATS = {"kernel": "Kernel", "cuda_runtime": "Runtime", "gpu_memcpy": "Memcpy",
               "gpu_memset": "Memset", "cpu_op": "Operator"}


def _early_names(tmp: Path) -> Path:
    """As early PyTorch profilers (Kineto of PyTorch 1.8) named and typed the fields:
    capitalized categories, tids (and pids) as decimal strings, a GPU row's stream only
    in its tid ("stream 7"), a copy's device as inDevice, "external id"; the rank as a
    string; the base time written after the events, times relative to it."""
    doc = doc0()
    t0 = min(e["ts"] for e in doc["traceEvents"] if isinstance(e.get("ts"), int)) - 10
    for e in doc["traceEvents"]:
        cat = e.get("cat")
        if isinstance(e.get("ts"), int):
            e["ts"] -= t0
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        if "External id" in args:
            args["external id"] = args.pop("External id")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            e["tid"] = f"stream {args.pop('stream')}"
            if cat == "gpu_memcpy":
                args["inDevice"] = args.pop("device")
        elif isinstance(e.get("tid"), int):
            e["tid"] = str(e["tid"])
            e["pid"] = str(e["pid"])
        if cat in _EARLY_CATS:
            e["cat"] = _EARLY_CATS[cat]
    doc["distributedInfo"]["rank"] = "0"
    events = doc.pop("traceEvents")
    doc["traceEvents"] = events
    doc["baseTimeNanoseconds"] = t0 * 1000
    p = tmp / "early.json"
    p.write_text(json.dumps(doc, indent=1))
    return p


def _lone_surrogates(tmp: Path) -> Path:
    """Names with an escaped lone surrogate, as Python's json writes a str that held
    bytes it could not decode."""
    doc = doc0()
    n = 0
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and n < 5:
            e["name"] += "\udcff"
            n += 1
    p = tmp / "surrogates.json"
    p.write_text(json.dumps(doc))
    return p


def _unclosed(tmp: Path) -> Path:
    """The bare-array form without its closing ']', as early Kineto wrote it."""
    doc = doc0()
    p = tmp / "unclosed.json"
    p.write_text("[\n" + "".join(json.dumps(e) + ",\n" for e in doc["traceEvents"]))
    return p


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("orig") / "orig.db"
    import_traces([RANK0], db)
    return db


@pytest.mark.parametrize(("make", "warns", "same_rows"), [
    (_bad_utf8, "not UTF-8 read as U+FFFD", False),
    (_no_distributed_info, "no distributedInfo", True),
    (_early_names, None, True),
    (_lone_surrogates, "lone surrogate", False),
    (_unclosed, "without the closing ']'", True),
])
def test_other_versions_import_with_the_figures_of_the_original(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], original: Path, make: Any,
        warns: str | None, same_rows: bool) -> None:
    made = make(tmp_path)
    src, sequences = made if isinstance(made, tuple) else (made, 0)
    db = tmp_path / "mutated.db"
    rc, err = run(["import", str(src), "--db", str(db)], capsys)
    assert rc == 0, err
    assert "Traceback" not in err and "malformed" not in err
    if warns:
        assert warns in err, err
    if sequences:
        assert f"{sequences} byte sequence(s) that are not UTF-8" in err, err
    assert gpu_figures(db, capsys) == gpu_figures(original, capsys)
    got, want = content(db), content(original)
    if same_rows:  # the same rows, to the process and thread names
        assert got == want
    else:  # names differ where the bytes did: the rows, names aside
        for t in ("event_data", "gpu_data", "annotation_data"):
            assert len(got[t]) == len(want[t]) > 1000
        names = [n for _, n in got["gpu_names"]]
        assert all(n.isprintable() for n in names)  # no surrogate is stored
        assert any("\ufffd" in n for n in names) or any(n.endswith("?") for n in names)


def test_all_of_it_at_once_gzipped(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   original: Path) -> None:
    text = _early_names(tmp_path).read_bytes()
    doc = json.loads(text)
    del doc["distributedInfo"]
    raw = json.dumps(doc, indent=1).replace("Memcpy DtoH", "Memcpy @BAD@").encode()
    src = tmp_path / "everything.json.gz"
    src.write_bytes(gzip.compress(raw.replace(b"@BAD@", b"\xc3\x28")))
    db = tmp_path / "all.db"
    rc, err = run(["import", str(src), "--db", str(db)], capsys)
    assert rc == 0 and "not UTF-8" in err and "no distributedInfo" in err, err
    assert gpu_figures(db, capsys) == gpu_figures(original, capsys)


def _other_tool(tmp: Path) -> Path:
    p = tmp / "chrome.json"
    p.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "gpu", "name": "k", "ts": 1, "dur": 2, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "annotation", "name": "a", "ts": 1, "dur": 2, "pid": 1, "tid": 1}],
        "displayTimeUnit": "ms"}))
    return p


def _legacy_autograd(tmp: Path) -> Path:
    """The pre-Kineto autograd profiler: a bare array, no categories, string pids."""
    p = tmp / "autograd.json"
    p.write_text(json.dumps([{"name": "aten::mm", "ph": "X", "ts": 10, "dur": 5, "tid": 1,
                              "pid": "CPU functions", "args": {}}]))
    return p


@pytest.mark.parametrize(("make", "says", "hint"), [
    (_other_tool, "not one the PyTorch profiler wrote", "torch.profiler"),
    (_legacy_autograd, "not one the PyTorch profiler wrote", "torch.profiler"),
])
def test_a_chrome_trace_of_another_tool_is_refused_with_a_fitting_hint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, says: str,
        hint: str) -> None:
    db = tmp_path / "o.db"
    rc, err = run(["import", str(make(tmp_path)), "--db", str(db)], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2, err
    assert says in lines[0] and hint in lines[1]
    assert not db.exists()


# ---- pieces, reads and flushes of any size give the rows of a whole parse ----------------


def _spaced(tmp: Path) -> Path:
    """Long whitespace runs before the document, at the array's start, between events,
    before the ']' and after the document (squeezed to one newline each)."""
    doc = doc0()
    evs = doc.pop("traceEvents")[::3]
    pad = " \n" * 6000
    body = f",{pad}".join(json.dumps(e) for e in evs[:200]) + ", " + ", ".join(
        json.dumps(e) for e in evs[200:])
    head = json.dumps(doc)[:-1]
    p = tmp / "spaced.json"
    p.write_text(f"{pad}{head}, {pad}\"traceEvents\"{pad}:{pad}[{pad}{body}{pad}]{pad}}}{pad}")
    return p


def _base_after(tmp: Path) -> Path:
    return _early_names(tmp)


@pytest.mark.parametrize("make", [_spaced, _base_after, _unclosed])
@pytest.mark.parametrize(("read", "chunk", "flush"), [(997, 150, 5), (1 << 20, 64 << 10, 16384),
                                                      (65536, 1, 1)])
def test_any_read_piece_and_flush_size_gives_the_whole_parse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Any, read: int, chunk: int,
        flush: int) -> None:
    src = make(tmp_path)
    streamed, whole = tmp_path / "streamed.db", tmp_path / "whole.db"
    with monkeypatch.context() as m:
        m.setattr(session, "READ_BYTES", read)
        m.setattr(kineto_text, "CHUNK_BYTES", chunk)
        m.setattr(kineto_events, "FLUSH_ROWS", flush)
        m.setattr(kineto_text, "SQUEEZE_AT", 4096)
        m.setattr(kineto_text, "_split_document",
                  _fail_if_called(kineto_text._split_document, False))
        m.setattr(kineto_text, "whole", _fail_if_called(kineto_text.whole, True))
        import_traces([src], streamed, None, "kineto")
    if make is _unclosed:  # a whole parse needs the ']'
        src = tmp_path / "closed.json"
        src.write_text(_unclosed(tmp_path).read_text().rstrip(",\n") + "]")
    monkeypatch.setattr(kineto_text, "_split_document", lambda text, clock: None)
    import_traces([src], whole, None, "kineto")
    got = content(streamed)
    assert got == content(whole) and len(got["gpu_data"]) > 300


def _fail_if_called(fn: Any, fail: bool) -> Any:
    def wrapped(*args: Any) -> Any:
        assert not fail, f"{fn.__name__} was called: the file was not streamed"
        return fn(*args)
    return wrapped
