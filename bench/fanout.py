"""Fleet query latency for 1, 8, 32 and 128 agents on loopback, against one node.

Every agent is a real ``fleetd agent`` process serving its own small database over
TLS 1.3 with mTLS (certificates from ``fleetd certs``). A *cold* query is what
``fleetd query --nodes ...`` does after its interpreter has started: a new client
session (every TLS handshake paid), the SQL on every node, five clock samples per node
beside it, the merge. A *warm* query is the same on a session kept open across queries
(what a long-running client such as an MCP server would do): no handshakes. The
baseline is the same query against one node, measured in the same run; ratios divide
by it. Client CPU time (this process: the whole fan-out runs on its event loop) is
reported per node.

All agents and the client share this machine's cores. On a 2-core box every node's
work (its handshakes, its SQL) runs on the same two cores as every other node's and as
the client, so N nodes cost about N times one node's CPU, spread over two cores.

Last line: ``BENCH fanout ratio_32=R ratio_128=R`` (cold: the CLI's behaviour).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleetd.fleet.client import ClientOptions, FleetClient  # noqa: E402
from fleetd.fleet.fanout import FleetOptions  # noqa: E402
from fleetd.fleet.queries import FleetResult, QuerySpec, query, query_async  # noqa: E402
from fleetd.fleet.targets import Target  # noqa: E402
from fleetd.runner import run_loop  # noqa: E402
from fleetd.security import tls  # noqa: E402
from fleetd.store.catalog import op_code  # noqa: E402
from fleetd.store.writer import BatchWriter  # noqa: E402

FLEETD = str(REPO / ".venv" / "bin" / "fleetd")
LISTEN_RE = re.compile(r"listening on https://127\.0\.0\.1:(\d+)")
SQL = "SELECT op, count(*) AS n, avg(dur_ns) AS mean_ns FROM events GROUP BY op"
EVENTS = 2_000


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int = 0


def make_pki(d: Path) -> tuple[Path, Path, Path, Path, Path]:
    def certs(*args: str) -> None:
        subprocess.run([FLEETD, "certs", "--dir", str(d), *args], check=True,
                       capture_output=True)

    certs("init-ca")
    certs("issue-node", "bench-node", "--san", "127.0.0.1")
    certs("issue-client", "bench-client")
    return (d / "ca.pem", d / "bench-node.pem", d / "bench-node.key", d / "bench-client.pem",
            d / "bench-client.key")


def make_dbs(d: Path, n: int) -> list[Path]:
    """One template written by the real writer, copied and renamed per node."""
    template = d / "template.db"
    ops = [op_code(o) for o in ("cudaLaunchKernel", "cudaMemcpyAsync",
                                "cudaStreamSynchronize", "off_cpu")]
    t0 = time.time_ns() - EVENTS * 1_000_000
    rows = [(t0 + i * 1_000_000, 5_000 + (i % 50) * 100, 4242, 4242, ops[i % 4], 0, 0, 0, 0,
             0, 0) for i in range(EVENTS)]
    with BatchWriter(template, "template") as w:
        w.add_processes([{"pid": 4242, "comm": "train_loop"}])
        w.add_events(rows)
    with sqlite3.connect(template) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    out = []
    for i in range(n):
        path = d / f"n{i:03d}.db"
        shutil.copyfile(template, path)
        with sqlite3.connect(path) as c:
            c.execute("UPDATE nodes SET name = ?", (f"n{i:03d}",))
        out.append(path)
    return out


def start_agents(d: Path, dbs: list[Path], ca: Path, cert: Path, key: Path) -> list[Agent]:
    agents = []
    for db in dbs:
        name = db.stem
        log = d / f"{name}.log"
        with log.open("wb") as fh:
            proc = subprocess.Popen(
                [FLEETD, "agent", "--no-trace", "--db", str(db), "--node", name,
                 "--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key),
                 "--client-ca", str(ca)], stdout=fh, stderr=subprocess.STDOUT)
        agents.append(Agent(name, proc, log))
    deadline = time.monotonic() + 120
    for a in agents:
        while not a.port:
            m = LISTEN_RE.search(a.log.read_text())
            if m:
                a.port = int(m.group(1))
            elif a.proc.poll() is not None:
                raise RuntimeError(f"agent {a.name} exited: {a.log.read_text()}")
            elif time.monotonic() > deadline:
                raise RuntimeError(f"agent {a.name} did not start")
            else:
                time.sleep(0.05)
    return agents


def stop_agents(agents: list[Agent]) -> None:
    for a in agents:
        if a.proc.poll() is None:
            a.proc.send_signal(signal.SIGKILL)
    for a in agents:
        a.proc.wait(10)


def rss_mib(agents: list[Agent]) -> float:
    total = 0
    for a in agents:
        for line in Path(f"/proc/{a.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


Timing = tuple[float, float, float]  # median wall s, median client CPU s, worst wall s


def _check(result: FleetResult, n: int) -> None:
    if result.exit_code != 0 or len({r[0] for r in result.rows}) != n:
        raise RuntimeError(f"fleet query of {n} node(s) was not complete: "
                           f"{[w.to_json() for w in result.warnings][:3]}")


def _summary(walls: list[float], cpus: list[float]) -> Timing:
    return statistics.median(walls), statistics.median(cpus), max(walls)


def agent_cpu_s(agents: list[Agent]) -> float:
    """User + system CPU the agents have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for a in agents:
        fields = Path(f"/proc/{a.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def measure_cold(opts: FleetOptions, n: int, reps: int) -> Timing:
    spec = QuerySpec(SQL, [], timeout_s=5.0)
    query(opts, spec)  # warm-up: the agents' reader connections and page cache
    walls, cpus = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        result = query(opts, spec)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        _check(result, n)
    return _summary(walls, cpus)


async def _warm(opts: FleetOptions, n: int, reps: int) -> Timing:
    spec = QuerySpec(SQL, [], timeout_s=5.0)
    walls, cpus = [], []
    async with FleetClient(opts.client) as client:
        await query_async(opts, spec, client)  # opens every connection once
        for _ in range(reps):
            c0, w0 = time.process_time(), time.perf_counter()
            result = await query_async(opts, spec, client)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
            _check(result, n)
    return _summary(walls, cpus)


def measure_warm(opts: FleetOptions, n: int, reps: int) -> Timing:
    timing: Timing = run_loop(_warm(opts, n, reps))
    return timing


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,8,32,128")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--concurrency", type=int, default=64,
                   help="requests in flight (the config's default is 64)")
    p.add_argument("--skew-samples", type=int, default=None,
                   help="clock samples per node (default: the client's)")
    a = p.parse_args()
    sizes = sorted({int(x) for x in a.sizes.split(",")})
    work = Path(tempfile.mkdtemp(prefix="fleetd-bench-fanout-"))
    agents: list[Agent] = []
    try:
        ca, cert, key, ccert, ckey = make_pki(work / "certs")
        t = time.perf_counter()
        dbs = make_dbs(work, max(sizes))
        agents = start_agents(work, dbs, ca, cert, key)
        print(f"{len(agents)} agents up in {time.perf_counter() - t:.1f} s, "
              f"{rss_mib(agents) / len(agents):.0f} MiB RSS each, {os.cpu_count()} CPUs",
              flush=True)
        ctx = tls.client_context(ca, ccert, ckey)
        cold: dict[int, Timing] = {}
        warm: dict[int, Timing] = {}
        agent_cpu: dict[int, float] = {}  # per node per cold query, seconds
        for n in sizes:
            targets = tuple(Target(x.name, "127.0.0.1", x.port) for x in agents[:n])
            client = ClientOptions(ctx, timeout_s=30.0, concurrency=a.concurrency,
                                   has_client_cert=True)
            opts = FleetOptions(targets, client)
            if a.skew_samples is not None:
                opts = FleetOptions(targets, client, skew_samples=a.skew_samples)
            # More repetitions where a run is short: the 1-node baseline is the divisor.
            reps = a.reps * 2 if n == 1 else a.reps if n <= 32 else max(5, a.reps // 2)
            before = agent_cpu_s(agents[:n])
            cold[n] = measure_cold(opts, n, reps)
            agent_cpu[n] = (agent_cpu_s(agents[:n]) - before) / (reps + 1) / n
            warm[n] = measure_warm(opts, n, reps)
        base, wbase = cold[sizes[0]][0], warm[sizes[0]][0]
        print(f"\n{'':>5}  {'---------- cold (as the CLI) ----------':>40}  "
              f"{'-------- warm session --------':>30}")
        print(f"{'nodes':>5}  {'median ms':>9} {'worst ms':>8} {'ratio':>6} {'CPU ms/node':>12}  "
              f"{'median ms':>9} {'ratio':>6} {'CPU ms/node':>12}")
        for n in sizes:
            (cw, cc, cx), (ww, wc, _) = cold[n], warm[n]
            print(f"{n:>5}  {cw * 1e3:>9.1f} {cx * 1e3:>8.1f} {cw / base:>6.2f} "
                  f"{cc * 1e3 / n:>12.2f}  {ww * 1e3:>9.1f} {ww / wbase:>6.2f} "
                  f"{wc * 1e3 / n:>12.2f}")
        print(f"\nbaseline: one node, {base * 1e3:.1f} ms cold, {wbase * 1e3:.1f} ms warm "
              "(same run, same query); targets: ratio <= 1.5 at 32, <= 3 at 128")
        big = sizes[-1]
        client_cpu = cold[big][1] / big
        bound = big * (client_cpu + agent_cpu[big]) / (os.cpu_count() or 1)
        print(f"note: a cold query costs {client_cpu * 1e3:.2f} ms of client CPU and "
              f"{agent_cpu[big] * 1e3:.2f} ms of agent CPU per node (mostly two TLS 1.3 "
              "handshakes: the query's connection and the clock samples'). With "
              f"{os.cpu_count()} CPUs shared by the client and every agent, {big} nodes "
              f"cannot answer in less than {big} x that / {os.cpu_count()} = "
              f"{bound * 1e3:.0f} ms here (measured {cold[big][0] * 1e3:.0f} ms); on real "
              f"hosts the agents' share runs in parallel and the client's "
              f"{big * client_cpu * 1e3:.0f} ms is the floor")
        ratio = {n: cold[n][0] / base for n in sizes}
        print(f"BENCH fanout ratio_32={ratio.get(32, float('nan')):.2f} "
              f"ratio_128={ratio.get(128, float('nan')):.2f}")
        return 0
    finally:
        stop_agents(agents)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
