"""Soak: does a long-running agent stay flat? Memory, database size, query latency, CPU
per event, file descriptors and threads over a run, at a realistic and a flood rate.

One real ``fleetd agent`` (real BPF, mTLS) traces two reference workloads
(tests/workloads/train_loop.py, every call kept): a realistic one (``SOAK_RATE`` CUDA
calls/s, default 2000) from the start, and a flood one (as fast as one Python thread
calls) joining for the second half. A client on its own mTLS connection sends a burst
of small queries every ``SOAK_QUERY_EVERY_S`` and reads ``/metrics``; this process
samples the agent's RSS, CPU time, ``/proc/PID/fd`` and ``/proc/PID/task``.

The database gets a small cap (``SOAK_CAP``, default 32M, passed as --max-db-bytes) so
pruning happens within the run: the bench checks the stored ids stay one contiguous
range (only the oldest end is ever deleted), the oldest stored time only moves forward,
fleetd_events_pruned_total counts them and the agent's closing log line reports them.

Each figure is taken per phase after its warm-up (the first ``WARMUP_SHARE`` of it) and
the worse phase is printed: a least-squares RSS slope (MB/hour; the phase line also
gives RssAnon's, the heap without mapped files) and database slope (bytes/hour), the
database's largest size on disk over its cap (``db_over_cap``, a ratio; <= 1 is
within), the query p99 of the last quarter over the first (``p99_growth``), fd and
thread counts at the end minus after warm-up, and CPU microseconds per traced record in
the last quarter over the first. The database's size is what an operator sees: the main
file and its -wal together, as the cap counts it.

``SOAK_TRACE_SAMPLES=1`` prints every sample (RSS split into anon/file/shmem, the db and
-wal sizes, fds, threads, the writer's queue) and what the agent's fds point at;
``SOAK_LOG=PATH`` keeps the agent's log (with ``FLEETD_MEMTRACE=SECONDS`` in the
environment the agent logs where its memory grows: fleetd/node/memtrace.py).

``SOAK_S`` is the whole run (default 70 s: the short form ``make bench`` runs, about
90 s with start-up); ``SOAK_S=3600`` runs the hour. Last line:
BENCH soak rss_slope_mb_per_h=.. db_bytes_per_h=.. db_over_cap=.. p99_growth=..
fds_growth=.. threads_growth=.. cpu_us_per_event_growth=..
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from agent_load import FLEETD, QUERIES, WORKLOAD, certs, cpu_s, p99_ms  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families

from fleetd.security import tls  # noqa: E402

SOAK_S = float(os.environ.get("SOAK_S", "70"))
RATE = float(os.environ.get("SOAK_RATE", "2000"))
CAP = os.environ.get("SOAK_CAP", "32M")
QUERY_EVERY_S = float(os.environ.get("SOAK_QUERY_EVERY_S", "2"))
SAMPLE_EVERY_S = max(1.0, min(10.0, SOAK_S / 60))
BURST = 10  # queries per burst: enough for a p99 per quarter in the short form
WARMUP_SHARE = 0.25


@dataclass
class Sample:
    t: float  # seconds since the agent listened
    rss_mb: float
    cpu_s: float
    fds: int
    threads: int
    records: float  # fleetd_trace_records
    pruned: float  # fleetd_events_pruned_total
    db_file: int  # the main file's size on disk
    queue_rows: float  # fleetd_writer_queue_rows: a backlog holds memory
    anon_mb: float = 0.0  # RssAnon: the heap, what a leak grows
    file_mb: float = 0.0  # RssFile: mapped files (libraries, SQLite's mmap)
    wal: int = 0  # the -wal file's size on disk


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    queries: list[tuple[float, float]] = field(default_factory=list)  # (t, seconds)
    failed: int = 0
    oldest: list[tuple[float, int]] = field(default_factory=list)  # (t, min ts_ns)
    fd_lists: list[tuple[float, list[str]]] = field(default_factory=list)


def _say(msg: str) -> None:
    print(f"soak: {msg}", file=sys.stderr, flush=True)


def _cap_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _status_mb(pid: int) -> dict[str, float]:
    """/proc/PID/status' sizes in MB (VmRSS, RssAnon, RssFile, RssShmem, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            out[key] = int(rest.split()[0]) / 1024
    return out


def _proc(pid: int) -> tuple[dict[str, float], int, int]:
    return (_status_mb(pid), len(os.listdir(f"/proc/{pid}/fd")),
            len(os.listdir(f"/proc/{pid}/task")))


def _fd_targets(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return sorted(out)


def _metric(text: str, name: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return float(s.value)
    return 0.0


class Client:
    """Queries and scrapes on one keep-alive mTLS connection, in a thread of its own."""

    def __init__(self, url: str, ctx: Any, run: Run, t0: float, db: Path, pid: int) -> None:
        self.url, self.ctx, self.run, self.t0, self.db, self.pid = url, ctx, run, t0, db, pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ctx)) as s:
            next_q = next_s = 0.0
            while not self._stop.is_set():
                now = time.monotonic() - self.t0
                if now >= next_q:
                    await self._burst(s, now)
                    next_q = now + QUERY_EVERY_S
                if now >= next_s:
                    await self._sample(s, now)
                    next_s = now + SAMPLE_EVERY_S
                await asyncio.sleep(0.05)

    async def _burst(self, s: aiohttp.ClientSession, now: float) -> None:
        for i in range(BURST):
            sql, window_s = QUERIES[i % len(QUERIES)]
            t = time.perf_counter()
            try:
                async with s.post(self.url + "/api/v1/query", json={
                        "sql": sql, "params": [time.time_ns() - int(window_s * 1e9)]},
                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                self.run.queries.append((now, time.perf_counter() - t))
            else:
                self.run.failed += 1
        async with s.post(self.url + "/api/v1/query", json={
                "sql": "SELECT min(ts_ns) FROM event_data"}) as r:
            rows = (await r.json()).get("rows") or [[None]]
            if rows[0][0] is not None:
                self.run.oldest.append((now, int(rows[0][0])))

    async def _sample(self, s: aiohttp.ClientSession, now: float) -> None:
        async with s.get(self.url + "/metrics") as r:
            text = await r.text()
        mem, fds, threads = _proc(self.pid)
        wal = Path(f"{self.db}-wal")
        self.run.samples.append(Sample(
            now, mem["VmRSS"], cpu_s(self.pid), fds, threads,
            _metric(text, "fleetd_trace_records_total"),
            _metric(text, "fleetd_events_pruned_total"), self.db.stat().st_size,
            _metric(text, "fleetd_writer_queue_rows"), mem.get("RssAnon", 0.0),
            mem.get("RssFile", 0.0), wal.stat().st_size if wal.exists() else 0))
        if os.environ.get("SOAK_TRACE_SAMPLES"):
            _say(f"t={now:.0f} rss={mem['VmRSS']:.1f} anon={mem.get('RssAnon', 0):.1f} "
                 f"file={mem.get('RssFile', 0):.1f} shmem={mem.get('RssShmem', 0):.1f} "
                 f"db={self.run.samples[-1].db_file} wal={self.run.samples[-1].wal} "
                 f"fds={fds} thr={threads} q={self.run.samples[-1].queue_rows:.0f}")
            self.run.fd_lists.append((now, _fd_targets(self.pid)))

    def __enter__(self) -> Client:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def _workload(d: Path, name: str, *flags: str) -> subprocess.Popen[bytes]:
    wl = subprocess.Popen([sys.executable, str(WORKLOAD), "--duration", str(SOAK_S + 120),
                           "--launches", "16", "--memcpy", "2", "--go-file",
                           str(d / f"go-{name}"), *flags], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while "libcudart" not in Path(f"/proc/{wl.pid}/maps").read_text():
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} workload did not load libcudart")
        time.sleep(0.02)
    return wl


def _start_agent(d: Path, pids: list[int]) -> tuple[subprocess.Popen[bytes], str, Path]:
    log = d / "agent.log"
    args = [FLEETD, "agent", "--db", str(d / "soak.db"), "--node", "bench", "--listen",
            "127.0.0.1:0", "--sample", "1", "--max-db-bytes", CAP, "--tls-cert",
            str(d / "bench.pem"), "--tls-key", str(d / "bench.key"), "--client-ca",
            str(d / "ca.pem")]
    for pid in pids:
        args += ["--pid", str(pid)]
    agent = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (m := re.search(r"listening on https://([\d.]+:\d+)", log.read_text())):
        if agent.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"agent did not start: {log.read_text()}")
        time.sleep(0.05)
    return agent, f"https://{m.group(1)}", log


def _on_disk(db: Path) -> int:
    """What an operator sees of the database: the main file and its -wal."""
    wal = Path(f"{db}-wal")
    return db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def _slope_per_h(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (seconds), per hour."""
    if len(xs) < 3:
        return float("nan")
    return float(statistics.linear_regression(xs, ys).slope) * 3600


def _quarters(items: list[Any], key: Any) -> tuple[list[Any], list[Any]]:
    n = max(1, len(items) // 4)
    ordered = sorted(items, key=key)
    return ordered[:n], ordered[-n:]


@dataclass
class Phase:
    name: str
    rss_slope: float
    anon_slope: float  # of RssAnon alone: the heap, without mapped files
    db_slope: float
    p99_start_ms: float
    p99_end_ms: float
    fds: tuple[int, int]
    threads: tuple[int, int]
    us_per_event: tuple[float, float]
    rate: float

    @property
    def p99_growth(self) -> float:
        return self.p99_end_ms / self.p99_start_ms if self.p99_start_ms else float("nan")

    @property
    def cpu_growth(self) -> float:
        a, b = self.us_per_event
        return b / a if a else float("nan")


def _us_per_event(ss: list[Sample]) -> float:
    cpu = ss[-1].cpu_s - ss[0].cpu_s
    recs = ss[-1].records - ss[0].records
    return cpu / recs * 1e6 if recs > 0 else float("nan")


def _phase(name: str, run: Run, lo: float, hi: float) -> Phase:
    """The figures of samples and queries in [lo + warm-up, hi)."""
    start = lo + (hi - lo) * WARMUP_SHARE
    ss = [s for s in run.samples if start <= s.t < hi]
    qs = [q for q in run.queries if start <= q[0] < hi]
    if len(ss) < 4 or len(qs) < 8:
        raise SystemExit(f"phase {name}: too few samples ({len(ss)}) or queries ({len(qs)})")
    first, last = _quarters(qs, key=lambda q: q[0])
    sfirst, slast = _quarters(ss, key=lambda s: s.t)
    ts = [s.t for s in ss]
    return Phase(
        name, _slope_per_h(ts, [s.rss_mb for s in ss]), _slope_per_h(ts, [s.anon_mb for s in ss]),
        _slope_per_h(ts, [float(s.db_file + s.wal) for s in ss]),
        p99_ms([q[1] for q in first]), p99_ms([q[1] for q in last]),
        (ss[0].fds, ss[-1].fds), (ss[0].threads, ss[-1].threads),
        (_us_per_event(sfirst + [slast[0]] if len(sfirst) < 2 else sfirst),
         _us_per_event(slast if len(slast) >= 2 else [sfirst[-1], *slast])),
        (ss[-1].records - ss[0].records) / max(1e-9, ss[-1].t - ss[0].t))


def _store_order(db: Path) -> tuple[int, int]:
    """(stored events, id span): pruning from the oldest end leaves one contiguous id
    range, so the count equals the span."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        lo, hi, n = conn.execute("SELECT min(id), max(id), count(*) FROM event_data").fetchone()
    finally:
        conn.close()
    return int(n), int(hi - lo + 1) if n else 0


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench/soak.py traces with BPF: run it as root")
    cap = _cap_bytes(CAP)
    run = Run()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        certs(d)
        real = _workload(d, "real", "--rate", str(RATE), "--cpu-us", "20")
        flood = _workload(d, "flood")
        _say("workloads ready; starting the agent")
        w0 = time.monotonic()
        agent, url, log = _start_agent(d, [real.pid, flood.pid])
        t0 = time.monotonic()
        _say(f"agent listening after {t0 - w0:.1f} s; running {SOAK_S:g} s")
        (d / "go-real").touch()
        ctx = tls.client_context(d / "ca.pem", d / "bench-client.pem", d / "bench-client.key")
        try:
            with Client(url, ctx, run, t0, d / "soak.db", agent.pid):
                time.sleep(SOAK_S / 2)
                (d / "go-flood").touch()
                _say("flood workload started")
                time.sleep(SOAK_S / 2)
        finally:
            agent.send_signal(signal.SIGTERM)
            rc = agent.wait(120)
            for wl in (real, flood):
                wl.kill()
                wl.wait()
        text = log.read_text()
        if os.environ.get("SOAK_LOG"):
            Path(os.environ["SOAK_LOG"]).write_text(text)
        stored, span = _store_order(d / "soak.db")
        final_size = _on_disk(d / "soak.db")
    closed = re.search(r"writer closed: .*", text)
    if rc != 0 or closed is None:
        raise SystemExit(f"agent exited {rc} without its closing line:\n{text[-3000:]}")
    phases = [_phase("realistic", run, 0, SOAK_S / 2), _phase("flood", run, SOAK_S / 2, SOAK_S)]
    oldest = [ts for _, ts in sorted(run.oldest)]
    backwards = sum(1 for a, b in zip(oldest, oldest[1:], strict=False) if b < a)
    pruned = run.samples[-1].pruned if run.samples else 0
    biggest = max([s.db_file + s.wal for s in run.samples] + [final_size])
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; run "
          f"{SOAK_S:g} s, cap {CAP} ({cap} bytes), {len(run.queries)} queries answered, "
          f"{run.failed} failed")
    for p in phases:
        print(f"{p.name:9s}: {p.rate:8.0f} records/s; RSS slope {p.rss_slope:+.1f} MB/h "
              f"(anon {p.anon_slope:+.1f}); "
              f"db+wal {p.db_slope:+.3g} B/h; query p99 {p.p99_start_ms:.1f} -> "
              f"{p.p99_end_ms:.1f} ms; fds {p.fds[0]} -> {p.fds[1]}; threads "
              f"{p.threads[0]} -> {p.threads[1]}; CPU per record {p.us_per_event[0]:.2f} -> "
              f"{p.us_per_event[1]:.2f} us")
    rss = [s.rss_mb for s in run.samples]
    print(f"RSS {rss[0]:.1f} MB at the first sample, {max(rss):.1f} MB at most, "
          f"{rss[-1]:.1f} MB at the end; the writer's queue held at most "
          f"{max(s.queue_rows for s in run.samples):.0f} rows")
    print(f"pruning: {pruned:.0f} events (fleetd_events_pruned_total); {stored} stored in one "
          f"id range of {span} (contiguous: {stored == span}); oldest stored time moved "
          f"backwards {backwards} times over {len(oldest)} looks; the agent said: "
          f"{closed.group(0)}")
    if run.fd_lists:
        from collections import Counter
        a, b = Counter(run.fd_lists[0][1]), Counter(run.fd_lists[-1][1])
        _say(f"fds added {sorted((b - a).items())} removed {sorted((a - b).items())}")
        for t, fl in run.fd_lists:
            kinds = Counter(x.split(":")[0] if ":" in x else x for x in fl)
            _say(f"fds t={t:.0f} {len(fl)}: {sorted(kinds.items())}")
    worst = max(phases, key=lambda p: p.rss_slope)
    print(f"BENCH soak rss_slope_mb_per_h={worst.rss_slope:.1f} "
          f"db_bytes_per_h={max(p.db_slope for p in phases):.0f} "
          f"db_over_cap={biggest / cap:.2f} "
          f"p99_growth={max(p.p99_growth for p in phases):.2f} "
          f"fds_growth={max(p.fds[1] - p.fds[0] for p in phases)} "
          f"threads_growth={max(p.threads[1] - p.threads[0] for p in phases)} "
          f"cpu_us_per_event_growth={max(p.cpu_growth for p in phases):.2f}")


if __name__ == "__main__":
    main()
