"""Query latency under load while the agent traces: 50 concurrent mTLS clients.

One run, on loopback, as root (the agent traces the reference workload with BPF):
1. baseline: one client, sequential queries, while the agent traces;
2. load: 50 clients querying as fast as they can for a fixed time, same queries;
3. SIGTERM: the agent drains, and its trace summary says how many events were lost
   and whether any loss went unreported (must be 0).

Last line: BENCH agent_load p99_ms=X unreported_loss=N
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleetd.security import tls  # noqa: E402

FLEETD = str(REPO / ".venv" / "bin" / "fleetd")
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
CLIENTS = 50
LOAD_S = float(os.environ.get("BENCH_LOAD_S", "20"))
QUERIES = [
    "SELECT op, count(*), avg(dur_ns) FROM events WHERE ts_ns > ? GROUP BY op",
    "SELECT id, op, dur_ns FROM events WHERE ts_ns > ? ORDER BY ts_ns DESC LIMIT 50",
    "SELECT count(*) FROM event_data WHERE ts_ns > ?",
]


def certs(d: Path) -> None:
    for args in (["init-ca"], ["issue-node", "bench", "--san", "127.0.0.1"],
                 ["issue-client", "bench-client"]):
        subprocess.run([FLEETD, "certs", "--dir", str(d), *args], check=True,
                       capture_output=True)


def start(d: Path) -> tuple[subprocess.Popen[str], subprocess.Popen[str], str, Path]:
    go = d / "go"
    wl = subprocess.Popen([sys.executable, str(WORKLOAD), "--duration", "120", "--launches",
                           "16", "--memcpy", "2", "--cpu-us", "20", "--gpu-ms", "1",
                           "--go-file", str(go)], stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 20
    while "libcudart" not in Path(f"/proc/{wl.pid}/maps").read_text():
        if time.monotonic() > deadline:
            raise SystemExit("workload did not load libcudart")
        time.sleep(0.02)
    log = d / "agent.log"
    agent = subprocess.Popen(
        [FLEETD, "agent", "--db", str(d / "bench.db"), "--node", "bench", "--listen",
         "127.0.0.1:0", "--pid", str(wl.pid), "--sample", "1", "--tls-cert",
         str(d / "bench.pem"), "--tls-key", str(d / "bench.key"), "--client-ca",
         str(d / "ca.pem")], stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (m := re.search(r"listening on https://([\d.]+:\d+)", log.read_text())):
        if agent.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"agent did not start: {log.read_text()}")
        time.sleep(0.05)
    go.touch()
    return wl, agent, f"https://{m.group(1)}", log


async def client(session: aiohttp.ClientSession, url: str, ctx: object, until: float,
                 lat: list[float], errors: list[int]) -> None:
    i = 0
    while time.monotonic() < until:
        sql = QUERIES[i % len(QUERIES)]
        i += 1
        since = time.time_ns() - 5_000_000_000
        t = time.perf_counter()
        async with session.post(url + "/api/v1/query", ssl=ctx,
                                json={"sql": sql, "params": [since]}) as r:
            await r.read()
            if r.status == 200:
                lat.append(time.perf_counter() - t)
            else:
                errors.append(r.status)


async def measure(url: str, ctx: object, clients: int, seconds: float
                  ) -> tuple[list[float], list[int]]:
    lat: list[float] = []
    errors: list[int] = []
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn) as s:
        until = time.monotonic() + seconds
        await asyncio.gather(*(client(s, url, ctx, until, lat, errors) for _ in range(clients)))
    return lat, errors


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] * 1000 if len(xs) >= 2 else float("nan")


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench/agent_load.py traces with BPF: run it as root")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        certs(d)
        wl, agent, url, log = start(d)
        try:
            ctx = tls.client_context(d / "ca.pem", d / "bench-client.pem",
                                     d / "bench-client.key")
            time.sleep(2)  # let the store fill a little
            base, base_err = asyncio.run(measure(url, ctx, 1, 5))
            load, load_err = asyncio.run(measure(url, ctx, CLIENTS, LOAD_S))
        finally:
            agent.send_signal(signal.SIGTERM)
            rc = agent.wait(60)
            wl.kill()
            wl.wait()
        text = log.read_text()
    m = re.search(r"(\d+) events written, (\d+) lost \(counted\), (-?\d+) unreported", text)
    if rc != 0 or not m:
        raise SystemExit(f"agent exited {rc} without a trace summary:\n{text}")
    written, lost, unreported = (int(g) for g in m.groups())
    busy = sum(1 for s in load_err if s == 429)
    print(f"baseline: 1 client, {len(base)} queries, p50 {statistics.median(base) * 1000:.1f} ms,"
          f" p99 {p99(base):.1f} ms, errors {len(base_err)}")
    print(f"load: {CLIENTS} clients x {LOAD_S:.0f} s, {len(load)} answered "
          f"({len(load) / LOAD_S:.0f}/s), {busy} refused as busy, other errors "
          f"{len(load_err) - busy}, p50 {statistics.median(load) * 1000:.1f} ms, "
          f"p99 {p99(load):.1f} ms ({p99(load) / p99(base):.1f}x the baseline p99)")
    print(f"tracer meanwhile: {written} events written, {lost} lost and counted, "
          f"{unreported} unreported")
    print(f"BENCH agent_load p99_ms={p99(load):.1f} unreported_loss={unreported}")


if __name__ == "__main__":
    main()
