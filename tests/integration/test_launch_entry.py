"""Entry-only launches (#36): a loop of launches with known failures mixed in, traced by
the real tracer (real BPF, the real CUDA runtime) with and without launch return probes.

What this machine can tell apart: without a GPU the runtime fails EVERY launch with the
same code (35, cudaErrorInsufficientDriver) before it looks at the configuration, so the
loop's invalid launches (a zero-size grid, cudaErrorInvalidConfiguration on a GPU) fail
exactly like the valid ones (checked below). So the failures are a streak of one code,
and the test checks what entry-only tracing promises for a streak:

- every launch is counted (the histogram's count is the loop's, exactly), and only the
  sampled ones are timed (the untimed count, aggregate bucket -3, is the rest);
- every stored launch record comes from a return probe: a measured duration (> 0) and
  the runtime's own return code, never a fake 0;
- the failures are recorded as the error budget allows (FL_ERR_BURST = 10 records per
  process, op and second, as with every return probed), not only the 1-in-N sample:
  after the first sampled failure the next returns are taken;
- with --sample 1 every launch is timed, so every failure is counted, as it is with
  --launch-returns.

What entry-only misses (and this test cannot show here): a failure before the first
sampled one of its streak, and an isolated failure among successes unless sampled.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from recorder import running
from test_trace import _bpf_ready  # the same requirements as the tracer's own tests
from workload_run import trace_in_process

from fleetd.store.catalog import BY_NAME

from conftest import REPO

_WHY = _bpf_ready()
pytestmark = [pytest.mark.bpf, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

LAUNCH = BY_NAME["cudaLaunchKernel"].code
ERR_BURST = 10  # TraceConfig.err_burst: error records per (process, op) per second
BATCHES, PER_BATCH, EVERY = 30, 100, 7  # 3,000 launches over ~1.5 s, 1 in 7 invalid

# Loads libcudart, waits for the go file, then launches in batches (a zero-size grid
# every EVERY-th launch), a stream sync after each batch, 50 ms apart; prints what it
# made and what each kind of launch returned.
LOOP = r"""
import json, os, sys, time
from collections import Counter
sys.path.insert(0, sys.argv[1])
from train_loop import Config, Dim3, Workload
w = Workload(Config(steps=1))
go, batches, per, every = sys.argv[2], *map(int, sys.argv[3:6])
while not os.path.exists(go):
    time.sleep(0.01)
fn, func = w.rt.cudaLaunchKernel, w._func
ok, bad = (Dim3(1, 1, 1), Dim3(1, 1, 1)), (Dim3(0, 1, 1), Dim3(1, 1, 1))
rets = {"valid": Counter(), "zero_grid": Counter()}
n = 0
for _ in range(batches):
    for _ in range(per):
        kind = "zero_grid" if n % every == 0 else "valid"
        g, b = bad if kind == "zero_grid" else ok
        rets[kind][fn(func, g, b, None, 0, None)] += 1
        n += 1
    w.rt.cudaStreamSynchronize(None)
    time.sleep(0.05)
print(json.dumps({"launches": n, "returns": {k: dict(v) for k, v in rets.items()}}))
"""


def _run(tmp: Path, name: str, **cfg: Any) -> tuple[dict[str, Any], Any, Path]:
    go, db = tmp / f"{name}.go", tmp / f"{name}.db"
    with running([sys.executable, "-c", LOOP, str(REPO / "tests" / "workloads"), str(go),
                  str(BATCHES), str(PER_BATCH), str(EVERY)]) as wl:
        made, summary = trace_in_process(wl, db, f"launch-{name}", go, **cfg)
    return made, summary, db


def _agg(db: Path, bucket: int) -> int:
    with sqlite3.connect(db) as c:
        (n,) = c.execute("SELECT coalesce(sum(count), 0) FROM aggregate_data WHERE op = ? "
                         "AND bucket = ?", (LAUNCH, bucket)).fetchone()
    return int(n)


def _records(db: Path) -> list[tuple[int, int]]:
    """(dur_ns, ret) of every stored launch."""
    with sqlite3.connect(db) as c:
        return [(int(d), int(r)) for d, r in c.execute(
            "SELECT dur_ns, ret FROM event_data WHERE op = ?", (LAUNCH,))]


def _via(db: Path) -> list[str]:
    with sqlite3.connect(db) as c:
        return [str(lib.get("via")) for (text,) in c.execute(
            "SELECT targets FROM session_data")
                for lib in json.loads(text or "{}").get("libraries", [])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Any,
                                                                      Path]]:
    tmp = tmp_path_factory.mktemp("launch-entry")
    return {
        # 3 of the 3,000 launches in the sample: fewer than one second's error budget
        "entry": _run(tmp, "entry", launch_returns=False, sample=1000),
        "entry_all": _run(tmp, "entry-all", launch_returns=False, sample=1),
        "returns": _run(tmp, "returns", launch_returns=True, sample=1000),
    }


def test_no_device_fails_every_launch_alike(runs: dict[str, Any]) -> None:
    """Why the failures are one streak here: the invalid launches return what the valid
    ones do (with a GPU they would return 9, a new code, recorded at once if timed)."""
    made = runs["entry"][0]
    assert made["launches"] == BATCHES * PER_BATCH
    valid, zero = made["returns"]["valid"], made["returns"]["zero_grid"]
    assert sum(zero.values()) == -(-BATCHES * PER_BATCH // EVERY)
    assert "0" not in valid and "0" not in zero, made  # nothing succeeds without a GPU
    assert set(valid) == set(zero) and len(valid) == 1, made


def test_entry_only_counts_every_launch_and_times_a_sample(runs: dict[str, Any]) -> None:
    made, summary, db = runs["entry"]
    assert any(v.endswith("+session") for v in _via(db)), _via(db)
    assert _agg(db, -1) == made["launches"]  # counted at entry: exact
    untimed = _agg(db, -3)
    timed = made["launches"] - untimed
    # the 3 sampled launches and the error budget's returns: far fewer than all
    assert 3 <= timed <= 3 + 2 * ERR_BURST * 3, (timed, untimed)
    assert summary.sampled_out >= untimed


def test_entry_only_records_have_measured_durations(runs: dict[str, Any]) -> None:
    made, _, db = runs["entry"]
    code = int(next(iter(made["returns"]["valid"])))
    recs = _records(db)
    assert recs, "no launch record"
    assert all(d > 0 for d, _ in recs), [d for d, _ in recs if d <= 0]
    assert {r for _, r in recs} == {code}


def test_entry_only_records_failures_as_the_error_budget_allows(runs: dict[str, Any]
                                                                ) -> None:
    """More failures recorded than the sample alone holds (3): after the first sampled
    failure, returns are taken until the second's budget is spent, as --launch-returns
    records them (its own error records: the budget's too)."""
    _, _, db = runs["entry"]
    failed = sum(1 for _, r in _records(db) if r != 0)
    assert failed >= ERR_BURST, failed
    _, _, full_db = runs["returns"]
    full_failed = sum(1 for _, r in _records(full_db) if r != 0)
    # Entry-only misses at most the failures before its first sampled one: one
    # budget's worth per second of the loop (~2 s here).
    assert full_failed - 2 * ERR_BURST <= failed <= full_failed + 3, (failed, full_failed)


def test_every_failure_counted_when_every_return_is_taken(runs: dict[str, Any]) -> None:
    """--sample 1 (every launch in the sample) and --launch-returns count every failure
    in the histogram's error row; entry-only with a sample counts the timed ones."""
    for name in ("entry_all", "returns"):
        made, _, db = runs[name]
        assert _agg(db, -2) == made["launches"], name
        assert _agg(db, -3) == 0, name
    made, _, db = runs["entry"]
    assert 0 < _agg(db, -2) == made["launches"] - _agg(db, -3)
