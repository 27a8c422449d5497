"""Agent throughput while it traces: small queries/s at saturation, p99 latency at half
of that rate, health p99 while saturated, and the tracer's unreported loss.

One run, on loopback, as root (the agent traces the reference workload with BPF, every
call kept). The load comes from a separate generator process (this file with ``--gen``)
on keep-alive mTLS connections, so its CPU is its own and is printed: on two cores
shared by the workload, the agent and the generator, a generator that took a core
would cap the figure it claims to measure.

1. idle: the agent's CPU while it only traces (the part of its CPU no query costs);
2. saturation: closed-loop clients (2, 4, 8, ... each sending its next query when the
   last is answered) until queries/s stops rising by 5%; the best rate is Q. Meanwhile
   this process probes ``/api/v1/health`` every 20 ms on its own connection: H is the
   p99 of those probes while saturated;
3. half load: an open-loop generator paced at Q/2 queries/s, latency counted from each
   query's scheduled time (so a stall cannot hide the queries it delayed): P is p99;
4. SIGTERM: the agent drains; its trace summary says how many events were lost and how
   many of those went unreported (must be 0).

Last line: BENCH agent_load qps_saturated=Q p99_ms_half_load=P
health_p99_ms_saturated=H unreported_loss=U
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleetd.security import tls  # noqa: E402

FLEETD = str(REPO / ".venv" / "bin" / "fleetd")
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
STEP_S = float(os.environ.get("BENCH_STEP_S", "3"))
HALF_S = float(os.environ.get("BENCH_HALF_S", "8"))
STEPS = (2, 4, 8, 16, 32)
PROBE_EVERY_S = 0.02
GEN_CONNECTIONS = 32
OPEN_GIVE_UP_S = 5.0  # an open-loop query not answered by then counts as this late
# Small queries: a few rows each, over the recent window the tracer is writing into.
QUERIES = [
    ("SELECT id, op, dur_ns FROM events WHERE ts_ns > ? ORDER BY ts_ns DESC LIMIT 20", 1.0),
    ("SELECT count(*) FROM event_data WHERE ts_ns > ?", 1.0),
    ("SELECT op, count(*), avg(dur_ns) FROM events WHERE ts_ns > ? GROUP BY op", 0.1),
]


# ---- the generator process ------------------------------------------------------------


def _body(i: int) -> dict[str, Any]:
    sql, window_s = QUERIES[i % len(QUERIES)]
    return {"sql": sql, "params": [time.time_ns() - int(window_s * 1e9)]}


async def _one(s: aiohttp.ClientSession, url: str, i: int, sql_ms: list[float]) -> int:
    async with s.post(url + "/api/v1/query", json=_body(i)) as r:
        raw = await r.read()
        if r.status == 200:
            sql_ms.append(float(orjson.loads(raw)["elapsed_ms"]))  # the SQL on the node
        return r.status


async def _closed(s: aiohttp.ClientSession, url: str, clients: int, seconds: float
                  ) -> dict[str, Any]:
    lat: list[float] = []
    sql_ms: list[float] = []
    errors: dict[str, int] = {}
    until = time.monotonic() + seconds

    async def client(k: int) -> None:
        i = k
        while time.monotonic() < until:
            t = time.perf_counter()
            status = await _one(s, url, i, sql_ms)
            i += 1
            if status == 200:
                lat.append(time.perf_counter() - t)
            else:
                errors[str(status)] = errors.get(str(status), 0) + 1

    t0 = time.time()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return {"clients": clients, "start": t0, "end": time.time(), "lat": lat,
            "sql_ms": sql_ms, "errors": errors}


async def _open(s: aiohttp.ClientSession, url: str, rate: float, seconds: float
                ) -> dict[str, Any]:
    lat: list[float] = []
    sql_ms: list[float] = []
    sent_late: list[float] = []
    errors: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    n = int(rate * seconds)

    async def one(i: int, due: float) -> None:
        # How late the generator itself sent it (its own loop, or the machine not
        # running it): part of the latency, but not the agent's part.
        sent_late.append(loop.time() - due)
        try:
            status = await asyncio.wait_for(_one(s, url, i, sql_ms), OPEN_GIVE_UP_S)
        except TimeoutError:
            # Counted in the latencies at the give-up time (a lower bound), so an
            # overloaded run shows in p99 instead of leaving the sample.
            lat.append(OPEN_GIVE_UP_S)
            errors["gave_up"] = errors.get("gave_up", 0) + 1
            return
        if status == 200:
            lat.append(loop.time() - due)  # from when it was due: no coordinated omission
        else:
            errors[str(status)] = errors.get(str(status), 0) + 1

    tasks = []
    for i in range(n):
        due = start + i / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    return {"rate": rate, "lat": lat, "sql_ms": sql_ms, "errors": errors,
            "sent_late": sent_late}


async def _generate(url: str, d: Path, plan: dict[str, Any]) -> dict[str, Any]:
    ctx = tls.client_context(d / "ca.pem", d / "bench-client.pem", d / "bench-client.key")
    # Under the agent's 64 connections per source, with room for the health prober.
    conn = aiohttp.TCPConnector(ssl=ctx, limit=GEN_CONNECTIONS)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=conn) as s:
        # Every connection made before the clock starts: a burst that needs one more
        # would otherwise time a TLS handshake, not a query, in the tail.
        await asyncio.gather(*(_one(s, url, i, []) for i in range(GEN_CONNECTIONS)))
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        w0 = time.monotonic()
        if plan["mode"] == "closed":
            steps = []
            best = 0.0
            for clients in STEPS:
                step = await _closed(s, url, clients, plan["seconds"])
                qps = len(step["lat"]) / (step["end"] - step["start"])
                steps.append(step)
                if qps < best * 1.05 and len(steps) >= 3:
                    break  # no longer rising: saturated
                best = max(best, qps)
            out["steps"] = steps
        else:
            out["half"] = await _open(s, url, plan["rate"], plan["seconds"])
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu_s"] = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
        out["wall_s"] = time.monotonic() - w0
    return out


def generator_main(url: str, d: str, plan: str) -> None:
    import uvloop

    result = uvloop.run(_generate(url, Path(d), json.loads(plan)))
    # To a file, not stdout: the event loop leaves stdout non-blocking, and a result of
    # over 128 KiB (the pipe's size) was cut there, silently.
    (Path(d) / "gen-result.json").write_text(json.dumps(result))


# ---- the bench ------------------------------------------------------------------------


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


def wal_size(d: Path) -> float:
    """MB in the database's write-ahead log: readers that never pause can keep SQLite
    from restarting it, and every read then searches a longer log."""
    wal = d / "bench.db-wal"
    return wal.stat().st_size / 1e6 if wal.exists() else 0.0


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each of the agent's threads, by thread id: whether one thread (the
    event loop, or one holding the interpreter lock) is the limit."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def generate(url: str, d: Path, plan: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--gen", url, str(d), json.dumps(plan)],
                          capture_output=True, text=True, timeout=110)
    if proc.returncode != 0:
        raise SystemExit(f"load generator failed:\n{proc.stderr}")
    result: dict[str, Any] = json.loads((d / "gen-result.json").read_text())
    return result


class Prober:
    """GET /api/v1/health every PROBE_EVERY_S on one keep-alive connection, in a
    thread of this (otherwise idle) process: (wall time, seconds) per probe."""

    def __init__(self, url: str, ctx: Any) -> None:
        self.url, self.ctx = url, ctx
        self.samples: list[tuple[float, float]] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ctx)) as s:
            while not self._stop.is_set():
                t, w = time.perf_counter(), time.time()
                try:
                    async with s.get(self.url + "/api/v1/health",
                                     timeout=aiohttp.ClientTimeout(total=10)) as r:
                        await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                took = time.perf_counter() - t
                if ok:
                    self.samples.append((w, took))
                else:
                    self.failures += 1
                await asyncio.sleep(max(0.0, PROBE_EVERY_S - took))

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def p99_ms(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] * 1000 if len(xs) >= 2 else float("nan")


def p50_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000 if xs else float("nan")


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench/agent_load.py traces with BPF: run it as root")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        certs(d)
        wl, agent, url, log = start(d)
        try:
            ctx = tls.client_context(d / "ca.pem", d / "bench-client.pem",
                                     d / "bench-client.key")
            time.sleep(2)  # let the store fill a little
            c0, t0 = cpu_s(agent.pid), time.monotonic()
            time.sleep(2)
            idle_cores = (cpu_s(agent.pid) - c0) / (time.monotonic() - t0)
            with Prober(url, ctx) as probe:
                c0, t0 = cpu_s(agent.pid), time.monotonic()
                th0 = threads_cpu_s(agent.pid)
                sat = generate(url, d, {"mode": "closed", "seconds": STEP_S})
                sat_cores = (cpu_s(agent.pid) - c0) / (time.monotonic() - t0)
                th1 = threads_cpu_s(agent.pid)
                sat_wall = time.monotonic() - t0
            wal_mb = [wal_size(d)]
            rates = [len(s["lat"]) / (s["end"] - s["start"]) for s in sat["steps"]]
            best = max(range(len(rates)), key=lambda i: rates[i])
            q = rates[best]
            half = generate(url, d, {"mode": "open", "rate": q / 2, "seconds": HALF_S})
            wal_mb.append(wal_size(d))
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
    answered = sum(len(s["lat"]) for s in sat["steps"])
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.1f} before and "
          f"{os.getloadavg()[0]:.1f} after (other processes share these cores)")
    print(f"agent idle while tracing: {idle_cores:.2f} cores")
    for s, rate in zip(sat["steps"], rates, strict=True):
        print(f"closed loop, {s['clients']:2d} clients: {rate:6.1f} queries/s, "
              f"p50 {p50_ms(s['lat']):.1f} ms, p99 {p99_ms(s['lat']):.1f} ms "
              f"(SQL on the node p50 {statistics.median(s['sql_ms'] or [0]):.2f} ms, "
              f"p99 {p99_ms([x / 1000 for x in s['sql_ms']]):.2f} ms), "
              f"errors {s['errors'] or 0}")
    # Health probes while saturated: the steps from the best one on.
    lo = sat["steps"][best]["start"]
    hi = sat["steps"][-1]["end"]
    health = [took for w, took in probe.samples if lo <= w <= hi]
    extra_ms = (sat_cores - idle_cores) / max(1e-9, answered / sat["wall_s"]) * 1000
    print(f"saturated at {q:.1f} queries/s with {sat['steps'][best]['clients']} clients; "
          f"agent {sat_cores:.2f} cores ({extra_ms:.2f} ms of CPU per query beyond tracing);"
          f" generator {sat['cpu_s'] / sat['wall_s']:.2f} cores "
          f"({sat['cpu_s'] / max(1, answered) * 1000:.2f} ms per query)")
    per_thread = sorted(((th1.get(k, 0) - th0.get(k, 0)) / sat_wall, k) for k in th1)
    print(f"agent while saturated: its busiest thread {per_thread[-1][0]:.2f} cores, all "
          f"{sum(c for c, _ in per_thread):.2f}")
    print(f"health while saturated: {len(health)} probes, p50 {p50_ms(health):.1f} ms, "
          f"p99 {p99_ms(health):.1f} ms, failed {probe.failures}")
    h = half["half"]
    print(f"half load, open loop at {h['rate']:.1f}/s for {HALF_S:g} s: {len(h['lat'])} "
          f"answered, p50 {p50_ms(h['lat']):.1f} ms, p99 {p99_ms(h['lat']):.1f} ms "
          f"(SQL p50 {statistics.median(h['sql_ms'] or [0]):.2f} ms, "
          f"p99 {p99_ms([x / 1000 for x in h['sql_ms']]):.2f} ms), "
          f"errors {h['errors'] or 0}; generator {half['cpu_s'] / half['wall_s']:.2f} cores, "
          f"sent late by p50 {p50_ms(h['sent_late']):.1f} ms, p99 "
          f"{p99_ms(h['sent_late']):.1f} ms")
    print(f"tracer meanwhile: {written} events written, {lost} lost and counted, "
          f"{unreported} unreported; WAL {wal_mb[0]:.1f} MB after saturation, "
          f"{wal_mb[1]:.1f} MB after half load")
    print(f"BENCH agent_load qps_saturated={q:.1f} p99_ms_half_load={p99_ms(h['lat']):.1f} "
          f"health_p99_ms_saturated={p99_ms(health):.1f} unreported_loss={unreported}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--gen":
        generator_main(*sys.argv[2:])
    else:
        main()
