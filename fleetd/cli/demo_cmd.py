"""``fleetd demo``: a three-node fleet on loopback, one node slowed by a CPU hog.

Everything is real: a fresh CA and certificates from ``fleetd certs``, three
``fleetd agent`` daemons tracing three copies of the reference workload and three
ranks of a distributed job (tests/workloads/nccl_ranks.py: the real libnccl, the
ranks in lockstep over TCP) with eBPF,
mTLS fan-out with ``fleetd query --nodes`` and ``fleetd explain --nodes``, then
``fleetd merge`` and ``fleetd export``. The demo drives fleetd's own commands as a user
would type them, and prints each one before it runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetd.errors import FleetdError, TraceError, UsageError
from fleetd.store.timeparse import parse_duration

NODES = ("node-1", "node-2", "node-3")
SLOW = "node-3"  # the node whose workload shares its CPU with a hog
HOG_NAME = "cpu-hog"
AGENT_START_S = 180


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run a local 3-node fleet on loopback and find the straggler",
        description="Start three fleetd agents on loopback with fresh certificates, trace "
        "the reference workload on each (one node's CPU shared with a hog), then show the "
        "fleet query, the straggler and why, and write a merged database and a Perfetto "
        "timeline. Needs root (eBPF).",
    )
    p.add_argument("--dir", type=Path, default=Path("fleet-demo"),
                   help="working directory for certificates, node databases and logs "
                   "(default: ./fleet-demo)")
    p.add_argument("-o", "--output", dest="out", type=Path, default=Path("."), metavar="DIR",
                   help="where fleet-demo.db and fleet-demo.json go (default: .)")
    p.add_argument("--out", dest="out", type=Path, help=argparse.SUPPRESS)  # the old name
    p.add_argument("--duration", default="20s", help="how long to trace (default 20s)")
    p.set_defaults(func=run)


@dataclass
class Fleet:
    dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        for a in self.agents.values():
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
        for a in self.agents.values():
            try:
                a.wait(30)
            except subprocess.TimeoutExpired:
                a.kill()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            with suppress(subprocess.TimeoutExpired):
                p.wait(10)


def _fleetd() -> list[str]:
    exe = Path(sys.argv[0])
    if exe.name == "fleetd" and exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "fleetd"]


def _say(text: str) -> None:
    print(text, flush=True)


def _show(cmd: list[str], *, check: bool = True, quiet: bool = False) -> int:
    """Run one of fleetd's own commands, echoing it the way a user would type it."""
    shown = ["fleetd", *cmd[len(_fleetd()):]] if cmd[: len(_fleetd())] == _fleetd() else cmd
    if not quiet:
        _say(f"\n$ {shlex.join(shown)}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None,
                          stderr=subprocess.STDOUT if quiet else None)
    if check and proc.returncode not in (0,):
        raise FleetdError(f"{shlex.join(shown)} exited with {proc.returncode}",
                          "see the output above; the node logs are in the demo directory")
    return proc.returncode


def _workload(name: str = "train_loop.py") -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "tests" / "workloads" / name
        if candidate.exists():
            return candidate
    raise UsageError(f"the workload tests/workloads/{name} was not found",
                     "run fleetd demo from a fleetd source checkout (make demo)")


def _preflight() -> None:
    if os.geteuid() != 0:
        raise TraceError("fleetd demo traces with eBPF and must run as root",
                         "run: sudo make demo (or sudo .venv/bin/fleetd demo)")
    try:
        import bcc  # noqa: F401
    except ImportError:
        raise TraceError("the bcc Python package (Debian's python3-bpfcc) is not importable",
                         "run bash scripts/setup.sh, which installs it and links it into "
                         ".venv") from None
    if not Path("/sys/kernel/tracing/events").exists():
        raise TraceError("tracefs is not mounted at /sys/kernel/tracing",
                         "mount -t tracefs tracefs /sys/kernel/tracing (setup.sh does this)")


def _certs(d: Path) -> None:
    base = [*_fleetd(), "certs", "--dir", str(d)]
    _show([*base, "init-ca", "--force"], quiet=True)
    for n in NODES:
        _show([*base, "issue-node", n, "--san", "127.0.0.1", "--force"], quiet=True)
    _show([*base, "issue-client", "demo-client", "--force"], quiet=True)


def _pin(cpu: int) -> None:
    # Runs in the child before exec: the workload (and the hog) stay on one CPU.
    with suppress(OSError):
        os.sched_setaffinity(0, {cpu})


def _hog_setup(cpu: int) -> None:
    # A noisy neighbour with a higher priority (nice -10): on its CPU it gets about 90%
    # whenever both want to run, so the node it shares with really falls behind.
    _pin(cpu)
    with suppress(OSError):
        os.nice(-10)


def _node_cpus() -> dict[str, int]:
    """The CPU each node's processes run on: the slow node's is the last one, which it
    shares with the hog."""
    cpus = sorted(os.sched_getaffinity(0))
    last = cpus[-1]
    others = [c for c in cpus if c != last] or [last]
    return {n: last if n == SLOW else others[i % len(others)] for i, n in enumerate(NODES)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_ranks(fleet: Fleet, seconds: float) -> dict[str, subprocess.Popen[bytes]]:
    """Rank i of a 3-rank job on node i, as torchrun would start it: collectives on the
    real libnccl in lockstep, 1 ms of work and 8 ms "on the GPU" per step. Waits until
    each has loaded libnccl, so its agent attaches to it."""
    job = {"WORLD_SIZE": str(len(NODES)), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "TORCHELASTIC_RUN_ID": "fleetd-demo"}
    cpus = _node_cpus()
    ranks: dict[str, subprocess.Popen[bytes]] = {}
    for i, n in enumerate(NODES):
        log = (fleet.dir / f"{n}.rank.log").open("wb")
        p = subprocess.Popen(
            [sys.executable, str(_workload("nccl_ranks.py")), "--seconds", str(seconds + 30),
             "--compute-ms", "1", "--sleep-ms", "8", "--go-file", str(fleet.dir / f"{n}.go"),
             "--barrier-timeout", str(int(seconds) + 60), "--max-listed", "0"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **job, "RANK": str(i), "LOCAL_RANK": "0"},
            preexec_fn=functools.partial(_pin, cpus[n]))
        fleet.procs.append(p)
        ranks[n] = p
    deadline = time.monotonic() + 60
    for n, p in ranks.items():
        while '"ready"' not in (fleet.dir / f"{n}.rank.log").read_text(errors="replace"):
            if p.poll() is not None or time.monotonic() > deadline:
                text = (fleet.dir / f"{n}.rank.log").read_text(errors="replace").strip()
                raise TraceError(f"rank {NODES.index(n)} of the NCCL job did not start:\n"
                                 f"{text}", "is the nvidia-nccl-cu12 wheel installed? run "
                                 "bash scripts/setup.sh")
            time.sleep(0.1)
    return ranks


def _start_workloads(fleet: Fleet, seconds: float) -> dict[str, subprocess.Popen[bytes]]:
    """One workload per node; the slow node's shares the last CPU with a busy loop."""
    cpus = _node_cpus()
    last = cpus[SLOW]
    wl: dict[str, subprocess.Popen[bytes]] = {}
    for n in NODES:
        cpu = cpus[n]
        log = (fleet.dir / f"{n}.workload.log").open("wb")
        p = subprocess.Popen(
            [sys.executable, str(_workload()), "--duration", str(seconds + 30),
             "--launches", "8", "--memcpy", "1", "--cpu-us", "100", "--gpu-ms", "4",
             "--go-file", str(fleet.dir / f"{n}.go")],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=functools.partial(_pin, cpu))
        fleet.procs.append(p)
        wl[n] = p
    hog = subprocess.Popen(
        [sys.executable, "-c",
         # prctl(PR_SET_NAME) names the hog, so the culprit reads well in explain
         "import ctypes; ctypes.CDLL(None).prctl(15, b'" + HOG_NAME + "', 0, 0, 0)\n"
         "while True: pass"], preexec_fn=functools.partial(_hog_setup, last))
    fleet.procs.append(hog)
    return wl


def _start_agents(fleet: Fleet, wl: dict[str, subprocess.Popen[bytes]],
                  ranks: dict[str, subprocess.Popen[bytes]]) -> None:
    d = fleet.dir
    for n in NODES:
        db = d / f"{n}.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        log = (d / f"{n}.agent.log").open("wb")
        fleet.agents[n] = subprocess.Popen(
            [*_fleetd(), "agent", "--node", n, "--db", str(db), "--listen", "127.0.0.1:0",
             "--pid", str(wl[n].pid), "--pid", str(ranks[n].pid), "--sample", "10",
             "--tls-cert", str(d / f"{n}.pem"),
             "--tls-key", str(d / f"{n}.key"), "--client-ca", str(d / "ca.pem")],
            stdout=log, stderr=subprocess.STDOUT)
    # Compiling the BPF programs is the slow part: about 5 s of CPU per agent on a quiet
    # machine, all three at once on two cores; a busy machine takes several times that.
    deadline = time.monotonic() + AGENT_START_S
    pattern = re.compile(r"listening on https://([\d.]+:\d+)")
    while len(fleet.addresses) < len(NODES):
        for n, a in fleet.agents.items():
            text = (d / f"{n}.agent.log").read_text(errors="replace")
            if a.poll() is not None:
                raise TraceError(f"the agent of {n} exited ({a.returncode}):\n{text.strip()}",
                                 "run fleetd check for what this machine lacks")
            # The agent announces its address only once its tracer is attached.
            if m := pattern.search(text):
                fleet.addresses[n] = m.group(1)
        if time.monotonic() > deadline:
            raise TraceError(f"the agents did not start tracing within {AGENT_START_S} s",
                             f"see the logs in {d}")
        time.sleep(0.2)


def _progress(seconds: float) -> None:
    start = time.monotonic()
    width = 30
    tty = sys.stdout.isatty()
    # A bar redrawn in place on a terminal; into a log, a line every 5 s instead.
    step = 0.5 if tty else 5.0
    while (left := seconds - (time.monotonic() - start)) > 0:
        done = int(width * (1 - left / seconds))
        line = f"  tracing [{'#' * done}{'.' * (width - done)}] {left:4.0f} s left"
        sys.stdout.write(f"\r{line} " if tty else f"{line}\n")
        sys.stdout.flush()
        time.sleep(min(step, left))
    sys.stdout.write(f"\r  tracing [{'#' * width}] done{' ' * 14}\n")


def run(args: argparse.Namespace) -> int:
    seconds = parse_duration(args.duration) / 1e9
    _preflight()
    d: Path = args.dir.resolve()
    d.mkdir(parents=True, exist_ok=True)
    out: Path = args.out.resolve()
    merged, trace = out / "fleet-demo.db", out / "fleet-demo.json"
    fleet = Fleet(d)
    _say(f"fleetd demo: 3 agents on loopback, {SLOW}'s CPU shared with a busy loop "
         f"({HOG_NAME}); files in {d}")
    _say("[1/7] fleet CA and certificates (fleetd certs)")
    _certs(d)
    try:
        _say("[2/7] on each node the reference workload and one rank of a 3-rank NCCL "
             "job, agents tracing them with eBPF")
        wl = _start_workloads(fleet, seconds)
        ranks = _start_ranks(fleet, seconds)
        _start_agents(fleet, wl, ranks)
        for n in NODES:
            (d / f"{n}.go").touch()
        for n in NODES:
            _say(f"  {n}: agent on https://{fleet.addresses[n]} (mTLS), tracing pid "
                 f"{wl[n].pid} (workload) and pid {ranks[n].pid} (rank {NODES.index(n)})")
        _say(f"[3/7] tracing for {seconds:g} s")
        _progress(seconds)
        nodes = ",".join(f"{n}={a}" for n, a in fleet.addresses.items())
        tls = ["--ca-cert", str(d / "ca.pem"), "--client-cert", str(d / "demo-client.pem"),
               "--client-key", str(d / "demo-client.key")]
        _say("[4/7] one query, every node (fan-out over mTLS, clock skew corrected)")
        _show([*_fleetd(), "query", "--nodes", nodes, *tls, "--show-skew",
               "SELECT op, count(*) AS calls, round(avg(dur_ns) / 1000.0, 1) AS avg_us "
               "FROM events WHERE source = 'cuda' GROUP BY op ORDER BY calls DESC"])
        _say("\n[5/7] which node is the straggler, and why")
        _show([*_fleetd(), "explain", "--nodes", nodes, *tls], check=False)
        verdict = _explain_json([*_fleetd(), "explain", "--nodes", nodes, *tls,
                                 "--format", "json"], out / "fleet-demo-explain.json")
        _say("\n[6/7] the fleet as one Perfetto timeline, straight from the agents")
        trace.unlink(missing_ok=True)
        _show([*_fleetd(), "export", "--format", "perfetto", "--nodes", nodes, *tls,
               "-o", str(trace)])
    finally:
        fleet.stop()
    _say("\n[7/7] the node databases merged into one file, as an air-gapped cluster would")
    for f in (merged, Path(f"{merged}-wal"), Path(f"{merged}-shm")):
        f.unlink(missing_ok=True)
    _show([*_fleetd(), "merge", *(str(d / f"{n}.db") for n in NODES), "-o", str(merged)])
    _say("")
    for line in summary_lines(verdict, [merged, trace, out / "fleet-demo-explain.json"]):
        _say(line)
    return 0


def _explain_json(cmd: list[str], dest: Path) -> dict[str, Any]:
    """The fleet explain as JSON, kept in ``dest``; {} when it could not be had."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        doc = json.loads(proc.stdout) if proc.returncode == 0 else {}
    except ValueError:
        doc = {}
    if isinstance(doc, dict) and doc:
        dest.write_text(json.dumps(doc, indent=1) + "\n")
        return doc
    return {}


def _top_chains(verdict: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each node's first chain (the list comes most severe first)."""
    top: dict[str, dict[str, Any]] = {}
    for chain in verdict.get("chains") or []:
        if isinstance(chain, dict) and isinstance(chain.get("node"), str):
            top.setdefault(chain["node"], chain)
    return top


def _culprit_text(chain: dict[str, Any]) -> str:
    c = chain.get("culprit")
    if not isinstance(c, dict):
        return "no culprit process"
    return f"culprit {c.get('comm', '?')} pid {c.get('pid', '?')}"


def summary_lines(verdict: dict[str, Any], files: list[Path]) -> list[str]:
    """At most 12 lines: who is late, each node's top cause, the files, what next."""
    lines = ["Summary (the full explain is above, and as JSON in the file below):"]
    ranks = [s for s in verdict.get("stragglers") or []
             if isinstance(s, dict) and s.get("metric") == "collective_arrival"]
    nodes = [s for s in verdict.get("stragglers") or []
             if isinstance(s, dict) and s.get("flagged") and s.get("metric") !=
             "collective_arrival"]
    if ranks:
        r = ranks[0]
        lines.append(f"  straggler: rank {r.get('rank')} on {r.get('node')} (pid {r.get('pid')}), "
                     f"last in {float(r.get('share_last') or 0):.0%} of the collectives")
    if nodes:
        lines.append(f"  straggler node: {nodes[0].get('node')} ({nodes[0].get('metric')})")
    if not ranks and not nodes:
        lines.append("  no straggler named (see the explain above)")
    for node, chain in sorted(_top_chains(verdict).items())[:3]:
        lines.append(f"  {node}: [{chain.get('severity')}] {chain.get('root_cause')}, "
                     f"{_culprit_text(chain)}")
    lines.append("  written: " + ", ".join(str(f) for f in files[:2]))
    lines.append(f"           {files[2]}" if len(files) > 2 else "")
    lines.append("  next: .venv/bin/fleetd explain --db " + str(files[0]))
    lines.append("        .venv/bin/fleetd ops --db " + str(files[0]) + " --per-process")
    lines.append("        README.md: agents on real nodes with certificates (fleetd certs)")
    return [line for line in lines if line][:12]
