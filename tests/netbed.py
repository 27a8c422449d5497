"""A multi-host test bed on one machine: hosts as network namespaces, one agent each.

Layout (everything lives in namespaces this module creates; the root namespace gets no
address, route or bridge, so no test traffic can leave the machine)::

    client ns (10.231.0.1) --veth--+
    host ns h0 (10.231.0.10) -veth-+-- bridge br0 in the hub ns
    host ns h1 (10.231.0.11) -veth-+
    ...

Each host gets node certificates from ``fleetd certs`` (SAN = its address), an agent
listening on ADDRESS:7600 with mTLS, and optionally the reference workload inside the
host's own CPU slice: a cgroup with a CFS quota (cgroup v1 ``cpu`` controller when it is
mounted, else cgroup v2 ``cpu.max``), pinned to the host's CPUs. A noisy process put in
that slice then competes with that host's workload only, as on a separate machine.

Processes enter a namespace with ``nsenter --net``, not ``ip netns exec``: the latter
also remounts /sys, which hides /sys/kernel/tracing (the tracer needs it) and
/sys/fs/cgroup.

Teardown (:meth:`NetBed.close`, also on errors and from the pytest fixture) kills every
process the bed started, deletes its namespaces (their veths go with them) and removes
its cgroups. Beds left behind by a test run that was killed are removed on the next
start: names carry the creating process id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

log = logging.getLogger("fleetd.tests.netbed")

REPO = Path(__file__).resolve().parents[1]
FLEETD = str(REPO / ".venv" / "bin" / "fleetd")
PY = str(REPO / ".venv" / "bin" / "python")
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
PREFIX = "fnb"  # every namespace and cgroup this module makes starts with it
SUBNET = "10.231.0"  # a private range that exists only inside the bed's namespaces
PORT = 7600
CFS_PERIOD_US = 100_000
LISTEN_RE = re.compile(r"listening on (https?)://([\d.]+):(\d+)")
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def why_no_bpf() -> str | None:
    """None when this machine can trace (root, bcc, tracefs), else the reason: the skip
    reason of every test that loads BPF programs."""
    if os.geteuid() != 0:
        return "tracing needs root"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc (python3-bpfcc) is not installed"
    if not Path("/sys/kernel/tracing/events").exists():
        return "tracefs is not mounted at /sys/kernel/tracing"
    return None


def why_unavailable() -> str | None:
    """None when this machine can host a bed, else the reason (for a skip message)."""
    if os.geteuid() != 0:
        return "network namespaces and cgroups need root"
    for tool in ("ip", "nsenter"):
        if not any(Path(d, tool).exists() for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")):
            return f"{tool} is not installed"
    if CpuSlices.detect() is None:
        return "no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 cpu.max) is available"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


# ---- CPU slices ---------------------------------------------------------------------------


@dataclass
class CpuSlices:
    """A parent cgroup for one bed, with one CPU-quota child per host."""

    root: Path  # the cpu controller's mount point (v1) or the cgroup2 mount
    v2: bool
    made: list[Path] = field(default_factory=list)

    @staticmethod
    def detect() -> CpuSlices | None:
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists():
            return CpuSlices(v1, v2=False)
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                mount = Path(parts[1])
                controllers = mount / "cgroup.controllers"
                if controllers.exists() and "cpu" in controllers.read_text().split():
                    return CpuSlices(mount, v2=True)
        return None

    def make(self, relative: str, quota: float | None = None) -> Path:
        """Create root/relative; with ``quota`` (CPUs, e.g. 0.25), cap it."""
        path = self.root / relative
        path.mkdir(parents=True, exist_ok=True)
        self.made.append(path)
        if self.v2:
            # A child gets a cpu.max only if its parent hands the controller down.
            self._enable_cpu(path.parent)
        if quota is not None:
            quota_us = max(1000, int(quota * CFS_PERIOD_US))
            if self.v2:
                (path / "cpu.max").write_text(f"{quota_us} {CFS_PERIOD_US}\n")
            else:
                (path / "cpu.cfs_period_us").write_text(f"{CFS_PERIOD_US}\n")
                (path / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
        return path

    def _enable_cpu(self, parent: Path) -> None:
        chain = []
        p = parent
        while p != self.root and self.root in p.parents:
            chain.append(p)
            p = p.parent
        for d in [self.root, *reversed(chain)]:
            ctl = d / "cgroup.subtree_control"
            if "cpu" not in ctl.read_text().split():
                ctl.write_text("+cpu\n")

    def usage_us(self, path: Path) -> float:
        """CPU time used by the slice so far, in microseconds."""
        if self.v2:
            for line in (path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return float(value)
            return 0.0
        acct = Path("/sys/fs/cgroup/cpuacct") / path.relative_to(self.root) / "cpuacct.usage"
        return int(acct.read_text()) / 1000 if acct.exists() else 0.0

    def throttled(self, path: Path) -> int:
        for line in (path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("nr_throttled",):
                return int(value)
        return 0

    def remove_all(self) -> None:
        _rmdirs(self.made)
        self.made.clear()


def _rmdirs(paths: list[Path]) -> None:
    # Children before parents; a cgroup with live tasks refuses rmdir (EBUSY), so retry
    # briefly while killed processes finish exiting.
    for path in sorted(set(paths), key=lambda p: len(p.parts), reverse=True):
        for _ in range(50):
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)
        else:
            log.warning("could not remove cgroup %s (tasks still inside?)", path)


def split_cpus() -> tuple[set[int], set[int]]:
    """(CPUs for the hosts' workload slices, CPUs for agents and the client).

    The agents and their tracers are the measuring instrument: on a small machine they
    would otherwise preempt the workloads they measure and show up as every host's CPU
    culprit. So the slices get the upper half of the CPUs and everything else the rest;
    the quotas keep the slices from starving one another on their shared CPUs.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return set(cpus), set(cpus)
    half = len(cpus) // 2
    return set(cpus[half:]), set(cpus[:half])


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Move every thread of pid onto cpus (affinity is per thread; children inherit)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, OSError):
            os.sched_setaffinity(int(task.name), cpus)


def _enter(cgroup: Path | None, cpus: set[int] | None) -> Callable[[], None]:
    """preexec_fn: join the cgroup and the CPU set before exec, so no instant runs outside."""
    def go() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
        if cpus:
            os.sched_setaffinity(0, cpus)
    return go


# ---- hosts ------------------------------------------------------------------------------


@dataclass
class Host:
    index: int
    name: str  # node name, also the certificate's name
    ns: str  # network namespace
    address: str
    cpus: set[int]
    slice: Path | None = None
    agent: subprocess.Popen[str] | None = None
    agent_log: Path | None = None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{PORT}"

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.ns}"


class NetBed:
    """N hosts on one bridge, a client namespace, certificates, agents and workloads."""

    def __init__(self, workdir: Path, hosts: int, *, quota: float = 0.25,
                 names: Sequence[str] | None = None) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tag = f"{PREFIX}{os.getpid()}x{next(_serial)}"
        self.quota = quota
        self.hub = f"{self.tag}-hub"
        self.client_ns = f"{self.tag}-client"
        self.client_address = f"{SUBNET}.1"
        self.slice_cpus, self.infra_cpus = split_cpus()
        self.all_cpus = self.slice_cpus | self.infra_cpus
        labels = list(names or [f"host-{i}" for i in range(hosts)])
        self.hosts = [
            Host(i, labels[i], f"{self.tag}-h{i}", f"{SUBNET}.{10 + i}", self.slice_cpus)
            for i in range(hosts)
        ]
        self.namespaces: list[str] = []
        self.slices = CpuSlices.detect()
        self.certs = self.dir / "certs"
        self._procs: list[subprocess.Popen[str]] = []
        self._logs: list[IO[str]] = []

    # -- setup --------------------------------------------------------------------------

    def start(self) -> NetBed:
        remove_stale()
        try:
            self._network()
            self._cgroups()
            self._pki()
        except BaseException:
            self.close()
            raise
        return self

    def _network(self) -> None:
        self._netns(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        self._attach(self.client_ns, "vc", self.client_address)
        for h in self.hosts:
            self._attach(h.ns, f"v{h.index}", h.address)

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)

    def _attach(self, ns: str, hub_end: str, address: str) -> None:
        """A namespace with lo up and eth0 (ADDRESS/24) cabled to the hub's bridge."""
        self._netns(ns)
        # Created directly inside the two namespaces: nothing appears in the root one.
        _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth",
             "peer", "name", hub_end, "netns", self.hub)
        _run("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _cgroups(self) -> None:
        if self.slices is None:
            raise RuntimeError("no cgroup cpu controller")
        self.slices.make(self.tag)
        for h in self.hosts:
            h.slice = self.slices.make(f"{self.tag}/{h.name}", self.quota)

    def _pki(self) -> None:
        def certs(*args: str) -> subprocess.Popen[str]:
            return subprocess.Popen([FLEETD, "certs", "--dir", str(self.certs), *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        _wait_ok([certs("init-ca")])
        _wait_ok([certs("issue-node", h.name, "--san", h.address) for h in self.hosts]
                 + [certs("issue-client", "laptop")])

    # -- processes ----------------------------------------------------------------------

    def spawn(self, host: Host | None, argv: Sequence[str], *, in_slice: bool = False,
              env: dict[str, str] | None = None, log_name: str | None = None,
              stdout: int | None = None, cpus: set[int] | None = None
              ) -> subprocess.Popen[str]:
        """Run argv in a host's namespace (None: the client's), optionally in its slice.

        Slice processes run on the slice CPUs; the rest on ``cpus``, by default the
        infrastructure CPUs.
        """
        ns = host.ns if host else self.client_ns
        # stderr always goes to a file: a pipe nobody reads could fill up and block.
        name = log_name or f"spawn-{len(self._procs)}.err"
        fh = (self.dir / name).open("w")
        self._logs.append(fh)
        out: int | IO[str] = fh if log_name else (stdout if stdout is not None
                                                  else subprocess.DEVNULL)
        slice_ = host.slice if (host and in_slice) else None
        if host and in_slice:
            cpus = host.cpus
        elif cpus is None:
            cpus = self.infra_cpus
        proc: subprocess.Popen[str] = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{ns}", *argv], stdout=out,
            stderr=subprocess.STDOUT if log_name else fh, text=True,
            env={**os.environ, **(env or {})}, preexec_fn=_enter(slice_, cpus),
        )
        self._procs.append(proc)
        if host:
            host.procs.append(proc)
        return proc

    def start_agent(self, host: Host, *, db: Path, trace_pid: int | None = None,
                    env: dict[str, str] | None = None, extra: Sequence[str] = ()) -> None:
        """``fleetd agent`` in the host's namespace on ADDRESS:7600, mTLS with the bed's CA;
        tracing ``trace_pid``, or serving ``db`` as is without one."""
        cert, key = self.certs / f"{host.name}.pem", self.certs / f"{host.name}.key"
        argv = [FLEETD, "agent", "--db", str(db), "--node", host.name,
                "--listen", host.endpoint, "--tls-cert", str(cert), "--tls-key", str(key),
                "--client-ca", str(self.certs / "ca.pem"), *extra]
        argv += ["--pid", str(trace_pid)] if trace_pid else ["--no-trace"]
        host.agent_log = self.dir / f"agent-{host.name}.log"
        host.agent = self.spawn(host, argv, env=env, log_name=host.agent_log.name,
                                cpus=self.all_cpus)

    def wait_agents(self, hosts: Sequence[Host] | None = None, timeout: float = 120) -> None:
        """Block until each agent printed its listening line (it traces by then), then
        move all its threads onto the infrastructure CPUs.

        Agents start on every CPU, because compiling the BPF programs is the slow part
        of their start and the workloads are still waiting for their go-file then.
        """
        deadline = time.monotonic() + timeout
        for h in hosts or self.hosts:
            assert h.agent is not None and h.agent_log is not None
            while not LISTEN_RE.search(h.agent_log.read_text()):
                if h.agent.poll() is not None:
                    raise RuntimeError(f"agent {h.name} exited {h.agent.returncode}: "
                                       f"{h.agent_log.read_text()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agent {h.name} did not start: "
                                       f"{h.agent_log.read_text()}")
                time.sleep(0.05)
            pin_threads(h.agent.pid, self.infra_cpus)

    def start_workload(self, host: Host, args: Sequence[str], go_file: Path
                       ) -> subprocess.Popen[str]:
        """The reference workload in the host's slice; it waits for go_file to start."""
        proc = self.spawn(host, [PY, str(WORKLOAD), "--go-file", str(go_file), *args],
                          in_slice=True, stdout=subprocess.PIPE)
        return proc

    def start_hog(self, host: Host, comm: str = "fleetd-hog") -> subprocess.Popen[str]:
        """A busy loop named ``comm`` in the host's slice, on the host's CPUs."""
        code = (f"import ctypes; ctypes.CDLL(None).prctl(15, {comm.encode()!r}, 0, 0, 0)\n"
                "while True: pass")
        return self.spawn(host, [PY, "-c", code], in_slice=True)

    def client(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
        """Run ``fleetd ARGS`` in the client namespace (the laptop)."""
        return subprocess.run(["nsenter", f"--net=/run/netns/{self.client_ns}", FLEETD,
                               *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})

    def client_tls_args(self) -> list[str]:
        return ["--ca-cert", str(self.certs / "ca.pem"),
                "--client-cert", str(self.certs / "laptop.pem"),
                "--client-key", str(self.certs / "laptop.key")]

    def nodes_arg(self, hosts: Sequence[Host] | None = None) -> str:
        return ",".join(h.endpoint for h in hosts or self.hosts)

    def write_config(self, path: Path, *, timeout_s: float = 10.0) -> Path:
        """A fleetd.yaml whose fleet section names every host."""
        lines = ["fleet:", "  nodes:"]
        lines += [f"    - {{name: {h.name}, address: '{h.endpoint}'}}" for h in self.hosts]
        lines += [f"  ca: {self.certs / 'ca.pem'}",
                  f"  client_cert: {self.certs / 'laptop.pem'}",
                  f"  client_key: {self.certs / 'laptop.key'}",
                  f"  timeout_s: {timeout_s}", "  connect_timeout_s: 2"]
        path.write_text("\n".join(lines) + "\n")
        return path

    # -- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """Kill what we started, delete namespaces and cgroups. Safe to call twice."""
        for proc in self._procs:
            _kill(proc)
        self._procs.clear()
        for fh in self._logs:
            with contextlib.suppress(Exception):
                fh.close()
        self._logs.clear()
        for ns in reversed(self.namespaces):
            _delete_netns(ns)
        self.namespaces.clear()
        if self.slices is not None:
            self.slices.remove_all()

    def __enter__(self) -> NetBed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_serial = iter(range(1, 1 << 30))


def _wait_ok(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        out, err = p.communicate(timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"{p.args!r} failed: {err or out}")


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL works on stopped processes too; nothing here needs a graceful exit."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()


def _delete_netns(ns: str) -> None:
    proc = _run("ip", "netns", "del", ns, check=False)
    if proc.returncode != 0 and "No such file" not in proc.stderr:
        log.warning("could not delete namespace %s: %s", ns, proc.stderr.strip())


def remove_stale() -> None:
    """Delete namespaces and cgroups of beds whose creating process is gone."""
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    pattern = re.compile(rf"^({PREFIX}(\d+)x\d+)-\S+")
    stale: set[str] = set()
    for line in listed:
        m = pattern.match(line.strip())
        if m and not Path(f"/proc/{m.group(2)}").exists():
            stale.add(line.split()[0])
    for ns in sorted(stale):
        log.warning("removing namespace %s left by a dead test run", ns)
        _delete_netns(ns)
    slices = CpuSlices.detect()
    if slices is None:
        return
    for d in slices.root.glob(f"{PREFIX}*x*"):
        m = re.match(rf"^{PREFIX}(\d+)x\d+$", d.name)
        if m and d.is_dir() and not Path(f"/proc/{m.group(1)}").exists():
            _rmdirs([*(p for p in d.iterdir() if p.is_dir()), d])


@contextlib.contextmanager
def netbed(workdir: Path, hosts: int, **kw: object) -> Iterator[NetBed]:
    bed = NetBed(workdir, hosts, **kw)  # type: ignore[arg-type]
    bed.start()
    try:
        yield bed
    finally:
        bed.close()


if __name__ == "__main__":  # python tests/netbed.py N: bring a bed up, wait, tear down
    import tempfile

    logging.basicConfig(level=logging.INFO)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with tempfile.TemporaryDirectory() as d, netbed(Path(d), n) as bed:
        print("namespaces:", bed.namespaces)
        input("press enter to tear down ")
