"""Record small real databases of the reference workload under known problems.

Each scenario runs tests/workloads/train_loop.py over the real CUDA runtime (without a
GPU every call fails fast and the uprobes still fire), injects one problem (a pinned
busy loop, DataLoader-style workers, a per-step ``.item()``-style copy, fsync-heavy
writes, a sidecar holding a shared file's lock, allocation churn), traces it with
``fleetd trace`` exactly as a user would, and compacts the database. The expected
diagnosis sits next to each scenario, so the tests and the recorder check the same
thing::

    sudo .venv/bin/python tests/recorder.py                 # all, into tests/data/scenarios
    sudo .venv/bin/python tests/recorder.py cpu_hog --out /tmp/rec --seconds 8
    sudo .venv/bin/python tests/recorder.py --fleet         # 3 nodes + merged cluster.db
    .venv/bin/python tests/recorder.py --verify             # re-check the stored ones

Needs root (eBPF). The recordings are of this machine: labels say so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FLEETD = str(REPO / ".venv" / "bin" / "fleetd")
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
NEIGHBOUR = REPO / "tests" / "workloads" / "neighbour.py"
DEFAULT_OUT = REPO / "tests" / "data" / "scenarios"
DEFAULT_FLEET_OUT = REPO / "investigations" / "fleet"
NODE = "rec-01"
SEVERITY_RANK = {"HIGH": 3, "MEDIUM": 2, "LOW": 1}

# A GPU-bound step of 4 ms with 8 launches and one copy, 100 us of Python per launch.
BASE = ("--launches", "8", "--memcpy", "1", "--cpu-us", "100", "--gpu-ms", "4")


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str  # what was run, for the README line
    workload: tuple[str, ...]
    neighbour: tuple[str, ...] = ()  # neighbour.py arguments; {shared} is a tmpfs file
    neighbour_cpu: str = "same"  # "same": the workload's CPU; "other": another one
    expect_root: str | None = None  # None: a quiet trace (no HIGH chain at all)
    expect_culprit: str | None = None  # process name; "self": the workload itself
    expect_thread: str | None = None  # the culprit's thread name, for thread culprits
    seconds: float | None = None  # a shorter run where the default would pass 1 MiB


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("quiet", "the reference workload alone on its CPU", BASE),
    Scenario("cpu_hog", "a busy loop (cpu-hog) pinned to the workload's CPU",
             BASE, ("hog",), "same", "cpu_contention", "cpu-hog"),
    Scenario("dataloader", "4 DataLoader-style workers (dl-worker) forked by the workload, "
             "sharing its CPU, filling fresh 4 MiB buffers",
             (*BASE, "--workers", "4"), (), "same", "dataloader_oversubscription",
             "dl-worker"),
    Scenario("host_sync", "a 4-byte device-to-host cudaMemcpy (an .item()) every step",
             (*BASE, "--host-syncs", "1"), (), "same", "host_sync", None),
    Scenario("block_io", "4 MiB written and fsynced every step by the training thread",
             (*BASE, "--dstate", "fsync:4", "--tmpdir", "{disk}"), (), "same", "block_io",
             "self", seconds=4.0),
    Scenario("lock_wait", "a step record written to a tmpfs file that a sidecar "
             "(stats-sidecar, on the other CPU) keeps rewriting, 32 MiB at a time",
             (*BASE, "--dstate", "lock:{shared}"), ("lock-holder", "{shared}"), "other",
             "lock_wait", "stats-sidecar"),
    Scenario("alloc_churn", "cudaMalloc + cudaFree of 1 MiB twice a step",
             (*BASE, "--alloc-churn", "2"), (), "same", "alloc_churn", None),
    Scenario("gil_contention", "a pure-Python thread (py-busy) computing without pause "
             "beside the feeding thread, in the same process",
             (*BASE, "--gil-thread"), (), "same", "lock_contention", "python", "py-busy"),
    Scenario("data_starvation", "each step waits for a batch from one producer process "
             "(dl-producer) through a multiprocessing.Queue, 6 ms of CPU "
             "per batch", (*BASE, "--producer-ms", "6"), (), "same", "data_starvation",
             "dl-producer", seconds=4.0),
)}


# ---- recording ----------------------------------------------------------------------


def _cpus() -> tuple[int, int]:
    """(the workload's CPU, another one): the last CPU, and the first."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-1], cpus[0]


def _pinned(cpu: int) -> Any:
    return lambda: os.sched_setaffinity(0, {cpu})


def wait_for_libcudart(pid: int, timeout: float = 20.0) -> None:
    """Block until the workload has mapped libcudart (uprobes attach to the mapped file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with suppress(OSError):
            if "libcudart" in Path(f"/proc/{pid}/maps").read_text():
                return
        time.sleep(0.02)
    raise RuntimeError(f"workload {pid} never mapped libcudart")


@contextmanager
def running(argv: list[str], cpu: int | None = None, start_s: float = 20.0,
            groups: Sequence[Path] = (), env: dict[str, str] | None = None
            ) -> Iterator[subprocess.Popen[str]]:
    """A test workload ``argv`` (one that waits for its go file; stdout piped), started
    as :func:`start_in` starts it, yielded once it has mapped libcudart so that probes
    can attach (``start_s``: how long that may take); killed on the way out if still
    running."""
    wl = start_in(groups, argv, cpu, env)
    try:
        wait_for_libcudart(wl.pid, start_s)
        yield wl
    finally:
        if wl.poll() is None:
            wl.kill()
        wl.wait(10)


def _fill(args: tuple[str, ...], places: dict[str, str]) -> list[str]:
    return [a.format(**places) for a in args]


@contextmanager
def _processes() -> Iterator[list[subprocess.Popen[Any]]]:
    procs: list[subprocess.Popen[Any]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            with suppress(subprocess.TimeoutExpired):
                p.wait(10)


class StderrLog:
    """A child's stderr read on a thread, every line kept (the pipe never fills), with a
    wait for the line that says ``fleetd trace`` has attached its probes."""

    MARKER = "fleetd: tracing"

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._seen = threading.Event()
        self._thread = threading.Thread(target=self._pump, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line)
            if self.MARKER in line:
                self._seen.set()
        self._seen.set()  # end of stream: wake the waiter either way

    def tracing(self, timeout: float) -> bool:
        """True once the tracer said it is tracing; False if it ended or timed out first."""
        self._seen.wait(timeout)
        return any(self.MARKER in line for line in self.lines)

    def text(self, timeout: float = 10.0) -> str:
        """Everything so far; after the child exits, everything it wrote."""
        self._thread.join(timeout)
        return "".join(self.lines)


@dataclass(frozen=True)
class NodeRun:
    """One traced workload: the node name it is recorded under, and where it runs."""

    node: str
    db: Path
    workload: tuple[str, ...]
    cpu: int


def _trace_nodes(runs: list[NodeRun], neighbours: list[tuple[tuple[str, ...], int]],
                 seconds: float, places: dict[str, str], go: Path,
                 trace_args: tuple[str, ...] = ()) -> None:
    """Start every workload, trace each with its own ``fleetd trace`` (``--stacks`` and
    ``trace_args``), start the neighbours, let the workloads go, and wait until all of
    them are done."""
    with _processes() as procs:
        loads: list[subprocess.Popen[str]] = []
        tracers: list[tuple[subprocess.Popen[str], StderrLog]] = []
        for r in runs:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{r.db}{suffix}").unlink(missing_ok=True)
            wl = subprocess.Popen(
                [sys.executable, str(WORKLOAD), "--duration", f"{seconds:g}", "--go-file",
                 str(go), *_fill(r.workload, places)],
                stdout=subprocess.PIPE, text=True, preexec_fn=_pinned(r.cpu))
            procs.append(wl)
            loads.append(wl)
        for r, wl in zip(runs, loads, strict=True):
            wait_for_libcudart(wl.pid)
            tr = subprocess.Popen(
                [FLEETD, "trace", "--pid", str(wl.pid), "--db", str(r.db), "--node", r.node,
                 "--stacks", *trace_args],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(tr)
            log = StderrLog(tr)
            tracers.append((tr, log))
            if not log.tracing(90):
                raise RuntimeError(f"fleetd trace did not start:\n{log.text(1)}")
        for args, cpu in neighbours:
            procs.append(subprocess.Popen(
                [sys.executable, str(NEIGHBOUR), *_fill(args, places),
                 "--seconds", f"{seconds + 10:g}"], preexec_fn=_pinned(cpu)))
        if neighbours:
            time.sleep(0.3)  # the neighbours are up before the first step
        go.touch()
        for r, wl, (tr, log) in zip(runs, loads, tracers, strict=True):
            wl_out, _ = wl.communicate(timeout=seconds + 120)
            tr.wait(60)
            if tr.returncode != 0 or wl.returncode != 0:
                raise RuntimeError(f"{r.node}: trace exited {tr.returncode}, workload "
                                   f"{wl.returncode}:\n{log.text()}\n{wl_out}")
    for r in runs:
        compact(r.db)


def trace_one(workload: list[str], db: Path, node: str, go: Path, seconds: float,
              *trace_args: str) -> None:
    """One workload (a full argv that waits for ``go``) pinned to the last CPU, traced by
    ``fleetd trace`` with ``trace_args``: let it go, wait for both to end cleanly, and
    compact the database. For tests that record one case of their own."""
    cpu = max(os.sched_getaffinity(0))  # one CPU, as the scenarios: threads take turns
    with running(workload, cpu) as wl, _processes() as procs:
        tracer = subprocess.Popen([FLEETD, "trace", "--pid", str(wl.pid), "--db", str(db),
                                   "--node", node, *trace_args],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(tracer)
        log = StderrLog(tracer)
        if not log.tracing(90):
            raise RuntimeError(f"fleetd trace did not start:\n{log.text(1)}")
        go.touch()
        wl.communicate(timeout=seconds + 120)
        tracer.wait(60)
        if wl.returncode != 0 or tracer.returncode != 0:
            raise RuntimeError(f"trace exited {tracer.returncode}, workload "
                               f"{wl.returncode}:\n{log.text()}")
    compact(db)


@contextmanager
def scratch_cgroup(root: Path, setup: dict[str, str]) -> Iterator[Path]:
    """A new cgroup under ``root`` with ``setup``'s files written (a limit, a quota);
    on the way out its processes go back to ``root`` and the directory is removed."""
    d = root / f"fleetd-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        for name, value in setup.items():
            (d / name).write_text(value)
        yield d
    finally:
        for pid in (d / "cgroup.procs").read_text().split():
            (root / "cgroup.procs").write_text(pid)  # back to the root, then remove
        d.rmdir()


def start_in(groups: Sequence[Path], argv: list[str], cpu: int | None = None,
             env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``argv`` started inside every cgroup of ``groups`` (and pinned to ``cpu``; with
    ``env`` as its environment): the child joins them before exec, never the test's own
    process."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env,
                            preexec_fn=joining(groups, cpu))


def joining(groups: Sequence[Path], cpu: int | None = None) -> Callable[[], None]:
    """A child's preexec: pin it to ``cpu`` and move it into every cgroup of ``groups``."""
    def enter() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        for g in groups:
            (g / "cgroup.procs").write_text(str(os.getpid()))
    return enter


def trace_for(pid: int, db: Path, go: Path, duration: str, *trace_args: str,
              verbose: bool = False, groups: Sequence[Path] = ()) -> str:
    """``fleetd [-v] trace --pid PID --duration DURATION TRACE_ARGS``, ``go`` touched once
    it traces (the workload waits for it): for tests that start their workload their own
    way; the tracer in every cgroup of ``groups``. Returns all it wrote to stderr; a
    failure says all of it, from before and after it started."""
    tr = subprocess.Popen([FLEETD, *(["-v"] if verbose else []), "trace", "--pid", str(pid),
                           "--db", str(db), "--duration", duration, *trace_args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=joining(groups))
    assert tr.stderr is not None
    said = []
    for line in tr.stderr:
        said.append(line)
        if line.startswith("fleetd: tracing"):
            go.touch()
            break
    _, err = tr.communicate(timeout=180)
    said.append(err)
    if tr.returncode != 0:
        raise RuntimeError(f"fleetd trace exited {tr.returncode}: {''.join(said)}")
    return "".join(said)


@contextmanager
def _scratch() -> Iterator[tuple[dict[str, str], Path]]:
    """A disk directory (for fsync) and a tmpfs file (for the shared lock)."""
    with tempfile.TemporaryDirectory(prefix="fleetd-rec-") as disk, \
            tempfile.TemporaryDirectory(prefix="fleetd-rec-", dir="/dev/shm") as shm:
        yield {"disk": disk, "shared": f"{shm}/status.bin"}, Path(disk) / "go"


def record(sc: Scenario, out_dir: Path, seconds: float = 6.0, node: str = NODE,
           trace_args: tuple[str, ...] = ()) -> Path:
    """Run one scenario under ``fleetd trace`` (with ``trace_args``); returns the
    compacted database."""
    out_dir.mkdir(parents=True, exist_ok=True)
    db = out_dir / f"{sc.name}.db"
    mine, other = _cpus()
    hood = [(sc.neighbour, mine if sc.neighbour_cpu == "same" else other)] if sc.neighbour \
        else []
    with _scratch() as (places, go):
        _trace_nodes([NodeRun(node, db, sc.workload, mine)], hood, sc.seconds or seconds,
                     places, go, trace_args)
    return db


FLEET = ("node-1", "node-2", "node-3")
FLEET_SLOW = "node-3"  # shares its CPU with cpu-hog


def record_fleet(out_dir: Path, seconds: float = 6.0) -> Path:
    """Three nodes (one workload and tracer each, node-3's CPU shared with a busy
    loop), then ``fleetd merge`` into cluster.db, as an air-gapped cluster would."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mine, other = _cpus()
    runs = [NodeRun(n, out_dir / f"{n}.db", BASE, mine if n == FLEET_SLOW else other)
            for n in FLEET]
    with _scratch() as (places, go):
        # At nice -10, as in fleetd demo: the hog gets ~90 % of the shared CPU, so the
        # slow node stands out from two nodes that share the other CPU with each other.
        _trace_nodes(runs, [(("hog", "--nice", "-10"), mine)], seconds, places, go)
    cluster = out_dir / "cluster.db"
    cluster.unlink(missing_ok=True)
    subprocess.run([FLEETD, "merge", *(str(r.db) for r in runs), "-o", str(cluster)],
                   check=True, capture_output=True, text=True, timeout=300)
    compact(cluster)
    return cluster


def compact(db: Path) -> None:
    """One self-contained file: WAL folded in, journal mode DELETE, free pages dropped."""
    c = sqlite3.connect(db, isolation_level=None)  # VACUUM runs outside a transaction
    try:
        c.execute("PRAGMA journal_mode=DELETE")  # leaving WAL checkpoints it into the file
        c.execute("VACUUM")
    finally:
        c.close()


# ---- verdicts -----------------------------------------------------------------------


def explain(db: Path) -> dict[str, Any]:
    """``fleetd explain --format json`` on a recording, as a user would run it."""
    out = subprocess.run([FLEETD, "explain", "--db", str(db), "--format", "json"],
                         capture_output=True, text=True, check=True, timeout=120)
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def verdict(sc: Scenario, report: dict[str, Any]) -> dict[str, Any] | None:
    """The chain that answers the scenario: the strongest one of the expected cause."""
    chains = [c for c in report["chains"] if c["root_cause"] == sc.expect_root]
    return max(chains, key=lambda c: SEVERITY_RANK[c["severity"]], default=None)


def problems(sc: Scenario, report: dict[str, Any]) -> list[str]:
    """What is wrong with a diagnosis of this scenario; empty when it is right."""
    chains = report["chains"]
    if sc.expect_root is None:
        return [f"quiet trace has a HIGH chain: {c['summary']}" for c in chains
                if c["severity"] == "HIGH"]
    found = verdict(sc, report)
    if found is None:
        causes = sorted({c["root_cause"] for c in chains}) or ["none"]
        return [f"no {sc.expect_root} chain (chains: {', '.join(causes)})"]
    out: list[str] = []
    above = [c for c in chains if c["root_cause"] != sc.expect_root
             and SEVERITY_RANK[c["severity"]] > SEVERITY_RANK[found["severity"]]]
    out += [f"{c['root_cause']} ranks above it ({c['severity']}): {c['summary']}"
            for c in above]
    if not found["evidence"] or not found["fixes"]:
        out.append("the chain has no evidence or no fix")
    culprit = found["culprit"]
    if sc.expect_culprit == "self":
        if not culprit or culprit["pid"] != found["victim"]["pid"]:
            out.append(f"culprit {culprit} is not the workload itself ({found['victim']})")
    elif sc.expect_culprit is not None and (not culprit or
                                            culprit["comm"] != sc.expect_culprit):
        out.append(f"culprit {culprit} is not {sc.expect_culprit}")
    if sc.expect_thread is not None and (culprit or {}).get("thread") != sc.expect_thread:
        out.append(f"culprit {culprit} is not thread {sc.expect_thread}")
    return out


def summary_line(sc: Scenario, report: dict[str, Any]) -> str:
    if sc.expect_root is None:
        worst = max((c["severity"] for c in report["chains"]),
                    key=lambda s: SEVERITY_RANK[s], default=None)
        return f"no HIGH chain (strongest: {worst or 'none'})"
    found = verdict(sc, report)
    if found is None:
        return f"no {sc.expect_root} chain"
    culprit = found["culprit"]
    who = f", culprit {culprit['comm']} (pid {culprit['pid']})" if culprit else ""
    return f"[{found['severity']}] {found['root_cause']}{who}: {found['summary']}"


def machine() -> str:
    cpus = os.cpu_count()
    return (f"{platform.node()}: {cpus} CPUs, Linux {platform.release()}, no GPU "
            "(the real libcudart returns no-device; uprobes fire on every call)")


def write_readme(out_dir: Path, lines: dict[str, str], seconds: float) -> None:
    text = [f"# Recorded scenarios ({out_dir.name})", "",
            "Recorded by `sudo .venv/bin/python tests/recorder.py` "
            f"({seconds:g} s each, `fleetd trace --stacks`) on {machine()}.",
            "Each line: what was run, then what `fleetd explain --db <file>` says. "
            "tests/unit/test_recorded_scenarios.py asserts these diagnoses.", ""]
    for name, line in lines.items():
        sc = SCENARIOS[name]
        took = f" ({sc.seconds:g} s)" if sc.seconds else ""
        text.append(f"- `{name}.db`: {sc.about}{took}. Explain: {line}")
    (out_dir / "README.md").write_text("\n".join(text) + "\n")


def fleet_problems(report: dict[str, Any]) -> list[str]:
    """What is wrong with the diagnosis of the 3-node set; empty when it is right."""
    flagged = [s["node"] for s in report.get("stragglers", []) if s["flagged"]]
    if flagged != [FLEET_SLOW]:
        return [f"stragglers flagged: {flagged or 'none'}, expected [{FLEET_SLOW!r}]"]
    top = [c for c in report["chains"] if c["node"] == FLEET_SLOW]
    if not top or top[0]["root_cause"] != "cpu_contention" or \
            (top[0]["culprit"] or {}).get("comm") != "cpu-hog":
        return [f"{FLEET_SLOW}'s top chain is not cpu_contention by cpu-hog: "
                f"{top[0]['summary'] if top else 'no chain'}"]
    return []


def fleet_line(report: dict[str, Any]) -> str:
    strag = next((s for s in report.get("stragglers", []) if s["flagged"]), None)
    if strag is None:
        return "no straggler flagged"
    return f"STRAGGLER {strag['node']} (score {strag['score']:.2f}): {strag['reason']}"


def _main_fleet(out: Path, seconds: float, verify: bool) -> int:
    cluster = out / "cluster.db" if verify else record_fleet(out, seconds)
    report = explain(cluster)
    wrong = fleet_problems(report)
    line = fleet_line(report)
    print(f"{'cluster':12} {cluster.stat().st_size // 1024:5d} KiB  "
          f"{'BAD' if wrong else 'ok '} {line}")
    for w in wrong:
        print(f"{'':19}{w}")
    if not verify:
        nodes = ", ".join(f"`{n}.db`" for n in FLEET)
        (out / "README.md").write_text(
            f"# A 3-node set and its merge\n\nRecorded by `sudo .venv/bin/python "
            f"tests/recorder.py --fleet` ({seconds:g} s) on {machine()}.\n\n"
            f"- {nodes}: the reference workload traced by `fleetd trace --stacks` on three nodes "
            f"(node names; one machine), {FLEET_SLOW}'s CPU shared with a busy loop "
            "(cpu-hog).\n"
            f"- `cluster.db`: `fleetd merge {' '.join(n + '.db' for n in FLEET)} -o cluster.db`."
            f" `fleetd explain --db cluster.db` says: {line}\n")
    return 1 if wrong else 0


# ---- showcase: what profile and collectives need, to try without root --------------------

DEFAULT_SHOWCASE_OUT = REPO / "investigations" / "showcase"
NCCL_RANKS = REPO / "tests" / "workloads" / "nccl_ranks.py"
# name -> (what it shows, the program fleetd trace starts, fleetd trace's own options)
SHOWCASE: dict[str, tuple[str, list[str], list[str]]] = {
    "profile": ("on-CPU samples with Python frames (`fleetd profile`): the reference "
                "workload with a pure-Python thread computing beside the feeding thread",
                [sys.executable, str(WORKLOAD), "--duration", "5", "--gil-thread",
                 "--gil-duty", "0.5", *BASE],
                ["--cpu-sample-hz", "99", "--stacks"]),
    "collectives": ("a 4-rank NCCL job over the real libnccl, rank 2 late by 3 ms a step "
                    "(`fleetd collectives`, and the straggler rank in `fleetd explain`)",
                    [sys.executable, str(NCCL_RANKS), "--spawn", "4", "--seconds", "5",
                     "--compute-ms", "2", "--extra-ms-rank", "2:3"],
                    []),
}


def record_showcase(out_dir: Path) -> dict[str, str]:
    """Each program started under ``fleetd trace -- CMD`` (traced from its first call),
    compacted; returns the command line that made each file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, (_, program, opts) in SHOWCASE.items():
        db = out_dir / f"{name}.db"
        db.unlink(missing_ok=True)
        cmd = [FLEETD, "trace", "--db", str(db), "--node", NODE, *opts, "--", *program]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if not db.exists() or "fleetd: stopped" not in r.stderr:
            raise SystemExit(f"recording {name} failed: {r.stderr[-2000:]}")
        compact(db)
        shown = [Path(c).name if c.startswith(str(REPO)) or c == sys.executable else c
                 for c in cmd[1:]]
        made[name] = "fleetd " + " ".join(shown).replace(str(db), f"{name}.db")
    return made


def _showcase_readme(out_dir: Path, made: dict[str, str]) -> None:
    lines = ["# Recordings to try `fleetd profile` and `fleetd collectives` without root",
             "", f"Recorded by `sudo .venv/bin/python tests/recorder.py --showcase` on "
             f"{machine()}, each program started under the tracer (`fleetd trace -- CMD`).",
             ""]
    for name, (about, _, _) in SHOWCASE.items():
        lines += [f"- `{name}.db`: {about}.", f"  `{made.get(name, '?')}`"]
    lines += ["", "```sh", ".venv/bin/fleetd profile --db investigations/showcase/profile.db",
              ".venv/bin/fleetd profile --db investigations/showcase/profile.db "
              "--format folded > profile.folded   # flamegraph.pl, speedscope",
              ".venv/bin/fleetd collectives --db investigations/showcase/collectives.db",
              "```", ""]
    (out_dir / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenarios", nargs="*", help=f"default: all of {', '.join(SCENARIOS)}")
    p.add_argument("--out", type=Path, help=f"default: {DEFAULT_OUT.relative_to(REPO)} "
                   f"({DEFAULT_FLEET_OUT.relative_to(REPO)} with --fleet)")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--fleet", action="store_true",
                   help="record the 3-node set and its merged cluster.db instead")
    p.add_argument("--verify", action="store_true",
                   help="only check the databases already in --out")
    p.add_argument("--showcase", action="store_true",
                   help="record investigations/showcase (profile.db, collectives.db) instead")
    a = p.parse_args(argv)
    if a.showcase:
        out = a.out or DEFAULT_SHOWCASE_OUT
        _showcase_readme(out, record_showcase(out))
        return 0
    if a.fleet:
        return _main_fleet(a.out or DEFAULT_FLEET_OUT, a.seconds, a.verify)
    a.out = a.out or DEFAULT_OUT
    unknown = [n for n in a.scenarios if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}: choose from {', '.join(SCENARIOS)}")
    names = a.scenarios or list(SCENARIOS)
    if not a.verify:
        for name in names:
            record(SCENARIOS[name], a.out, a.seconds)
    lines: dict[str, str] = {}
    bad = 0
    for name in SCENARIOS:  # every recording in --out, so the README stays whole
        db = a.out / f"{name}.db"
        if not db.exists():
            continue
        sc = SCENARIOS[name]
        report = explain(db)
        lines[name] = summary_line(sc, report)
        wrong = problems(sc, report)
        bad += bool(wrong)
        print(f"{name:12} {db.stat().st_size // 1024:5d} KiB  {'BAD' if wrong else 'ok '} "
              f"{lines[name]}")
        for w in wrong:
            print(f"{'':19}{w}")
    if not a.verify:
        write_readme(a.out, lines, a.seconds)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
