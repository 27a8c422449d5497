"""Import speed of a Kineto trace vs a bare orjson load plus executemany of the same rows.

The real rank-0 trace of tests/data/gpu (4,855 events) is replicated with shifted times
(whole microseconds, so the copies keep the source's integer timestamps) and correlation
ids until it holds BENCH_EVENTS events (default 1,000,000), written as one JSON file.
Then, alternating, best of BENCH_ROUNDS runs each (fewer when the 2-minute budget would
be exceeded), into a fresh database:

- baseline: ``orjson.loads`` of the file and one ``executemany`` of every complete event
  as (ts, dur, pid, tid, name) into a plain table, in one transaction: the least any
  importer must do;
- import: ``fleetd import`` (fleetd.ingest): checks and converts every event, links
  kernels to their launch calls, names stored once, events, GPU rows and annotations
  written in one transaction.

How fair the baseline is, both ways:

- It runs with Python's cyclic garbage collector paused, as fleetd's importer does (the
  collector walks the millions of parsed objects again and again while they are made and
  frees none of them: with it on, the same baseline takes about twice as long). An
  earlier version of this benchmark left it on, which made the ratio look better.
- It parses the whole document at once and inserts one row per statement; fleetd parses
  it in 64 KiB pieces, each turned into rows before the next (far less memory, fewer
  page faults), and inserts 64 rows per statement. Those are part of what is measured,
  not given to the baseline.
- It skips work fleetd must do: it writes 5 raw columns per event into one table with no
  index, while fleetd converts times to integer ns, writes 8-19 integer columns into
  three tables (events, GPU rows, annotations) with node-namespaced ids, builds a
  ``ts_ns`` index on each, interns names, links every kernel to its launch call and
  hashes the file (sha256, for "import twice adds nothing").

Memory: before the rounds, ``fleetd import`` of the same file runs in a process of its
own, and its peak resident set (``ru_maxrss`` from ``wait4``, interpreter included) is
reported per GB of trace: peak_mb_per_gb = peak MB / (file size in GB) (target <= 500).
The file is 1 GB-scale, not 1 GB (334 MB at the default 1M events, to keep the whole
benchmark under 2 minutes on 2 cores), and the figure is scaled linearly from it, which
overstates it: the importer streams the file, so its peak hardly grows with the size (a
1 GB trace of 3M events peaked at 125 MB, a 334 MB one at 120 MB). Whole-file parsing,
as fleetd did before, peaked at 740 MB for the 334 MB file (2,200 MB per GB).

Printed: each round's times, the per-stage breakdown of the best import (parse: reading
and JSON decoding; convert: checks, rows into the scratch file, the sort and the links;
insert: the rows read back in time order and into SQLite; index: the ts_ns indexes built
after the load; other: what is left, freeing and closing) and of the baseline. Reported:
the importer's events/s and ratio = baseline time / import time (targets: events_per_s
>= 200000, ratio >= 0.5), and peak_mb_per_gb.

Last line: BENCH import events_per_s=N ratio=R peak_mb_per_gb=P
"""

from __future__ import annotations

import gc
import gzip
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetd.ingest import import_traces  # noqa: E402

N = int(os.environ.get("BENCH_EVENTS", "1000000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
BUDGET_S = 110.0  # the whole benchmark stays under 2 minutes
SOURCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpu" / "sampled_rank-0.json.gz"
STAGES = ("parse", "convert", "insert", "index")


def scaled_trace(path: Path, n: int) -> int:
    """Write the rank-0 trace repeated (times and correlations shifted) up to n events,
    a copy at a time (the bytes orjson.dumps of the whole document would give)."""
    doc = orjson.loads(gzip.decompress(SOURCE.read_bytes()))
    one = [e for e in doc["traceEvents"] if e.get("ph") == "X" and isinstance(e.get("pid"), int)]
    # whole microseconds, so shifted times keep the source's type (integers in this file)
    span = math.ceil(max(e["ts"] + e["dur"] for e in one) - min(e["ts"] for e in one)) + 1000
    meta = [e for e in doc["traceEvents"] if e.get("ph") == "M"]
    head, tail = orjson.dumps(dict(doc, traceEvents=[0])).split(b"[0]")
    written = 0
    with path.open("wb") as f:
        f.write(head + b"[")
        for copy in range(n):
            batch: list[Any] = meta if copy == 0 else []
            for e in one[:max(0, min(len(one), n - written - len(batch)))]:
                c = dict(e, ts=e["ts"] + copy * span)
                args = e.get("args")
                if isinstance(args, dict) and "correlation" in args:
                    c["args"] = dict(args, correlation=args["correlation"] + copy * 10_000_000)
                batch.append(c)
            if not batch:
                break
            f.write((b"," if written else b"") + orjson.dumps(batch)[1:-1])
            written += len(batch)
        f.write(b"]" + tail)
    return written


_PEAK = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fleetd.ingest import import_traces
import_traces([Path(sys.argv[2])], Path(sys.argv[3]), None, "kineto")
"""


def peak_import(src: Path, db: Path) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of ``fleetd import`` of ``src`` in a process of its own."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _PEAK, str(Path(__file__).resolve().parents[1]),
                             str(src), str(db)])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"the measured import failed (exit {proc.returncode})")
    return usage.ru_maxrss / 1024, time.perf_counter() - t0


def baseline(src: Path, db: Path) -> dict[str, float]:
    """The bare import; returns its stages (the document is freed inside "insert")."""
    was = gc.isenabled()
    gc.disable()  # as fleetd does, see the module docstring
    try:
        t0 = time.perf_counter()
        doc = orjson.loads(src.read_bytes())
        t1 = time.perf_counter()
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("CREATE TABLE ev (ts REAL, dur REAL, pid, tid, name TEXT)")
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO ev VALUES (?, ?, ?, ?, ?)",
                         ((e["ts"], e["dur"], e["pid"], e["tid"], e["name"])
                          for e in doc["traceEvents"] if e.get("ph") == "X"))
        conn.execute("COMMIT")
        conn.close()
        del doc
        return {"parse": t1 - t0, "insert": time.perf_counter() - t1}
    finally:
        if was:
            gc.enable()


def fleetd_import(src: Path, db: Path) -> dict[str, float]:
    (report,) = import_traces([src], db, None, "kineto")
    return dict(report.timings)


def timed(fn: Any, *args: Any) -> tuple[float, dict[str, float]]:
    t0 = time.perf_counter()
    stages = fn(*args)
    return time.perf_counter() - t0, stages


def breakdown(label: str, total: float, stages: dict[str, float], n: int) -> str:
    parts = [f"{k} {v:.2f} s ({v / total:.0%}, {v / n * 1e6:.2f} us/event)"
             for k, v in stages.items()]
    other = total - sum(stages.values())
    parts.append(f"other {other:.2f} s ({other / total:.0%})")
    return f"{label} {total:.2f} s: " + ", ".join(parts)


def main() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fleetd-bench-import-") as d:
        tmp = Path(d)
        src = tmp / "rank0-scaled.json"
        n = scaled_trace(src, N)
        size = src.stat().st_size
        print(f"trace: {n:,} events, {size / 1e6:.0f} MB")
        peak_mb, peak_s = peak_import(src, tmp / "peak.db")
        peak_per_gb = peak_mb / (size / 1e9)
        print(f"memory: import in its own process peaked at {peak_mb:.0f} MB RSS in "
              f"{peak_s:.1f} s for {size / 1e6:.0f} MB of trace: {peak_per_gb:.0f} MB per GB "
              "(scaled linearly from this size)")
        (tmp / "peak.db").unlink()
        rounds_start = time.perf_counter()
        base: list[tuple[float, dict[str, float]]] = []
        imp: list[tuple[float, dict[str, float]]] = []
        for i in range(ROUNDS):
            base.append(timed(baseline, src, tmp / f"base{i}.db"))
            imp.append(timed(fleetd_import, src, tmp / f"imp{i}.db"))
            print(f"round {i + 1}: baseline {base[-1][0]:.2f} s, import {imp[-1][0]:.2f} s")
            per_round = (time.perf_counter() - rounds_start) / (i + 1)
            if time.perf_counter() - start + per_round > BUDGET_S:
                break
        with sqlite3.connect(tmp / "imp0.db") as c:
            stored = sum(c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                         for t in ("event_data", "gpu_data", "annotation_data"))
        best_b, best_i = min(base, key=lambda r: r[0]), min(imp, key=lambda r: r[0])
        print(breakdown("import", best_i[0], {k: best_i[1].get(k, 0.0) for k in STAGES}, n))
        print(breakdown("baseline", best_b[0], best_b[1], n))
        print(f"stored {stored:,} rows; best: baseline {best_b[0]:.2f} s "
              f"({n / best_b[0]:,.0f} events/s), import {best_i[0]:.2f} s "
              f"({n / best_i[0]:,.0f} events/s)")
        print(f"BENCH import events_per_s={n / best_i[0]:.0f} ratio={best_b[0] / best_i[0]:.2f} "
              f"peak_mb_per_gb={peak_per_gb:.0f}")


if __name__ == "__main__":
    main()
