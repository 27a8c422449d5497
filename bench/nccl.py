"""NCCL tracing cost and hang detection, against baselines measured in the same run.

1. Tight loop, lockstep-free: LOOP_RANKS worker processes load the real libnccl (the
   nvidia-nccl-cu12 wheel) and call ncclAllReduce as fast as they can, all at once.
   One rank by default: this machine has 2 cores, and a second rank would measure the
   tracer's user-space work competing with the ranks for the CPU (a GPU node has a
   core per rank and more), not the cost on each call.
   Without a GPU no communicator exists, so each call is the library's argument check
   on a NULL communicator (it returns ncclInvalidArgument in about 2 us): the cheapest
   a collective can be on the host, so the uprobes' cost shows at its largest. Rounds
   alternate untraced and traced (the real Tracer in this process, default settings,
   every NCCL call a record); the best round of each is compared (the standard for
   micro-benchmarks on a noisy machine) and the spread is printed.
2. Hang detection: tests/workloads/nccl_ranks.py runs 2 ranks in lockstep under a real
   ``fleetd agent`` (certificates from ``fleetd certs``, mTLS on loopback);
   ``fleetd watch --hang-after 10s`` polls it; one rank gets SIGSTOP; the time from
   the stop to watch's exit with the verdict is measured.

Last line: BENCH nccl traced_ratio=R hang_detect_s=S
(targets: R >= 0.97, S <= 15 at --hang-after 10s)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _traced import Traced  # noqa: E402

LOOP_RANKS = int(os.environ.get("BENCH_LOOP_RANKS", "1"))
HANG_RANKS = 2
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
LOOP_S = float(os.environ.get("BENCH_LOOP_S", "1.0"))
HANG_AFTER_S = 10
FLEETD = str(REPO / ".venv" / "bin" / "fleetd")
WORKLOAD = REPO / "tests" / "workloads" / "nccl_ranks.py"

# Each worker loads libnccl, says so, then per command calls ncclAllReduce on a NULL
# communicator for the given seconds and answers with the number of calls it made.
WORKER = r"""
import ctypes, json, sys, time
sys.path.insert(0, sys.argv[1])
from nccl_ranks import find_nccl
lib = ctypes.CDLL(find_nccl())
call = lib.ncclAllReduce
call.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd.get("op") != "loop":
        break
    n, end = 0, time.perf_counter() + cmd["seconds"]
    while time.perf_counter() < end:
        for _ in range(200):
            call(None, None, 1024, 7, 0, None, None)
        n += 200
    print(json.dumps({"calls": n}), flush=True)
"""


class Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(WORKLOAD.parent)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a worker died (is nvidia-nccl-cu12 installed?)")
        out: dict[str, Any] = json.loads(line)
        return out

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        with suppress(BrokenPipeError, ValueError):
            self.send(op="quit")
        self.proc.wait(timeout=10)


def collectives_per_s(workers: list[Worker]) -> float:
    """Calls per second of all workers together, all looping at once."""
    for w in workers:
        w.send(op="loop", seconds=LOOP_S)
    return sum(w._read()["calls"] for w in workers) / LOOP_S


def tight_loop(tmp: Path) -> tuple[float, float, dict[str, Any]]:
    """(best untraced, best traced) collectives/s and what the tracer recorded."""
    workers = [Worker() for _ in range(LOOP_RANKS)]
    plain: list[float] = []
    traced: list[float] = []
    recorded: dict[str, Any] = {}
    try:
        for i in range(ROUNDS):
            plain.append(collectives_per_s(workers))
            with Traced(tmp / f"loop{i}.db", [w.pid for w in workers]) as t:
                traced.append(collectives_per_s(workers))
            s = t.summary
            recorded = {"events_written": s.events_written, "lost": s.lost_total,
                        "unreported_loss": s.unreported_loss}
            print(f"  round {i + 1}: untraced {plain[-1]:,.0f}/s, traced "
                  f"{traced[-1]:,.0f}/s; recorded {s.events_written:,}, lost (counted) "
                  f"{s.lost_total:,}, unreported {s.unreported_loss}", flush=True)
    finally:
        for w in workers:
            w.close()
    print(f"  untraced {min(plain):,.0f}..{max(plain):,.0f}/s, traced "
          f"{min(traced):,.0f}..{max(traced):,.0f}/s over {ROUNDS} rounds", flush=True)
    return max(plain), max(traced), recorded


# ---- hang detection ------------------------------------------------------------------


def _run_ok(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


def _wait(cond: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def hang_detect(tmp: Path) -> tuple[float, str]:
    """Seconds from SIGSTOP of one rank to ``fleetd watch`` exiting with its verdict."""
    certs = tmp / "certs"
    _run_ok(FLEETD, "certs", "--dir", str(certs), "init-ca")
    _run_ok(FLEETD, "certs", "--dir", str(certs), "issue-node", "n1", "--san", "127.0.0.1")
    _run_ok(FLEETD, "certs", "--dir", str(certs), "issue-client", "bench")
    go, said = tmp / "go", tmp / "ranks.out"
    with said.open("w") as out:
        job = subprocess.Popen(
            [sys.executable, str(WORKLOAD), "--spawn", str(HANG_RANKS), "--seconds", "90",
             "--compute-ms", "1", "--sleep-ms", "5", "--go-file", str(go),
             "--barrier-timeout", "100", "--max-listed", "0"],
            stdout=out, text=True, start_new_session=True)
    agent = watch = None
    try:
        _wait(lambda: '"pids"' in said.read_text(), "the ranks ready", 30)
        pids = json.loads(said.read_text().splitlines()[0])["pids"]
        log = (tmp / "agent.log").open("w")
        agent = subprocess.Popen(
            [FLEETD, "agent", "--node", "n1", "--db", str(tmp / "n1.db"),
             "--listen", "127.0.0.1:0", "--tls-cert", str(certs / "n1.pem"),
             "--tls-key", str(certs / "n1.key"), "--client-ca", str(certs / "ca.pem"),
             *(a for p in pids for a in ("--pid", str(p)))],
            stdout=log, stderr=subprocess.STDOUT, text=True)
        text = ""

        def listening() -> bool:
            nonlocal text
            text = (tmp / "agent.log").read_text()
            if agent is not None and agent.poll() is not None:
                raise RuntimeError(f"the agent exited: {text}")
            return "listening on https://" in text

        _wait(listening, "the agent tracing", 90)
        addr = text.split("listening on https://", 1)[1].split()[0].rstrip("/,")
        go.touch()
        time.sleep(3)  # every rank well into its collectives
        watch = subprocess.Popen(
            [FLEETD, "watch", "--nodes", f"n1={addr}", "--ca-cert", str(certs / "ca.pem"),
             "--client-cert", str(certs / "bench.pem"), "--client-key",
             str(certs / "bench.key"), "--hang-after", f"{HANG_AFTER_S}s", "--format", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2)  # watch has polled a healthy job
        if watch.poll() is not None:
            raise RuntimeError(f"watch exited early: {watch.communicate()}")
        stopped = time.monotonic()
        os.kill(pids[-1], signal.SIGSTOP)
        out_text, err = watch.communicate(timeout=60)
        took = time.monotonic() - stopped
        if watch.returncode == 0:
            raise RuntimeError(f"watch saw no hang: {err}")
        verdict = json.loads(out_text)
        first = verdict["hangs"][0]
        culprit = first["culprits"][0]
        # A stalled job names no op: no rank has entered its next collective.
        what = (f"{first['kind']} hang at {first['op'] or 'collective'} #{first['seq']}: rank "
                f"{culprit['rank']} pid {culprit['pid']} {culprit['state']}")
        return took, what
    finally:
        for proc in (watch, agent):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with suppress(ProcessLookupError):
                os.killpg(job.pid, sig)
        job.wait(20)


def main() -> int:
    if os.geteuid() != 0:
        print("BENCH nccl needs root (BPF)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="fleetd-bench-nccl-") as d:
        tmp = Path(d)
        print(f"tight loop: {LOOP_RANKS} worker(s) x ncclAllReduce on the real libnccl, "
              f"{ROUNDS} rounds of {LOOP_S:g} s each, untraced and traced", flush=True)
        plain, traced, recorded = tight_loop(tmp)
        ratio = traced / plain
        per_call_ns = (LOOP_RANKS / traced - LOOP_RANKS / plain) * 1e9
        print(f"  best: untraced {plain:,.0f}/s, traced {traced:,.0f}/s => ratio "
              f"{ratio:.3f}, about {per_call_ns:,.0f} ns added per call; last traced "
              f"round {json.dumps(recorded)}", flush=True)
        print(f"hang detection: {HANG_RANKS} ranks in lockstep, one SIGSTOPped, "
              f"watch --hang-after {HANG_AFTER_S}s", flush=True)
        took, what = hang_detect(tmp)
        print(f"  verdict after {took:.1f} s: {what}", flush=True)
    print(f"BENCH nccl traced_ratio={ratio:.3f} hang_detect_s={took:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
