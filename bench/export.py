"""Perfetto export speed vs a bare orjson dump of the same rows.

One node database of BENCH_EVENTS events (default 1,000,000: CUDA calls with launch
args, off-CPU intervals, block I/O, IRQs) is generated. Then, alternating, best of
BENCH_ROUNDS runs each, both reading the same rows with the same query from the same
file and writing a file in the same directory:

- baseline: each row as a JSON object (``orjson.dumps(dict(zip(columns, row)))``),
  one per line — what a naive export would write;
- export: ``fleetd.export`` — names, nesting lanes, args, counters, metadata.

Causal chains are left out (--chains none): computing them is analysis, not export.
Reported: ratio = baseline time / export time (target >= 0.5), the exporter's events/s,
and the trace size per million events (plain, and gzip from one extra .gz run).

Last line: BENCH export ratio=R events_per_s=N
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gendb import make_node_db  # noqa: E402

from fleetd.analyze.reading.window import resolve_window  # noqa: E402
from fleetd.export.local import _EVENTS_SQL, LocalOptions, local_traces  # noqa: E402
from fleetd.export.model import ROW_FIELDS  # noqa: E402
from fleetd.export.output import open_output  # noqa: E402
from fleetd.export.perfetto import write_trace  # noqa: E402
from fleetd.store.db import open_reader  # noqa: E402

N = int(os.environ.get("BENCH_EVENTS", "1000000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


def baseline(db: Path, out: Path) -> int:
    conn = open_reader(db)
    sql = _EVENTS_SQL + " ORDER BY e.ts_ns, e.id"
    params = [0, 2**62, 0, 2**62]
    n = 0
    with open(out, "wb") as f:
        buf: list[bytes] = []
        for row in conn.execute(sql, params):
            buf.append(orjson.dumps(dict(zip(ROW_FIELDS, row, strict=True))))
            if len(buf) >= 2048:
                f.write(b"\n".join(buf) + b"\n")
                n += len(buf)
                buf.clear()
        f.write(b"\n".join(buf) + b"\n")
        n += len(buf)
    conn.close()
    return n


def export(db: Path, out: Path) -> int:
    conn = open_reader(db)
    opts = LocalOptions(resolve_window(conn), chains="none")
    traces, origin, _ = local_traces(conn, opts)
    with open_output(out) as stream:
        stats = write_trace(traces, stream, origin_ns=origin)
    conn.close()
    return sum(s.events for s in stats)


def timed(fn: object, db: Path, out: Path) -> tuple[float, int]:
    assert callable(fn)
    t = time.perf_counter()
    n = fn(db, out)
    return time.perf_counter() - t, int(n)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fleetd-bench-export-") as d:
        tmp = Path(d)
        t = time.perf_counter()
        db = make_node_db(tmp / "node.db", "gpu-01", N)
        print(f"generated {N} events in {time.perf_counter() - t:.1f} s")
        with sqlite3.connect(db) as c:  # warm the page cache for both contenders alike
            c.execute("SELECT count(*), max(dur_ns) FROM event_data").fetchone()
        base_t, exp_t = [], []
        for r in range(ROUNDS):
            b, nb = timed(baseline, db, tmp / "rows.ndjson")
            e, ne = timed(export, db, tmp / "trace.json")
            assert nb == ne == N, (nb, ne)
            base_t.append(b)
            exp_t.append(e)
            print(f"round {r + 1}: baseline {b:.2f} s, export {e:.2f} s")
        size = (tmp / "trace.json").stat().st_size
        gz_t, _ = timed(export, db, tmp / "trace.json.gz")
        gz = (tmp / "trace.json.gz").stat().st_size
        best_b, best_e = min(base_t), min(exp_t)
        per_m = 1e6 / N
        print(f"best: baseline {best_b:.2f} s ({N / best_b:,.0f} rows/s), export {best_e:.2f} s "
              f"({N / best_e:,.0f} events/s)")
        print(f"trace size per million events: {size * per_m / 1e6:.0f} MB plain, "
              f"{gz * per_m / 1e6:.1f} MB gzip (gzip export took {gz_t:.1f} s); "
              f"bare rows {(tmp / 'rows.ndjson').stat().st_size * per_m / 1e6:.0f} MB")
        print(f"BENCH export ratio={best_b / best_e:.2f} events_per_s={N / best_e:.0f}")


if __name__ == "__main__":
    main()
