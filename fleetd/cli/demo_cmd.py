"""``fleetd demo``: a three-node fleet on loopback, one node slowed by a CPU hog.

Everything is real: a fresh CA and certificates from ``fleetd certs``, three
``fleetd agent`` daemons tracing the three ranks of a distributed job
(tests/workloads/nccl_ranks.py: the real libnccl and CUDA runtime, the ranks in
lockstep over TCP, a step of host work and of "GPU" time each) with eBPF, one rank per
node in a CPU share of its own (a cgroup cpuset and CPU limit, fleetd.cli.demo_slices)
with the hog inside node-3's. A node runs its rank alone, as a GPU node runs its job:
a second process of its own beside the rank (the demo once ran the reference workload
there too) shared the hog's CPU with it, and on two cores took turns with the rank so
that each was named the other's culprit instead of the hog.
mTLS fan-out with ``fleetd query --nodes`` and ``fleetd explain --nodes``, then
``fleetd merge`` and ``fleetd export``. The demo drives fleetd's own commands as a user
would type them, and prints each one before it runs.

It tells the truth about itself: every part it starts is checked, a part that failed is
said on the terminal with its reason, the summary repeats the one explain answer step 5
showed, only files that exist are listed, and the demo exits 1 when its headline (the
NCCL rank the others wait for) could not be shown.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from fleetd.cli.demo_slices import Slices, pin
from fleetd.errors import FleetdError, TraceError, UsageError
from fleetd.store.timeparse import format_ns, parse_duration

NODES = ("node-1", "node-2", "node-3")
SLOW = "node-3"  # the node whose CPU share holds a hog
HOG_NAME = "cpu-hog"
HOG_NICE = -10  # within its share the hog gets ~90 % whenever both want to run
# Compiling the BPF programs: about 30 s for the three agents on a quiet 2-core machine,
# several minutes on a loaded one.
AGENT_START_S = 480
TICK_S = 5.0  # a progress line this often when stdout is not a terminal
RANKS_OUTLAST_S = 900  # past the traced window: the query, explain and export


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run a local 3-node fleet on loopback and find the straggler",
        description="Start three fleetd agents on loopback with fresh certificates, trace "
        "one rank of a 3-rank NCCL job on each (one node's CPU shared with a hog), then show the "
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
    # What the demo started, by what it is to the user, with the log that says why it
    # ended (none for the hog).
    parts: dict[str, tuple[subprocess.Popen[bytes], Path | None]] = field(
        default_factory=dict)
    reported: list[str] = field(default_factory=list)  # failures said on the terminal

    def failures(self) -> list[str]:
        """One line per part that ended badly: what it was, its exit status, and the last
        line of its log (a rank's 'no go-file within 80 s')."""
        out = []
        for what, (p, log) in self.parts.items():
            code = p.poll()
            if code is None or (code == 0 and log is not None):
                continue  # running, or a rank that finished its run
            why = _last_line(log) if log is not None else "it should run until the end"
            out.append(f"{what} (pid {p.pid}) exited with {code}: {why}")
        return out

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


def _workload(name: str) -> Path:
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
    from fleetd.trace.host.require import require_tracing

    # The same words as trace and agent: right for a pip install and for a checkout.
    require_tracing("fleetd demo")
    if not Path("/sys/kernel/tracing/events").exists():
        raise TraceError("tracefs is not mounted at /sys/kernel/tracing",
                         "mount -t tracefs tracefs /sys/kernel/tracing (setup.sh does this)")


def _certs(d: Path) -> None:
    base = [*_fleetd(), "certs", "--dir", str(d)]
    _show([*base, "init-ca", "--force"], quiet=True)
    for n in NODES:
        _show([*base, "issue-node", n, "--san", "127.0.0.1", "--force"], quiet=True)
    _show([*base, "issue-client", "demo-client", "--force"], quiet=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_ranks(fleet: Fleet, slices: Slices, seconds: float
                 ) -> dict[str, subprocess.Popen[bytes]]:
    """Rank i of a 3-rank job on node i, as torchrun would start it: collectives on the
    real libnccl in lockstep, 1 ms of work and 8 ms "on the GPU" per step. Waits until
    each has loaded libnccl, so its agent attaches to it. They wait for the go-file as
    long as the agents may take to start, plus the run."""
    job = {"WORLD_SIZE": str(len(NODES)), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "TORCHELASTIC_RUN_ID": "fleetd-demo"}
    ranks: dict[str, subprocess.Popen[bytes]] = {}
    for i, n in enumerate(NODES):
        log = (fleet.dir / f"{n}.rank.log").open("wb")
        p = subprocess.Popen(
            # They run until the demo stops them: a rank that ends before is a failure.
            [sys.executable, str(_workload("nccl_ranks.py")), "--seconds",
             str(int(seconds + RANKS_OUTLAST_S)),
             "--compute-ms", "1", "--sleep-ms", "8", "--go-file", str(fleet.dir / f"{n}.go"),
             "--barrier-timeout", str(int(AGENT_START_S + seconds + 60)), "--max-listed", "0"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **job, "RANK": str(i), "LOCAL_RANK": "0"},
            preexec_fn=slices.enter(n))
        fleet.procs.append(p)
        fleet.parts[f"{n}: rank {i} of the NCCL job"] = (p, fleet.dir / f"{n}.rank.log")
        ranks[n] = p
    deadline = time.monotonic() + 60
    for n, p in ranks.items():
        while '"ready"' not in (fleet.dir / f"{n}.rank.log").read_text(errors="replace"):
            if p.poll() is not None or time.monotonic() > deadline:
                text = (fleet.dir / f"{n}.rank.log").read_text(errors="replace").strip()
                raise TraceError(f"rank {NODES.index(n)} of the NCCL job did not start:\n"
                                 f"{text}", "is the nvidia-nccl-cu12 wheel installed? pip "
                                 "install nvidia-nccl-cu12 (make demo installs it in a "
                                 "checkout)")
            time.sleep(0.1)
    return ranks


def _start_hog(fleet: Fleet, slices: Slices) -> None:
    """The busy loop in the slow node's share; started once the agents trace, so it
    does not slow their compile."""
    hog = subprocess.Popen(
        [sys.executable, "-c",
         # prctl(PR_SET_NAME) names the hog, so the culprit reads well in explain
         "import ctypes; ctypes.CDLL(None).prctl(15, b'" + HOG_NAME + "', 0, 0, 0)\n"
         "while True: pass"], preexec_fn=slices.enter(SLOW, nice=HOG_NICE))
    fleet.procs.append(hog)
    fleet.parts[f"{SLOW}: {HOG_NAME}"] = (hog, None)


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError as exc:
        return f"its log {log} cannot be read ({exc.strerror})"
    return f"{lines[-1].strip()} (log: {log})" if lines else f"nothing in its log {log}"


def _start_agents(fleet: Fleet, slices: Slices,
                  ranks: dict[str, subprocess.Popen[bytes]]) -> None:
    d = fleet.dir
    for n in NODES:
        db = d / f"{n}.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        log = (d / f"{n}.agent.log").open("wb")
        fleet.agents[n] = subprocess.Popen(
            [*_fleetd(), "agent", "--node", n, "--db", str(db), "--listen", "127.0.0.1:0",
             "--pid", str(ranks[n].pid), "--sample", "10",
             "--tls-cert", str(d / f"{n}.pem"),
             "--tls-key", str(d / f"{n}.key"), "--client-ca", str(d / "ca.pem")],
            stdout=log, stderr=subprocess.STDOUT)
    start = time.monotonic()
    ticker = Ticker()
    pattern = re.compile(r"listening on https://([\d.]+:\d+)")
    while len(fleet.addresses) < len(NODES):
        for n, a in fleet.agents.items():
            text = (d / f"{n}.agent.log").read_text(errors="replace")
            if a.poll() is not None:
                raise TraceError(f"the agent of {n} exited ({a.returncode}):\n{text.strip()}",
                                 "run fleetd check for what this machine lacks")
            # The agent announces its address only once its tracer is attached.
            if n not in fleet.addresses and (m := pattern.search(text)):
                fleet.addresses[n] = m.group(1)
                # Compiled (on every CPU): from now on it measures, off the slow node's.
                pin(a.pid, slices.agent_cpus)
        waited = time.monotonic() - start
        ticker.say(f"  compiling the agents' BPF programs: {len(fleet.addresses)} of "
                   f"{len(NODES)} tracing after {waited:.0f} s")
        if failed := fleet.failures():
            raise TraceError("a part of the demo failed while the agents started:\n  "
                             + "\n  ".join(failed), f"see the logs in {d}")
        if waited > AGENT_START_S:
            raise TraceError(f"the agents did not start tracing within {AGENT_START_S} s",
                             f"see the logs in {d}; fleetd check times this machine's "
                             "BPF compile")
        time.sleep(0.2)
    ticker.done(f"  {len(NODES)} agents tracing after {time.monotonic() - start:.0f} s")


class Ticker:
    """A progress line: redrawn in place on a terminal, else printed every TICK_S."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.last = time.monotonic()

    def say(self, line: str) -> None:
        if self.tty:
            sys.stdout.write(f"\r{line}  ")
        elif time.monotonic() - self.last >= TICK_S:
            sys.stdout.write(f"{line}\n")
            self.last = time.monotonic()
        else:
            return
        sys.stdout.flush()

    def done(self, line: str) -> None:
        sys.stdout.write(f"\r{line}{' ' * 20}\n" if self.tty else f"{line}\n")
        sys.stdout.flush()


def _show_ticking(cmd: list[str], what: str) -> None:
    """:func:`_show` for a command that takes a while: a progress line as it runs."""
    shown = ["fleetd", *cmd[len(_fleetd()):]]
    _say(f"\n$ {shlex.join(shown)}")
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    ticker = Ticker()
    while proc.poll() is None:
        ticker.say(f"  {what}: {time.monotonic() - start:.0f} s")
        time.sleep(0.2)
    if proc.returncode != 0:
        raise FleetdError(f"{shlex.join(shown)} exited with {proc.returncode}",
                          "see the output above; the node logs are in the demo directory")
    ticker.done(f"  {what}: done in {time.monotonic() - start:.0f} s")


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
    explained = out / "fleet-demo-explain.json"
    for stale in (trace, explained):  # an earlier run's files are not this run's
        stale.unlink(missing_ok=True)
    fleet = Fleet(d)
    _say(f"fleetd demo: 3 agents on loopback, a busy loop ({HOG_NAME}) inside {SLOW}'s CPU "
         f"share; files in {d}")
    _say("[1/7] fleet CA and certificates (fleetd certs)")
    _certs(d)
    slices = Slices.create(NODES, SLOW)
    try:
        shares = ", ".join(f"{n} {slices.label(n)}" for n in NODES)
        _say("[2/7] on each node one rank of a 3-rank NCCL job, its agent tracing it with "
             f"eBPF; each node in its own CPU share "
             f"({slices.kind()}: {shares})")
        ranks = _start_ranks(fleet, slices, seconds)
        _start_agents(fleet, slices, ranks)
        _start_hog(fleet, slices)
        for n in NODES:
            (d / f"{n}.go").touch()
        began = time.time_ns()
        for n in NODES:
            _say(f"  {n}: agent on https://{fleet.addresses[n]} (mTLS), tracing pid "
                 f"{ranks[n].pid} (rank {NODES.index(n)})")
        _say(f"[3/7] tracing for {seconds:g} s")
        _progress(seconds)
        window = ["--from", format_ns(began), "--to", format_ns(time.time_ns())]
        _check_parts(fleet)
        nodes = ",".join(f"{n}={a}" for n, a in fleet.addresses.items())
        tls = ["--ca-cert", str(d / "ca.pem"), "--client-cert", str(d / "demo-client.pem"),
               "--client-key", str(d / "demo-client.key")]
        _say("[4/7] one query, every node (fan-out over mTLS, clock skew corrected)")
        _show([*_fleetd(), "query", "--nodes", nodes, *tls, "--show-skew",
               "SELECT op, count(*) AS calls, round(avg(dur_ns) / 1000.0, 1) AS avg_us "
               "FROM events WHERE source IN ('cuda', 'nccl') GROUP BY op ORDER BY calls DESC"])
        _say("\n[5/7] which node is the straggler, and why (the traced window)")
        verdict = _explain([*_fleetd(), "explain", "--nodes", nodes, *tls, *window,
                            "--format", "json", "-o", str(explained)], explained)
        _say("\n[6/7] the fleet as one Perfetto timeline, straight from the agents")
        _show_ticking([*_fleetd(), "export", "--format", "perfetto", "--nodes", nodes, *tls,
                       "-o", str(trace)], "exporting the fleet's events")
        _check_parts(fleet)
    finally:
        fleet.stop()
        slices.remove()
    _say("\n[7/7] the node databases merged into one file, as an air-gapped cluster would")
    for f in (merged, Path(f"{merged}-wal"), Path(f"{merged}-shm")):
        f.unlink(missing_ok=True)
    _show([*_fleetd(), "merge", *(str(d / f"{n}.db") for n in NODES), "-o", str(merged)])
    _say("")
    for line in summary_lines(verdict, [f for f in (merged, trace, explained) if f.exists()],
                              window):
        _say(line)
    if why := headline_missing(verdict, fleet.reported):
        print(f"fleetd: error: the demo could not show its headline, the NCCL rank the "
              f"others wait for: {why}", file=sys.stderr)
        return 1
    return 0


def _check_parts(fleet: Fleet) -> None:
    """Say on the terminal, once, each part that failed since the last look."""
    for line in fleet.failures():
        if line not in fleet.reported:
            fleet.reported.append(line)
            _say(f"  FAILED {line}")


def _explain(cmd: list[str], dest: Path) -> dict[str, object]:
    """Run the fleet explain once, as JSON into ``dest``, and print that answer as the
    table ``fleetd explain`` prints: the summary then repeats the same answer. The answer
    is read back from a file another process wrote, so it stays unchecked ``object``
    values: the summary below reads each with ``isinstance`` and a fallback."""
    from fleetd.cli.explain_render import render_fleet

    shown = ["fleetd", *cmd[len(_fleetd()):]]
    _say(f"\n$ {shlex.join(shown)}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        doc = json.loads(dest.read_text())
    except (OSError, ValueError) as exc:
        raise FleetdError(f"{shlex.join(shown)} exited with {proc.returncode} and wrote no "
                          f"answer ({exc}): {proc.stderr.strip()[-500:]}",
                          "the node logs are in the demo directory") from None
    if not isinstance(doc, dict):
        raise FleetdError(f"{dest} holds no explain answer", "run the demo again")
    _say("(the answer, as fleetd explain prints it without --format json)")
    render_fleet(doc, sys.stdout)
    for w in doc.get("warnings") or []:
        if isinstance(w, dict):
            _say(f"  warning: {w.get('node')}: {w.get('error')}")
    sys.stdout.flush()
    return doc


def _objects(value: object) -> list[dict[str, object]]:
    """The objects of a list in the answer (anything else in it, or no list: none)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _late_ranks(verdict: Mapping[str, object]) -> list[dict[str, object]]:
    return [s for s in _objects(verdict.get("stragglers"))
            if s.get("metric") == "collective_arrival" and s.get("flagged")]


def headline_missing(verdict: Mapping[str, object], failures: list[str]) -> str | None:
    """Why the late rank could not be named (None when it was)."""
    if _late_ranks(verdict):
        return None
    found = verdict.get("collectives") or {}
    said = found.get("verdict") if isinstance(found, dict) else None
    return "; ".join([f"collective arrival: {said or 'no collective was recorded'}",
                      *failures])


def _top_chains(verdict: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """Each node's first chain (the list comes most severe first)."""
    top: dict[str, dict[str, object]] = {}
    for chain in _objects(verdict.get("chains")):
        if isinstance(node := chain.get("node"), str):
            top.setdefault(node, chain)
    return top


def _culprit_text(chain: Mapping[str, object]) -> str:
    c = chain.get("culprit")
    if not isinstance(c, dict):
        return "no culprit process"
    return f"culprit {c.get('comm', '?')} pid {c.get('pid', '?')}"


def summary_lines(verdict: Mapping[str, object], files: list[Path],
                  window: list[str] | None = None) -> list[str]:
    """At most 12 lines: who is late, each node's top cause, the files written, what
    next. From the one explain answer step 5 printed; only ``files`` that exist."""
    lines = ["Summary (the full explain is above):"]
    ranks = _late_ranks(verdict)
    nodes = [s for s in _objects(verdict.get("stragglers"))
             if s.get("flagged") and s.get("metric") != "collective_arrival"]
    if ranks:
        r = ranks[0]
        lines.append(f"  straggler: rank {r.get('rank')} on {r.get('node')} (pid {r.get('pid')}), "
                     f"last in {_number(r.get('share_last')):.0%} of the collectives")
    if nodes:
        lines.append(f"  straggler node: {nodes[0].get('node')} ({nodes[0].get('metric')}, "
                     f"score {_number(nodes[0].get('score')):.2f})")
    if not ranks and not nodes:
        lines.append("  no straggler named (see the explain above)")
    for node, chain in sorted(_top_chains(verdict).items())[:3]:
        lines.append(f"  {node}: [{chain.get('severity')}] {chain.get('root_cause')}, "
                     f"{_culprit_text(chain)}")
    if files:
        lines.append("  written: " + ", ".join(str(f) for f in files[:2]))
        lines.append(f"           {files[2]}" if len(files) > 2 else "")
    else:
        lines.append("  written: nothing (see the errors above)")
    db = next((f for f in files if f.suffix == ".db"), None)
    if db is not None:
        # The same window from the merged file: the same verdict (docs/fleet.md).
        lines.append(f"  next: .venv/bin/fleetd explain --db {db} {shlex.join(window or [])}")
        lines.append(f"        .venv/bin/fleetd ops --db {db} --per-process")
    lines.append("        README.md: agents on real nodes with certificates (fleetd certs)")
    return [line.rstrip() for line in lines if line][:12]
