"""`fleetd demo` tells the truth about itself (issue #44.2): a part that failed is named
with its reason, the summary repeats the answer step 5 printed and lists only files
that exist, and a demo whose late rank cannot be named says why (and exits 1).

The parts are real processes: one that ends as an NCCL rank does when its go-file never
comes (a line in its log, exit 1), one that finished its run, one killed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fleetd.cli.demo_cmd import Fleet, headline_missing, summary_lines

GAVE_UP = "rank 1: no go-file within 80.0 s"


def _part(tmp: Path, name: str, code: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=out,
                             stderr=subprocess.STDOUT)
    return p, log


def test_a_failed_part_is_named_with_the_last_line_of_its_log(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    rank, rank_log = _part(tmp_path, "rank", f"print('starting'); print({GAVE_UP!r}); "
                                             "raise SystemExit(1)")
    done, done_log = _part(tmp_path, "workload", "print('{\"steps\": 10}')")
    hog = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fleet.parts = {"node-2: rank 1 of the NCCL job": (rank, rank_log),
                   "node-1: the workload": (done, done_log), "node-3: cpu-hog": (hog, None)}
    fleet.procs = [rank, done, hog]
    rank.wait(30)
    done.wait(30)
    assert fleet.failures() == [
        f"node-2: rank 1 of the NCCL job (pid {rank.pid}) exited with 1: {GAVE_UP} "
        f"(log: {rank_log})"]
    hog.kill()
    hog.wait(10)
    # A part that must run to the end (the hog) failed when it ended at all.
    assert fleet.failures()[1].startswith(f"node-3: cpu-hog (pid {hog.pid}) exited with -9")


VERDICT = {
    "stragglers": [
        {"node": "node-3", "rank": 2, "pid": 42, "flagged": True, "share_last": 0.98,
         "metric": "collective_arrival", "score": 0.02},
        {"node": "node-3", "flagged": True, "metric": "runq_share", "score": 0.12},
        {"node": "node-1", "flagged": False, "metric": "cuda_calls_per_s", "score": 0.96}],
    "chains": [{"node": "node-3", "severity": "HIGH", "root_cause": "cpu_contention",
                "culprit": {"comm": "cpu-hog", "pid": 41}}],
    "collectives": {"verdict": "rank 2 is the straggler"},
}


def test_the_summary_says_what_step_5_said_and_lists_only_written_files(
        tmp_path: Path) -> None:
    merged = tmp_path / "fleet-demo.db"
    merged.write_bytes(b"")
    lines = summary_lines(VERDICT, [merged], ["--from", "A", "--to", "B"])
    assert lines[1] == "  straggler: rank 2 on node-3 (pid 42), last in 98% of the collectives"
    assert lines[2] == "  straggler node: node-3 (runq_share, score 0.12)"
    assert "  node-3: [HIGH] cpu_contention, culprit cpu-hog pid 41" in lines
    written = [line for line in lines if "written" in line or line.startswith("           ")]
    assert written == [f"  written: {merged}"]
    assert f"  next: .venv/bin/fleetd explain --db {merged} --from A --to B" in lines
    assert len(lines) <= 12
    assert headline_missing(VERDICT, []) is None


def test_no_late_rank_is_a_failed_headline_with_its_reasons() -> None:
    verdict = {"stragglers": [VERDICT["stragglers"][1]], "chains": [],
               "collectives": {"verdict": "no straggler: 3 judged instance(s), fewer than 5"}}
    why = headline_missing(verdict, [f"node-2: rank 1 of the NCCL job (pid 7) exited with 1: "
                                     f"{GAVE_UP}"])
    assert why is not None
    assert "collective arrival: no straggler: 3 judged instance(s)" in why
    assert GAVE_UP in why
    lines = summary_lines(verdict, [])
    assert "  written: nothing (see the errors above)" in lines
    assert not any("next:" in line for line in lines)
