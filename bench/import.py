"""Import speed of a Kineto trace vs a bare orjson load plus executemany of the same rows.

The real rank-0 trace of tests/data/gpu (4,855 events) is replicated with shifted times
and correlation ids until it holds BENCH_EVENTS events (default 1,000,000), written as
one JSON file. Then, alternating, best of BENCH_ROUNDS runs each, into a fresh database:

- baseline: ``orjson.loads`` of the file and one ``executemany`` of every complete event
  as (ts, dur, pid, tid, name) into a plain table, in one transaction: the least any
  importer must do;
- import: ``fleetd import`` (fleetd.ingest): checks and converts every event, links
  kernels to their launch calls, names stored once, events, GPU rows and annotations
  written in one transaction.

Reported: the importer's events/s and ratio = baseline time / import time (targets:
events_per_s >= 200000, ratio >= 0.5).

Last line: BENCH import events_per_s=N ratio=R
"""

from __future__ import annotations

import gzip
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetd.ingest import import_traces  # noqa: E402

N = int(os.environ.get("BENCH_EVENTS", "1000000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
SOURCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpu" / "sampled_rank-0.json.gz"


def scaled_trace(path: Path, n: int) -> int:
    """Write the rank-0 trace repeated (times and correlations shifted) up to n events."""
    doc = orjson.loads(gzip.decompress(SOURCE.read_bytes()))
    one = [e for e in doc["traceEvents"] if e.get("ph") == "X" and isinstance(e.get("pid"), int)]
    span = max(e["ts"] + e["dur"] for e in one) - min(e["ts"] for e in one) + 1000
    out: list[Any] = [e for e in doc["traceEvents"] if e.get("ph") == "M"]
    copy = 0
    while len(out) < n:
        for e in one:
            c = dict(e, ts=e["ts"] + copy * span)
            args = e.get("args")
            if isinstance(args, dict) and "correlation" in args:
                c["args"] = dict(args, correlation=args["correlation"] + copy * 10_000_000)
            out.append(c)
            if len(out) >= n:
                break
        copy += 1
    doc["traceEvents"] = out
    path.write_bytes(orjson.dumps(doc))
    return len(out)


def baseline(src: Path, db: Path) -> None:
    doc = orjson.loads(src.read_bytes())
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("CREATE TABLE ev (ts REAL, dur REAL, pid, tid, name TEXT)")
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO ev VALUES (?, ?, ?, ?, ?)",
                     ((e["ts"], e["dur"], e["pid"], e["tid"], e["name"])
                      for e in doc["traceEvents"] if e.get("ph") == "X"))
    conn.execute("COMMIT")
    conn.close()


def timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fleetd-bench-import-") as d:
        tmp = Path(d)
        src = tmp / "rank0-scaled.json"
        n = scaled_trace(src, N)
        print(f"trace: {n:,} events, {src.stat().st_size / 1e6:.0f} MB")
        base_t, imp_t = [], []
        for i in range(ROUNDS):
            base_t.append(timed(baseline, src, tmp / f"base{i}.db"))
            imp_t.append(timed(import_traces, [src], tmp / f"imp{i}.db", None, "kineto"))
            print(f"round {i + 1}: baseline {base_t[-1]:.2f} s, import {imp_t[-1]:.2f} s")
        with sqlite3.connect(tmp / "imp0.db") as c:
            stored = sum(c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                         for t in ("event_data", "gpu_data", "annotation_data"))
        best_b, best_i = min(base_t), min(imp_t)
        print(f"stored {stored:,} rows; best: baseline {best_b:.2f} s "
              f"({n / best_b:,.0f} events/s), import {best_i:.2f} s ({n / best_i:,.0f} events/s)")
        print(f"BENCH import events_per_s={n / best_i:.0f} ratio={best_b / best_i:.2f}")


if __name__ == "__main__":
    main()
