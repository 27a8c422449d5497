"""fleetd merge vs a plain SQLite ATTACH + INSERT INTO ... SELECT of the same rows.

Three node databases of BENCH_EVENTS events each (default 1,000,000; with launch args,
stacks, histograms, sessions) are generated, then merged into a fresh file twice by
each contender, alternating, each run in a child process of its own:

- baseline: for each input, ATTACH it and copy every table with one INSERT ... SELECT
  (node keys rewritten in the SELECT), one transaction per input, with the same
  pragmas the merge uses for its output;
- merge: ``fleetd.store.merge.merge`` — identity checks, clock checks, batched copy,
  stack dedup, fsync and atomic rename included.

The best time of each is compared (ratio = baseline / merge: 1.0 means as fast as the
plain copy). Peak memory is the merge child's peak resident set size (ru_maxrss from
wait4: Python, SQLite's page cache and everything else in that process).

Last line: BENCH merge ratio=R peak_mb=M   (target R >= 0.7)
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gendb import make_node_db  # noqa: E402

from fleetd.store.db import open_writer  # noqa: E402
from fleetd.store.merge import _TEMP_PRAGMAS, merge  # noqa: E402
from fleetd.store.schema import SEQ_BITS, SEQ_MASK  # noqa: E402

N = int(os.environ.get("BENCH_EVENTS", "1000000"))
NODES = 3
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
COUNTED = ("event_data", "event_args", "stacks", "aggregate_data", "session_data",
           "process_data", "task_data", "nodes")


def baseline(inputs: list[Path], out: Path) -> None:
    open_writer(out).close()
    conn = sqlite3.connect(f"file:{out}", uri=True, isolation_level=None)
    for pragma in _TEMP_PRAGMAS:
        conn.execute(pragma)
    for key, path in enumerate(inputs, 1):
        conn.execute("ATTACH DATABASE ? AS src", (f"file:{path}?mode=ro",))
        hi = key << SEQ_BITS
        conn.execute("BEGIN")
        conn.execute(f"INSERT INTO nodes SELECT {key}, name, uid, machine_id, host, created_ns "
                     "FROM src.nodes")
        conn.execute(f"INSERT INTO event_data SELECT (id & {SEQ_MASK}) | {hi}, ts_ns, dur_ns, "
                     "pid, tid, op, ret, bytes, peer, a0, a1, stack FROM src.event_data")
        conn.execute(f"INSERT INTO event_args SELECT (id & {SEQ_MASK}) | {hi}, args "
                     "FROM src.event_args")
        conn.execute("INSERT OR IGNORE INTO stacks SELECT hash, frames FROM src.stacks")
        for table in ("aggregate_data", "session_data", "process_data", "task_data",
                      "chain_data"):
            cols = [r[1] for r in conn.execute(f"PRAGMA main.table_info({table})")][1:]
            conn.execute(f"INSERT INTO {table} SELECT {key}, {', '.join(cols)} "
                         f"FROM src.{table}")
        conn.execute("COMMIT")
        conn.execute("DETACH DATABASE src")
    conn.close()


def child(kind: str, out: Path, inputs: list[Path]) -> None:
    t = time.perf_counter()
    if kind == "merge":
        merge(inputs, out)
    else:
        baseline(inputs, out)
    print(time.perf_counter() - t)


def run_child(kind: str, out: Path, inputs: list[Path]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one run in a fresh process."""
    for p in out.parent.glob(out.name + "*"):
        p.unlink()
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, str(out),
                             *map(str, inputs)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    text = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} child failed with {proc.returncode}")
    return float(text.strip()), usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def counts(path: Path) -> dict[str, int]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in COUNTED}
    finally:
        conn.close()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fleetd-bench-merge-") as d:
        tmp = Path(d)
        t = time.perf_counter()
        inputs = [make_node_db(tmp / f"node-{i:02d}.db", f"gpu-{i:02d}", N, rank=i)
                  for i in range(NODES)]
        print(f"generated {NODES} x {N} events in {time.perf_counter() - t:.1f} s "
              f"({sum(p.stat().st_size for p in inputs) / 1e6:.0f} MB)")
        base_t: list[float] = []
        merge_t: list[float] = []
        peak = 0.0
        for r in range(ROUNDS):
            b, _ = run_child("baseline", tmp / "baseline.db", inputs)
            m, rss = run_child("merge", tmp / "merged.db", inputs)
            base_t.append(b)
            merge_t.append(m)
            peak = max(peak, rss)
            print(f"round {r + 1}: baseline {b:.2f} s, merge {m:.2f} s, merge peak {rss:.0f} MB")
        same = counts(tmp / "baseline.db") == counts(tmp / "merged.db")
        print(f"rows: {counts(tmp / 'merged.db')} (same as baseline: {same})")
        if not same:
            raise SystemExit("the merge and the baseline copied different rows")
        rows = NODES * N
        best_b, best_m = min(base_t), min(merge_t)
        print(f"best: baseline {best_b:.2f} s ({rows / best_b:,.0f} events/s), "
              f"merge {best_m:.2f} s ({rows / best_m:,.0f} events/s)")
        print(f"BENCH merge ratio={best_b / best_m:.2f} peak_mb={peak:.0f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), [Path(p) for p in sys.argv[4:]])
    else:
        main()
