"""Fleet fan-out: client CPU per node, agent CPU per query, latency behind a link delay at
32 namespace agents against one, and a thousand endpoints with dead and hung ones.

Two parts, one run:

1. **Namespace agents behind a link delay.** Each of ``--nodes`` real ``fleetd agent``
   processes (TLS 1.3, mTLS, certificates from ``fleetd certs``, its own small database)
   runs in its own network namespace, cabled to a bridge like separate hosts; this
   process runs in a client namespace on the same bridge. Our kernels have no ``netem``
   qdisc (``tc qdisc add ... netem`` answers "Specified qdisc kind is unknown"), so the
   link delay is a small delaying TCP relay (bench/_delay.py) in each agent's namespace:
   it listens on the namespace's address and hands every chunk on to the agent on the
   namespace's loopback ``--delay-ms`` later, in each direction. Latency therefore
   includes the network, and the ratio against one node (same run, same query, same
   delay) measures fan-out rather than CPU sharing. Measured twice per size: *cold with
   resumption* (what ``fleetd query`` does on each run: a new client, one connection
   per node resumed from the per-user ticket cache) and *warm* (one client kept open
   across queries, as the MCP server and ``fleetd watch`` do).
2. **A thousand endpoints, the client's side alone.** bench/_endpoints.py is a TEST
   DOUBLE, not an agent: one process holding 1,000+ mTLS endpoints that answer like an
   agent from canned rows. Run A: 1,000 endpoints of which 5% are dead (connection
   refused), timeout 5 s; its median latency is the figure. Run B: 1,000 with 1% hung
   (they accept, finish TLS, read the request and never answer): the answer must arrive
   at the timeout, not later, with every hung endpoint named in the warnings; the
   benchmark fails if one is not named, and prints CHECK MISSED when the answer came
   more than 0.5 s from the timeout (a timing on a shared box is a figure, not a fault).

Figures: client CPU is this process's CPU time (the whole fan-out runs on its event
loop) divided by the nodes asked; agent CPU is the agents' utime+stime (from
/proc/PID/stat) over the warm queries divided by queries x nodes. Everything shares this
machine's cores with whatever else runs, so read the ratios, and repeat.

Last line: ``BENCH fanout client_cpu_ms_per_node=C agent_cpu_ms_per_query=A
ratio_32=R32 p50_1000_s=P``, every figure on warm connections (the steady state of a
long-running client; the cold-with-resumption figures, what each ``fleetd query`` pays,
are printed above it): C = client CPU per node at ``--nodes`` namespace agents, A =
agent CPU per query, R32 = median latency at ``--nodes`` over one node, P = median
latency at 1,000 endpoints with 5% dead.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import resource
import shutil
import signal
import sqlite3
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleetd.fleet.client import ClientOptions, FleetClient  # noqa: E402
from fleetd.fleet.fanout import FleetOptions  # noqa: E402
from fleetd.fleet.queries import FleetResult, QuerySpec, query_async  # noqa: E402
from fleetd.fleet.targets import Target  # noqa: E402
from fleetd.runner import run_loop  # noqa: E402
from fleetd.security import sessions, tls  # noqa: E402
from fleetd.store.catalog import op_code  # noqa: E402
from fleetd.store.writer import BatchWriter  # noqa: E402

PY = str(REPO / ".venv" / "bin" / "python")
FLEETD = str(REPO / ".venv" / "bin" / "fleetd")
SQL = "SELECT op, count(*) AS n, avg(dur_ns) AS mean_ns FROM events GROUP BY op"
EVENTS = 2_000
PREFIX = "fbf"  # namespaces made here: fbf<pid>-...
SUBNET = "10.232.0"  # exists only inside this benchmark's namespaces
PORT = 7600
CLONE_NEWNET = 0x40000000
LISTEN_RE = re.compile(r"listening on https://127\.0\.0\.1:7600")


# ---- setup ----------------------------------------------------------------------------


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def make_pki(d: Path, addresses: list[str]) -> tuple[Path, Path, Path, Path, Path]:
    def certs(*args: str) -> None:
        subprocess.run([FLEETD, "certs", "--dir", str(d), *args], check=True,
                       capture_output=True)

    certs("init-ca")
    sans = [x for a in ["127.0.0.1", *addresses] for x in ("--san", a)]
    certs("issue-node", "bench-node", *sans)  # one certificate for every address
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


class Net:
    """A hub namespace with a bridge, a client namespace and one namespace per host."""

    def __init__(self, hosts: int) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.hub, self.client = f"{self.tag}-hub", f"{self.tag}-c"
        self.hosts = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{10 + i}" for i in range(hosts)]
        self.made: list[str] = []

    def up(self) -> None:
        _remove_stale()
        self._ns(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        self._attach(self.client, "vc", f"{SUBNET}.1")
        for i, (ns, addr) in enumerate(zip(self.hosts, self.addresses, strict=True)):
            self._attach(ns, f"v{i}", addr)

    def _ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.made.append(name)

    def _attach(self, ns: str, hub_end: str, address: str) -> None:
        self._ns(ns)
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", hub_end,
           "netns", self.hub)
        sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def enter_client(self) -> None:
        """Move this process (its only thread, so far) into the client namespace; the
        processes it starts from now on begin there too."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{self.client}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the client namespace failed")
        finally:
            os.close(fd)

    def down(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _remove_stale() -> None:
    """Namespaces of an earlier run that was killed before it could clean up."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-.*", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def spawn(ns: str | None, argv: list[str], log: Path) -> Proc:
    prefix = ["nsenter", f"--net=/run/netns/{ns}"] if ns else []
    with log.open("wb") as fh:
        proc = subprocess.Popen([*prefix, *argv], stdout=fh, stderr=subprocess.STDOUT)
    return Proc(log.stem, proc, log)


def wait_for(procs: list[Proc], ready: Callable[[str], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        p = pending[0]
        text = p.log.read_text(errors="replace")
        if ready(text):
            pending.pop(0)
        elif p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited: {text[-2000:]}")
        elif time.monotonic() > deadline:
            raise RuntimeError(f"{p.name} did not start in {timeout:g} s: {text[-2000:]}")
        else:
            time.sleep(0.05)


def stop(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(10)


def idle(p: Proc, limit_s: float = 15.0) -> None:
    """Wait (at most ``limit_s``) until ``p`` uses under a tenth of a CPU."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = cpu_s([p])
        time.sleep(0.2)
        if cpu_s([p]) - before < 0.02:
            return


def cpu_s(procs: list[Proc]) -> float:
    """User + system CPU these processes have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in procs:
        fields = Path(f"/proc/{p.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


# ---- measuring ------------------------------------------------------------------------


@dataclass
class Timing:
    walls: list[float]
    cpus: list[float]  # client CPU per query, s
    last: FleetResult | None = None

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpus)


def _spec(timeout_s: float) -> QuerySpec:
    return QuerySpec(SQL, [], timeout_s=timeout_s)


def cold(opts: FleetOptions, reps: int, ctx_factory: Callable[[], ssl.SSLContext],
         check: Callable[[FleetResult], None]) -> Timing:
    """Each rep as one ``fleetd query``: a new context (read from the ticket cache, as a
    new process would), a new client, its tickets saved on exit. Context creation (file
    reads) is counted."""
    t = Timing([], [])
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        o = replace(opts, client=replace(opts.client, ssl=ctx_factory()))

        async def go(o: FleetOptions = o) -> FleetResult:
            async with FleetClient(o.client) as client:
                return await query_async(o, _spec(o.client.timeout_s), client)

        result: FleetResult = run_loop(go())
        t.walls.append(time.perf_counter() - w0)
        t.cpus.append(time.process_time() - c0)
        check(result)
        t.last = result
    return t


def warm(opts: FleetOptions, reps: int, check: Callable[[FleetResult], None]) -> Timing:
    async def go() -> Timing:
        t = Timing([], [])
        async with FleetClient(opts.client) as client:
            await query_async(opts, _spec(opts.client.timeout_s), client)  # connects
            for _ in range(reps):
                c0, w0 = time.process_time(), time.perf_counter()
                result = await query_async(opts, _spec(opts.client.timeout_s), client)
                t.walls.append(time.perf_counter() - w0)
                t.cpus.append(time.process_time() - c0)
                check(result)
                t.last = result
        return t

    timing: Timing = run_loop(go())
    return timing


def complete(n: int) -> Callable[[FleetResult], None]:
    def check(result: FleetResult) -> None:
        if result.exit_code != 0 or len({r[0] for r in result.rows}) != n:
            raise RuntimeError(f"fleet query of {n} node(s) was not complete: "
                               f"{[w.to_json() for w in result.warnings][:3]}")
    return check


def partial(missing: set[str], kind: str) -> Callable[[FleetResult], None]:
    """Each ``missing`` node is named in the warnings with ``kind``."""
    def check(result: FleetResult) -> None:
        # A machine too busy to reach every endpoint before the deadline names the
        # unreached ones as timed out: still named, which is what is checked.
        named = {w.node for w in result.warnings if w.kind in (kind, "timeout")}
        if not missing <= named:
            raise RuntimeError(f"{len(missing - named)} of the {len(missing)} {kind} "
                               f"endpoints are not named as such: "
                               f"{[w.to_json() for w in result.warnings][:3]}")
    return check


def _interleave(live: list[Target], odd: list[Target]) -> list[Target]:
    """The odd ones spread evenly through the list, as failures are in a real fleet."""
    out = list(live)
    step = len(out) // max(1, len(odd)) + 1
    for i, t in enumerate(odd):
        out.insert(i * step + step // 2, t)
    return out


def answered(result: FleetResult | None) -> int:
    return len({r[0] for r in result.rows}) if result is not None else 0


def no_check(result: FleetResult) -> None:
    pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=32, help="namespace agents")
    p.add_argument("--delay-ms", type=float, default=5.0, help="one way, per link")
    p.add_argument("--endpoints", type=int, default=1000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=5.0, help="the fan-out's, seconds")
    p.add_argument("--concurrency", type=int, default=64,
                   help="requests in flight (the config's default is 64)")
    a = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 1,000+ connections
    work = Path(tempfile.mkdtemp(prefix="fleetd-bench-fanout-"))
    os.environ[sessions.CACHE_ENV] = str(work / "tls-cache")  # not the user's own cache
    net = Net(a.nodes)
    procs: list[Proc] = []
    try:
        started = time.perf_counter()
        ca, cert, key, ccert, ckey = make_pki(work / "certs", net.addresses)
        dbs = make_dbs(work, a.nodes)
        net.up()
        net.enter_client()
        agents = [spawn(ns, [FLEETD, "agent", "--no-trace", "--db", str(db), "--node", db.stem,
                             "--listen", f"127.0.0.1:{PORT}", "--tls-cert", str(cert),
                             "--tls-key", str(key), "--client-ca", str(ca)],
                        work / f"{db.stem}.log")
                  for ns, db in zip(net.hosts, dbs, strict=True)]
        relays = [spawn(ns, [PY, str(REPO / "bench" / "_delay.py"), "--listen",
                             f"{addr}:{PORT}", "--to", f"127.0.0.1:{PORT}", "--delay-ms",
                             str(a.delay_ms)], work / f"delay-{i}.log")
                  for i, (ns, addr) in enumerate(zip(net.hosts, net.addresses, strict=True))]
        hung_n, dead_n = a.endpoints // 100, a.endpoints // 20
        good_n = a.endpoints - hung_n
        double = spawn(None, [PY, str(REPO / "bench" / "_endpoints.py"), "--cert", str(cert),
                              "--key", str(key), "--ca", str(ca), "--good", str(good_n),
                              "--dead", str(dead_n), "--hung", str(hung_n)],
                       work / "endpoints.log")
        procs = [*agents, *relays, double]
        wait_for(relays, lambda t: "ready" in t, 60)
        wait_for([double], lambda t: t.startswith("{"), 90)
        wait_for(agents, lambda t: LISTEN_RE.search(t) is not None, 100)
        ports = json.loads(double.log.read_text().splitlines()[0])
        print(f"{a.nodes} namespace agents behind {a.delay_ms:g} ms links and "
              f"{good_n + dead_n + hung_n} test-double endpoints up in "
              f"{time.perf_counter() - started:.1f} s; {os.cpu_count()} CPUs", flush=True)

        def ctx() -> ssl.SSLContext:
            return tls.client_context(ca, ccert, ckey)

        def fleet(targets: list[Target], ssl_ctx: ssl.SSLContext) -> FleetOptions:
            return FleetOptions(tuple(targets), ClientOptions(
                ssl_ctx, timeout_s=a.timeout, concurrency=a.concurrency,
                has_client_cert=True))

        # -- part 1: namespace agents behind the delay ---------------------------------
        ns_targets = [Target(db.stem, addr, PORT) for db, addr in zip(dbs, net.addresses,
                                                                      strict=True)]
        ns: dict[int, tuple[Timing, Timing]] = {}
        agent_cpu: dict[str, float] = {}
        for n in (1, a.nodes):
            opts = fleet(ns_targets[:n], ctx())
            cold(opts, 1, ctx, complete(n))  # tickets into the cache; agents' caches warm
            before = cpu_s(agents[:n])
            c = cold(opts, a.reps, ctx, complete(n))
            mid, relay_mid = cpu_s(agents[:n]), cpu_s(relays[:n])
            w = warm(opts, a.reps * 2, complete(n))
            after = cpu_s(agents[:n])
            ns[n] = (c, w)
            agent_cpu[f"cold{n}"] = (mid - before) / (a.reps * n)
            agent_cpu[f"warm{n}"] = (after - mid) / ((a.reps * 2 + 1) * n)
            agent_cpu[f"relay{n}"] = (cpu_s(relays[:n]) - relay_mid) / ((a.reps * 2 + 1) * n)
        (c1, w1), (cn, wn) = ns[1], ns[a.nodes]
        print(f"\nnamespace agents, {a.delay_ms:g} ms each way (round trip "
              f"{2 * a.delay_ms:g} ms + TLS and HTTP), small query, medians of "
              f"{a.reps} (cold) / {2 * a.reps} (warm):")
        print(f"{'nodes':>6} {'cold ms':>8} {'ratio':>6} {'client CPU ms/node':>19} "
              f"{'warm ms':>8} {'ratio':>6} {'client CPU ms/node':>19}")
        for n, (c, w) in ns.items():
            print(f"{n:>6} {c.wall * 1e3:>8.1f} {c.wall / c1.wall:>6.2f} "
                  f"{c.cpu * 1e3 / n:>19.3f} {w.wall * 1e3:>8.1f} {w.wall / w1.wall:>6.2f} "
                  f"{w.cpu * 1e3 / n:>19.3f}")
        print(f"agent CPU per small query at {a.nodes} nodes: warm "
              f"{agent_cpu[f'warm{a.nodes}'] * 1e3:.2f} ms, cold with resumption "
              f"{agent_cpu[f'cold{a.nodes}'] * 1e3:.2f} ms (one node: warm "
              f"{agent_cpu['warm1'] * 1e3:.2f} ms)")
        cores = os.cpu_count() or 1
        per_node = agent_cpu[f"warm{a.nodes}"] + agent_cpu[f"relay{a.nodes}"] + wn.cpu / a.nodes
        print(f"CPU floor of a warm query at {a.nodes} nodes on these {cores} cores: "
              f"{a.nodes} x (agent {agent_cpu[f'warm{a.nodes}'] * 1e3:.2f} + delay relay "
              f"{agent_cpu[f'relay{a.nodes}'] * 1e3:.2f} + client {wn.cpu / a.nodes * 1e3:.2f}"
              f" ms) / {cores} = {a.nodes * per_node / cores * 1e3:.1f} ms, plus the "
              f"{2 * a.delay_ms:g} ms round trip; measured {wn.wall * 1e3:.1f} ms")

        # -- part 2: the test double's 1,000 endpoints -----------------------------------
        good = [Target(f"ep{i:04d}", "127.0.0.1", port) for i, port in enumerate(ports["good"])]
        dead = [Target(f"dead{i:03d}", "127.0.0.1", port) for i, port in enumerate(ports["dead"])]
        hung = [Target(f"hung{i:03d}", "127.0.0.1", port) for i, port in enumerate(ports["hung"])]
        run_a = _interleave(good[: a.endpoints - dead_n], dead)
        opts_a = fleet(run_a, ctx())
        check_a = partial({t.name for t in dead}, "refused")
        first = cold(opts_a, 1, ctx, no_check)  # full handshakes; tickets into the cache
        # A run cut off by its deadline leaves the double a backlog (handshakes and
        # requests of connections already given up): let it drain before each run.
        idle(double)
        double_before = cpu_s([double])
        big_warm = warm(opts_a, max(3, a.reps // 2), check_a)
        double_cpu = (cpu_s([double]) - double_before) / (max(3, a.reps // 2) + 1)
        idle(double)
        big_cold = cold(opts_a, max(3, a.reps // 2), ctx, check_a)
        live_a = len(run_a) - dead_n
        print(f"\n{a.endpoints} test-double endpoints, {dead_n} dead (refused), timeout "
              f"{a.timeout:g} s, concurrency {a.concurrency}:")
        for what, t in (("first (full handshakes)", first), ("cold with resumption", big_cold),
                        ("warm", big_warm)):
            print(f"  {what:<24} median {t.wall:.3f} s, {answered(t.last)} of {live_a} live "
                  f"answered, client CPU {t.cpu * 1e3 / a.endpoints:.3f} ms per node")
        print(f"  CPU floor of a warm query: client {big_warm.cpu:.3f} s + test double "
              f"{double_cpu:.3f} s on {os.cpu_count()} cores")

        idle(double)
        run_b = _interleave(good[: a.endpoints - hung_n], hung)
        hung_names = {t.name for t in hung}
        hung_t = cold(fleet(run_b, ctx()), 1, ctx, partial(hung_names, "timeout"))
        assert hung_t.last is not None
        ready = hung_t.last.answer.elapsed_s  # the fan-out's answer, merged
        late = ready - a.timeout
        ok = -0.5 <= late <= 0.5
        print(f"{a.endpoints} endpoints, {hung_n} hung: fan-out answer ready after {ready:.3f} s "
              f"(timeout {a.timeout:g} s, {late * 1e3:+.0f} ms), command done (tickets "
              f"saved, {len(run_b)} connections closed) after {hung_t.walls[0]:.3f} s; all "
              f"{hung_n} hung endpoints named as timed out: yes; {answered(hung_t.last)} of "
              f"{len(run_b) - hung_n} live answered; at the timeout: {'yes' if ok else 'NO'}")
        if not ok:
            # A timing miss on a shared 2-core box is a figure to report, not a broken
            # bench: only a hung endpoint left unnamed (checked above) fails the run.
            print(f"CHECK MISSED: the hung run's answer came {late:+.3f} s from its timeout "
                  "(allowed: within 0.5 s)")

        client_cpu = wn.cpu / a.nodes
        ratio = wn.wall / w1.wall
        print(f"\ntargets (warm): client CPU per node <= 0.5 ms: {client_cpu * 1e3:.3f} "
              f"(cold with resumption {cn.cpu / a.nodes * 1e3:.3f}); agent CPU per query "
              f"<= 2 ms: {agent_cpu[f'warm{a.nodes}'] * 1e3:.2f} (cold "
              f"{agent_cpu[f'cold{a.nodes}'] * 1e3:.2f}); ratio at {a.nodes} <= 1.5: "
              f"{ratio:.2f} (cold {cn.wall / c1.wall:.2f}); p50 at {a.endpoints} <= 1.0 s: "
              f"{big_warm.wall:.3f} (cold {big_cold.wall:.3f})")
        print(f"BENCH fanout client_cpu_ms_per_node={client_cpu * 1e3:.3f} "
              f"agent_cpu_ms_per_query={agent_cpu[f'warm{a.nodes}'] * 1e3:.2f} "
              f"ratio_32={ratio:.2f} p50_1000_s={big_warm.wall:.3f}")
        return 0
    finally:
        stop(procs)
        net.down()
        shutil.rmtree(work, ignore_errors=True)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


if __name__ == "__main__":
    raise SystemExit(main())
