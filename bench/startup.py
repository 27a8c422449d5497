"""Start-up of ``fleetd trace --pid``: seconds from the command's launch to the first
CUDA call it records, on the reference workload calling continuously.

Cold: a fresh header cache (``FLEETD_CACHE_DIR`` empty, the header tree built by this
run); warm: the same cache again. The baseline measured in the same run is BCC's own
compile of the same programs in a bare process (what every start pays and fleetd cannot
cache: BCC has no object cache); ``over_compile_s`` is what fleetd adds on top of it.

Last line: ``BENCH startup first_event_s=... first_event_cold_s=... compile_s=...``.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLEETD = str(REPO / ".venv" / "bin" / "fleetd")
PY = sys.executable
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
ROUNDS = 3  # warm starts; the cold start is one by nature


def _wait_mapped(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "libcudart" in Path(f"/proc/{pid}/maps").read_text():
            return
        time.sleep(0.02)
    raise SystemExit(f"the workload {pid} never mapped libcudart")


def first_event(pid: int, db: Path, cache: Path) -> tuple[float, float]:
    """(seconds to the first recorded call, seconds to the 'tracing' announcement)."""
    env = {**os.environ, "FLEETD_CACHE_DIR": str(cache)}
    t0 = time.time()
    tr = subprocess.Popen([FLEETD, "trace", "--pid", str(pid), "--db", str(db)],
                          stderr=subprocess.PIPE, text=True, env=env)
    assert tr.stderr is not None
    ready = None
    for line in tr.stderr:
        if line.startswith("fleetd: tracing"):
            ready = time.time() - t0
            break
    if ready is None:
        tr.wait()
        raise SystemExit(f"fleetd trace exited ({tr.returncode}) before tracing")
    time.sleep(1.0)
    tr.send_signal(signal.SIGINT)
    tr.communicate(timeout=60)
    with sqlite3.connect(db) as c:
        first = c.execute("SELECT min(ts_ns) FROM events WHERE op LIKE 'cuda%'").fetchone()[0]
    if first is None:
        raise SystemExit("no CUDA call was recorded")
    return first / 1e9 - t0, ready


def bare_compile_s(cache: Path) -> float:
    # The programs a default `fleetd trace` compiles: with the on-CPU sampler (and so
    # the Python frame walk it shares with --stacks).
    code = ("import os, time\nfrom fleetd.trace.bpfsrc import ProgramOptions, "
            "compile_program, detach_all\nfrom fleetd.trace.oncpu import DEFAULT_HZ\n"
            "t = time.perf_counter()\n"
            "b, _ = compile_program(ProgramOptions(tracer_pid=os.getpid(), "
            "cpu_sample_hz=DEFAULT_HZ))\n"
            "print(time.perf_counter() - t)\ndetach_all(b)\n")
    env = {**os.environ, "FLEETD_CACHE_DIR": str(cache)}
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=300)
    return float(out.stdout.strip())


def main() -> None:
    wl = subprocess.Popen([PY, str(WORKLOAD), "--duration", "300"])
    try:
        _wait_mapped(wl.pid)
        with tempfile.TemporaryDirectory(prefix="fleetd-startup-") as tmp:
            cache = Path(tmp) / "cache"
            cold, cold_ready = first_event(wl.pid, Path(tmp) / "cold.db", cache)
            print(f"cold header cache: first event {cold:.2f} s (tracing announced at "
                  f"{cold_ready:.2f} s)", flush=True)
            warm, readies = [], []
            for i in range(ROUNDS):
                w, r = first_event(wl.pid, Path(tmp) / f"warm{i}.db", cache)
                warm.append(w)
                readies.append(r)
                print(f"warm {i + 1}: first event {w:.2f} s (announced at {r:.2f} s)",
                      flush=True)
            compiles = [bare_compile_s(cache) for _ in range(ROUNDS)]
            print("BCC compile alone: " + ", ".join(f"{c:.2f}" for c in compiles) + " s",
                  flush=True)
    finally:
        wl.kill()
        wl.wait()
    w, c = statistics.median(warm), statistics.median(compiles)
    print(f"BENCH startup first_event_s={w:.2f} first_event_cold_s={cold:.2f} "
          f"ready_s={statistics.median(readies):.2f} compile_s={c:.2f} "
          f"over_compile_s={w - c:.2f}")


if __name__ == "__main__":
    main()
