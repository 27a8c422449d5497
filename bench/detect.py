"""How fast ``fleetd watch`` flags a straggler and names its cause, on a live fleet (#43.3).

Four agents, each in its own network namespace (real mTLS over a bridge, real BPF:
tests/netbed.py), each tracing one rank of a lockstep NCCL job (tests/workloads/
nccl_ranks.py through bench/_detect_rank.py, the real libnccl, torchrun's environment,
MASTER_ADDR on host-0) in its host's CPU slice. ``fleetd watch --interval 1s
--hang-after 10s`` runs in the client namespace; each line it prints is timestamped.

Faults come one at a time on a seeded random host after a seeded random healthy gap,
each lasting FAULT_S:

* ``hog``: a busy loop in the rank's slice (its CPU share): expected cause cpu_contention;
* ``quota``: the rank's slice capped at 3% of a CPU (cpu.max): cpu_throttled;
* ``gc``: a garbage-collection storm inside the rank: gc_pause;
* ``loader``: the rank's data loader starved (a batch every 150 ms): data_starvation;
* ``disk``: 16 MiB (one buffer) written and fsynced each step: block_io (D-state waits);
* ``stop``: SIGSTOP (a hang, judged by ``--hang-after``; SIGCONT at its end).

Figures: flag_s, from a fault's onset to the first STRAGGLER line naming the faulted
rank (or HANG line naming it: a stop); cause_s, to its first CAUSE line; a fault with
no flag before it ends (plus GRACE_S) is missed; a cause outside the fault's expected
set is wrong_cause; a STRAGGLER or HANG line outside every fault window (onset to end
plus GRACE_S), or naming another rank, is a false alarm, counted per healthy hour.

Last line: BENCH detect flag_p50_s=.. flag_p90_s=.. cause_p90_s=.. hang_p90_s=..
missed=.. wrong_cause=.. false_alarms_per_h=..
(goals: flag_p90 <= 10, cause_p90 <= 15, missed 0, wrong_cause 0, false alarms 0)

By default (make bench) the quick form: three faults (quota, hog, stop) of 15 s, short
gaps (under 2 minutes on 2 cores with the BPF programs cached). DETECT_FULL=1: every kind
twice, 25 s each, 20-40 s healthy between (about 15 minutes); DETECT_S=N: the full kinds
for about N seconds of schedule. DETECT_SEED picks the order, hosts and gaps;
DETECT_DEBUG=FILE keeps watch's -vv log (each poll's lateness per rank) there;
DETECT_KINDS=quota,hog runs only those kinds (once each in the quick form); DETECT_KEEP=DIR
keeps the agents' databases and logs there (to read a wrong cause on the data).
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from netbed import PY, NetBed, why_unavailable  # noqa: E402

RANK = REPO / "bench" / "_detect_rank.py"
NCCL_RANKS = REPO / "tests" / "workloads" / "nccl_ranks.py"
HOSTS = 4
# make bench runs the quick form (its 20-minute budget); DETECT_FULL=1 the full one.
QUICK = os.environ.get("DETECT_FULL") != "1" and "DETECT_S" not in os.environ
SEED = int(os.environ.get("DETECT_SEED", "43"))
FAULT_S = 15.0 if QUICK else 25.0
GAP_S = (6.0, 9.0) if QUICK else (20.0, 40.0)
GRACE_S = 12.0  # after a fault ends: its recovery, not a false alarm
HANG_AFTER_S = 10
QUOTA_CPUS = 0.03
EXPECTED = {"hog": {"cpu_contention"}, "quota": {"cpu_throttled"}, "gc": {"gc_pause"},
            "loader": {"data_starvation"}, "disk": {"block_io"}, "stop": set()}
KINDS = tuple(k for k in os.environ.get("DETECT_KINDS", "").split(",") if k) or (
    ("quota", "hog", "stop") if QUICK else ("hog", "quota", "gc", "loader", "disk", "stop"))
LINE_RE = re.compile(r"rank (\d+) \((host-\d+) pid (\d+)")


@dataclass
class Fault:
    kind: str
    host: int
    onset: float = 0.0
    end: float = 0.0
    flag_s: float | None = None
    cause_s: float | None = None
    cause: str | None = None


@dataclass
class Watch:
    proc: subprocess.Popen[str]
    lines: queue.Queue[tuple[float, str]] = field(default_factory=queue.Queue)
    seen: list[tuple[float, str]] = field(default_factory=list)

    def start(self) -> Watch:
        out = self.proc.stdout
        assert out is not None

        def read() -> None:
            for x in out:
                self.lines.put((time.monotonic(), x.rstrip("\n")))
        threading.Thread(target=read, daemon=True).start()
        return self

    def drain(self) -> None:
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return


def schedule(rnd: random.Random) -> list[Fault]:
    if "DETECT_S" in os.environ:
        budget = float(os.environ["DETECT_S"])
        n = max(1, int(budget // (FAULT_S + sum(GAP_S) / 2)))
    else:
        n = len(KINDS) * (1 if QUICK else 2)
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    rnd.shuffle(kinds)
    return [Fault(k, rnd.randrange(HOSTS)) for k in kinds]


def start_ranks(bed: NetBed, go: Path, tmp: Path) -> list[subprocess.Popen[str]]:
    ranks = []
    for h in bed.hosts:
        env = {"RANK": str(h.index), "LOCAL_RANK": "0", "WORLD_SIZE": str(HOSTS),
               "MASTER_ADDR": bed.hosts[0].address, "MASTER_PORT": "29543",
               "TORCHELASTIC_RUN_ID": "detect"}
        ranks.append(bed.spawn(h, [PY, str(RANK), "--fault-file", str(tmp / f"fault-{h.index}"),
                                   "--io-dir", str(tmp), "--go-file", str(go),
                                   "--seconds", "3600", "--compute-ms", "10",
                                   "--barrier-timeout", "600", "--max-listed", "0"],
                               in_slice=True, env=env, log_name=f"rank-{h.index}.log"))
    return ranks


def inject(bed: NetBed, f: Fault, ranks: list[subprocess.Popen[str]], tmp: Path
           ) -> subprocess.Popen[str] | None:
    h = bed.hosts[f.host]
    if f.kind == "hog":
        hog: subprocess.Popen[str] = bed.start_hog(h)
        return hog
    if f.kind == "quota":
        assert bed.slices is not None and h.slice is not None
        bed.slices.make(str(h.slice.relative_to(bed.slices.root)), quota=QUOTA_CPUS)
    elif f.kind == "stop":
        os.kill(ranks[f.host].pid, signal.SIGSTOP)
    else:
        (tmp / f"fault-{f.host}").write_text(f.kind)
    return None


def clear(bed: NetBed, f: Fault, ranks: list[subprocess.Popen[str]], tmp: Path,
          hog: subprocess.Popen[str] | None) -> None:
    h = bed.hosts[f.host]
    if hog is not None:
        hog.kill()
        hog.wait(10)
    if f.kind == "quota":
        assert bed.slices is not None and h.slice is not None
        bed.slices.make(str(h.slice.relative_to(bed.slices.root)), quota=bed.quota)
    elif f.kind == "stop":
        os.kill(ranks[f.host].pid, signal.SIGCONT)
    else:
        (tmp / f"fault-{f.host}").write_text("")


def judge(faults: list[Fault], seen: list[tuple[float, str]], pids: dict[str, int],
          start: float, end: float) -> tuple[int, float]:
    """Fill each fault's flag and cause from the watch's lines; (false alarms, healthy s)."""
    false_alarms = 0
    for t, line in seen:
        m = LINE_RE.search(line)
        flag = line.startswith(("STRAGGLER", "HANG"))
        if not m and not flag:
            continue
        host = m.group(2) if m else None
        f = next((f for f in faults if f.onset <= t <= f.end + GRACE_S), None)
        right = f is not None and host == f"host-{f.host}"
        if flag and not right:
            false_alarms += 1
            print(f"  false alarm at {t - start:.1f} s: {line}", flush=True)
            continue
        if f is None or not right:
            continue
        if flag and f.flag_s is None:
            f.flag_s = t - f.onset
        if line.startswith("CAUSE") and f.cause_s is None:
            f.cause_s = t - f.onset
            cm = re.search(r"\]\s*([a-z_]+):", line)
            f.cause = cm.group(1) if cm else line
    faulty = sum(f.end + GRACE_S - f.onset for f in faults)
    return false_alarms, max(1.0, end - start - faulty)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(tmp: Path) -> str:
    rnd = random.Random(SEED)
    faults = schedule(rnd)
    with NetBed(tmp / "bed", HOSTS, quota=0.25, names=[f"host-{i}" for i in range(HOSTS)]
                ) as bed:
        go = tmp / "go"
        ranks = start_ranks(bed, go, tmp)
        time.sleep(1.0)
        for h, r in zip(bed.hosts, ranks, strict=True):
            bed.start_agent(h, db=tmp / f"{h.name}.db", trace_pid=r.pid)
        t0 = time.monotonic()
        bed.wait_agents(timeout=300)
        print(f"  agents tracing after {time.monotonic() - t0:.0f} s", flush=True)
        go.touch()
        time.sleep(3)
        w = Watch(subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{bed.client_ns}", str(REPO / ".venv/bin/fleetd"),
             "watch", "--nodes", ",".join(f"{h.name}={h.endpoint}" for h in bed.hosts),
             *bed.client_tls_args(), "--interval", "1s", "--hang-after", f"{HANG_AFTER_S}s",
             "--exec", "cat", *(["-vv"] if os.environ.get("DETECT_DEBUG") else [])],
            stdout=subprocess.PIPE, stderr=(tmp / "watch.err").open("w"), text=True)).start()
        try:
            start = time.monotonic()
            for f in faults:
                time.sleep(rnd.uniform(*GAP_S))
                hog = inject(bed, f, ranks, tmp)
                f.onset = time.monotonic()
                print(f"  {f.onset - start:6.1f} s: {f.kind} on host-{f.host} (wall "
                      f"{time.time():.1f})", flush=True)
                time.sleep(FAULT_S)
                f.end = time.monotonic()
                clear(bed, f, ranks, tmp, hog)
            time.sleep(GRACE_S + rnd.uniform(*GAP_S))
            end = time.monotonic()
        finally:
            w.proc.terminate()
            w.proc.wait(20)
        w.drain()
        if os.environ.get("DETECT_DEBUG"):
            Path(os.environ["DETECT_DEBUG"]).write_text((tmp / "watch.err").read_text())
        for t, line in w.seen:
            print(f"  watch {t - start:6.1f} s: {line[:160]}", flush=True)
        pids = {h.name: r.pid for h, r in zip(bed.hosts, ranks, strict=True)}
        false_alarms, healthy_s = judge(faults, w.seen, pids, start, end)
    return report(faults, false_alarms, healthy_s)


def report(faults: list[Fault], false_alarms: int, healthy_s: float) -> str:
    for f in faults:
        print(f"  {f.kind:6} host-{f.host}: flagged "
              f"{'-' if f.flag_s is None else f'{f.flag_s:.1f} s'}, cause "
              f"{f.cause or '-'} {'' if f.cause_s is None else f'{f.cause_s:.1f} s'}",
              flush=True)
    slow = [f for f in faults if f.kind != "stop"]
    flags = [f.flag_s for f in slow if f.flag_s is not None]
    causes = [f.cause_s for f in slow if f.cause_s is not None]
    hangs = [f.flag_s for f in faults if f.kind == "stop" and f.flag_s is not None]
    missed = sum(1 for f in faults if f.flag_s is None)
    wrong = sum(1 for f in slow if f.flag_s is not None and f.cause not in EXPECTED[f.kind])
    print(f"  healthy time {healthy_s:.0f} s, {false_alarms} false alarm(s)", flush=True)
    return (f"BENCH detect flag_p50_s={statistics.median(flags) if flags else float('nan'):.1f} "
            f"flag_p90_s={pct(flags, 0.9):.1f} cause_p90_s={pct(causes, 0.9):.1f} "
            f"hang_p90_s={pct(hangs, 0.9):.1f} missed={missed} wrong_cause={wrong} "
            f"false_alarms_per_h={false_alarms * 3600 / healthy_s:.1f}")


def main() -> int:
    why = why_unavailable()
    if why:
        print(f"BENCH detect skipped: {why}")
        return 0
    unknown = sorted(set(KINDS) - set(EXPECTED))
    if unknown:
        print(f"DETECT_KINDS names {', '.join(unknown)}: pick from {', '.join(EXPECTED)}",
              file=sys.stderr)
        return 2
    keep = os.environ.get("DETECT_KEEP")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        print(run(Path(keep)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="fleetd-detect-") as d:
        print(run(Path(d)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
