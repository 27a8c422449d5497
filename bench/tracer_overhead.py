"""Tracer overhead, measured against baselines in the same run.

A worker process loads the real libcudart (tests/workloads/train_loop.py as a
library) and runs what this script asks; the tracer (the real Tracer, default
settings: every layer, --sample 100) runs here and traces the worker by pid. One
compiled tracer serves each part: for an untraced run all its programs are detached
(compiling one costs seconds on a busy machine, more than the rounds themselves).

1. Per-call cost, in interleaved short rounds: CPU ns of the calling thread per
   cudaLaunchKernel (trap and BPF programs included, other processes' time not) untraced, with
   an empty uprobe+uretprobe pair (same attach mechanism as the tracer) and with the
   tracer, one short loop of each per round; the minimum of each over the rounds is
   the figure (noise on a shared machine only ever adds time), the spread is printed.
   Then the kernel's own accounting of the tracer's BPF programs
   (kernel.bpf_stats_enabled, run_time_ns / run_cnt per program, in a separate loop
   so its clock reads do not touch the timed rounds): ns of fleetd's code per call,
   apart from the trap the kernel charges for any uprobe; the empty pair's figure is
   the floor of that accounting.
2. Reference workload, steps/s untraced vs traced in alternating rounds, best of
   each: the realistic step (20 launches and 2 async copies, each launch preceded by
   CPU work, then one stream sync waiting for the simulated device; ~20k CUDA
   calls/s) and a CPU-bound variant (no device time); with BENCH_STACKS=1 the
   realistic step again with stacks on (printed, not on the BENCH line). Then the
   CPU-bound loop with the on-CPU sampler at its default rate (49 Hz per CPU) against
   the same tracer with only the sampler stopped, in alternating pairs of runs:
   cpu_sample_ratio, the median of the pairs' ratios.
3. Sustained events/s into SQLite, every call kept (--sample 1): live (the worker
   calling as fast as it can while the tracer drains, on the same CPUs) and from a
   backlog (the worker's launches left in a large ring, then drained and committed at
   full speed: the ring-to-SQLite path alone, the BENCH figure). Where each
   event's time goes, in CPU us per event: BPF (the kernel's run time of the tracer's
   programs), poll (taking records out of the rings), decode, enrich (kernel names,
   stacks, locks), queue (handing rows to the writer), insert (the writer's commits).
   Loss check, two ways: the kernel's emitted count against rows written plus reported
   losses, and the launches the worker made against launch rows stored plus losses.

Last line: BENCH tracer_overhead traced_ratio=R cpu_bound_ratio=C added_ns_per_call=A
empty_pair_ns=E bpf_ns_per_event=B events_per_s=N unreported_loss=U cpu_sample_ratio=S
launch_added_ns=L launch_returns_added_ns=F entry_only_added_ns=O always_on_ratio=W
(targets: R >= 0.99, C >= 0.97, A <= 1.3 x E, B <= 250, N >= 300000, U == 0, S >= 0.995,
L <= 0.7 x E, W >= 0.995). L is the default mode's cost per launch
(fleetd.trace.bpf.modes), F and O the same loop with and without launch return probes,
measured in the same rounds (part 1); W the CPU-bound loop in the always-on mode
(launch probes 1 s of every 10 s, as the agent runs it) over untraced, in alternating
rounds of one period (untraced: a quarter of one) (part 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _traced import Traced  # noqa: E402

from fleetd.store.catalog import BY_NAME  # noqa: E402
from fleetd.trace.bpf.bpfsrc import compile_source, detach_all  # noqa: E402
from fleetd.trace.bpf.probes import link_uprobe_multi  # noqa: E402
from fleetd.trace.host.libs import exported_functions, mapped_libraries  # noqa: E402
from fleetd.trace.tracer import STAGES  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "6"))
LOOP_N = int(os.environ.get("BENCH_LOOP_N", "20000"))
WORK_ROUNDS = int(os.environ.get("BENCH_WORK_ROUNDS", "3"))
WORKLOAD_S = float(os.environ.get("BENCH_WORKLOAD_S", "0.7"))
EVENT_ROUNDS = int(os.environ.get("BENCH_EVENT_ROUNDS", "3"))
SAMPLE_ROUNDS = int(os.environ.get("BENCH_SAMPLE_ROUNDS", "5"))
EVENTS_N = int(os.environ.get("BENCH_EVENTS_N", "60000"))
# The realistic step with stacks on too (another compiled tracer: ~20 s more).
STACKS = os.environ.get("BENCH_STACKS", "0") == "1"
STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
# After attaching or detaching: the kernel's deferred work (RCU callbacks freeing
# detached perf events) runs before the next timed loop, not during it.
SETTLE_S = 0.1
LAUNCH = BY_NAME["cudaLaunchKernel"].code

# Realistic step: 20 launches x (25 us CPU) + 2 copies + 1 sync; device time 1.15 ms
# per step => ~870 steps/s x 23 calls = ~20k CUDA calls/s, the CPU ~45% busy.
REALISTIC = {"launches": 20, "memcpy": 2, "cpu_us": 25.0, "gpu_ms": 1.15}
CPU_BOUND = {"launches": 20, "memcpy": 2, "cpu_us": 25.0, "gpu_ms": 0.0}

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from train_loop import Config, Workload
w = Workload(Config(steps=1))
print(json.dumps({"lib": w.lib_path}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "loop":
        c0 = time.thread_time_ns()
        ns = w.tight_loop(cmd["n"])
        print(json.dumps({"ns": ns, "cpu_ns": time.thread_time_ns() - c0}), flush=True)
    elif cmd["op"] == "run":
        cfg = Config(duration_s=cmd["seconds"], steps=0, **cmd["cfg"])
        w2 = Workload(cfg)
        s = w2.run()
        print(json.dumps({"steps_per_s": s.steps_per_s, "calls_per_s": s.calls_per_s}),
              flush=True)
    else:
        break
"""


class Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(REPO / "tests" / "workloads")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lib = self._read()["lib"]
        self.pid = self.proc.pid

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("worker died")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def loop_ns(self, n: int = LOOP_N) -> float:
        """CPU ns per call of one tight loop of ``n`` launches: the calling thread's CPU
        time, which holds the uprobe trap and the BPF programs (they run in its context)
        but not the time other processes on a shared machine take from it."""
        return float(self.ask(op="loop", n=n)["cpu_ns"]) / n

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, BrokenPipeError, ValueError):
            self.ask(op="quit")
        self.proc.wait(timeout=10)


def spread(xs: list[float], fmt: str = "{:.0f}") -> str:
    return (f"min {fmt.format(min(xs))} median {fmt.format(statistics.median(xs))} "
            f"max {fmt.format(max(xs))} over {len(xs)}")


# ---- BPF stats ----------------------------------------------------------------------------

@contextlib.contextmanager
def bpf_stats() -> Iterator[None]:
    """kernel.bpf_stats_enabled on for the block, restored after."""
    before = STATS.read_text().strip()
    STATS.write_text("1")
    try:
        yield
    finally:
        STATS.write_text(before)


def prog_stats(fds: dict[str, int]) -> dict[str, tuple[int, int]]:
    """name -> (run_time_ns, run_cnt) from /proc/self/fdinfo of each program fd."""
    out = {}
    for name, fd in fds.items():
        vals = {}
        for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
            key, _, v = line.partition(":")
            if key in ("run_time_ns", "run_cnt"):
                vals[key] = int(v)
        out[name] = (vals.get("run_time_ns", 0), vals.get("run_cnt", 0))
    return out


def program_fds(bpf: Any) -> dict[str, int]:
    return {name.decode() if isinstance(name, bytes) else str(name): int(fn.fd)
            for name, fn in bpf.funcs.items()}


def uprobe_ns(d: dict[str, tuple[int, int]]) -> int:
    """Run time of the programs a traced CUDA call runs (entry and return uprobes);
    the host tracepoints also fire for every other process on the machine."""
    return sum(ns for k, (ns, _) in d.items() if k.startswith(("fl_in", "fl_out", "fl_sess")))


def stats_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
                ) -> dict[str, tuple[int, int]]:
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}


# ---- 1. per-call cost -----------------------------------------------------------------------

class EmptyPair:
    """An empty entry + return program on cudaLaunchKernel, attached the way the tracer
    attaches (a uprobe_multi link each); compiled once, linked per round."""

    def __init__(self, worker: Worker) -> None:
        from bcc import BPF

        self.bpf, _ = compile_source("int fl_in_multi(void *ctx) { return 0; }\n"
                                     "int fl_out_multi(void *ctx) { return 0; }\n")
        lib = next(x for x in mapped_libraries(worker.pid) if x.kind == "cudart")
        self.path = lib.path
        self.off = exported_functions(lib.path).offsets["cudaLaunchKernel"]
        self.progs = [(self.bpf.load_func(name, BPF.KPROBE, None, 48).fd, ret)
                      for name, ret in ((b"fl_in_multi", False), (b"fl_out_multi", True))]
        self.fds = program_fds(self.bpf)

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        links = []
        try:
            for fd, ret in self.progs:
                link, err = link_uprobe_multi(fd, self.path, [self.off], [0], retprobe=ret)
                if link < 0:
                    raise RuntimeError(f"empty pair attach failed: {err}")
                links.append(link)
            time.sleep(SETTLE_S)
            yield
        finally:
            for link in links:
                os.close(link)

    def close(self) -> None:
        detach_all(self.bpf)


@contextlib.contextmanager
def tracer_off(t: Traced) -> Iterator[None]:
    """No program of the tracer attached for the block: its uprobe links closed, its
    tracepoints and raw tracepoints detached (in parallel: each detach waits for an RCU
    grace period), then attached again as at start. One compiled tracer thus serves
    every round: compiling it costs seconds on a busy machine, more than the rounds."""
    from concurrent.futures import ThreadPoolExecutor

    tr = t.tracer
    bpf = tr.bpf
    assert tr.attacher is not None
    sampler = tr._oncpu  # the on-CPU sampler's perf events: off too
    if bpf.uprobe_fds:
        raise RuntimeError("the tracer attached per-symbol uprobes (no uprobe_multi "
                           "here); this benchmark toggles only uprobe_multi links")
    tr.attacher.close()
    tps = list(bpf.tracepoint_fds)
    raw = list(bpf.raw_tracepoint_fds)  # the syscall probes
    with ThreadPoolExecutor(max_workers=len(tps) + len(raw) or 1) as pool:
        list(pool.map(bpf.detach_tracepoint, tps))
        list(pool.map(bpf.detach_raw_tracepoint, raw))
    if sampler is not None:
        sampler.pause()
    time.sleep(SETTLE_S)
    try:
        yield
    finally:
        if sampler is not None:
            sampler.resume()
        for tp in tps:
            bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + tp.replace(b":", b"__"))
        for tp in raw:
            bpf.attach_raw_tracepoint(tp=tp, fn_name=b"raw_tracepoint__" + tp)
        for lib in tr.libs.values():
            tr.attacher.attach(lib, tr.cfg.layers)
        time.sleep(SETTLE_S)


@contextlib.contextmanager
def launch_mode(t: Traced, returns: bool) -> Iterator[None]:
    """The tracer's launches with (``--launch-returns``) or without return probes for
    the block: its links closed and made again in that mode, then as they were."""
    tr = t.tracer
    assert tr.attacher is not None
    was = tr.attacher.launch_entry

    def relink(entry: bool) -> None:
        assert tr.attacher is not None
        tr.attacher.close()
        tr.attacher.launch_entry = entry
        for lib in tr.libs.values():
            tr.attacher.attach(lib, tr.cfg.layers)
        time.sleep(SETTLE_S)

    relink(not returns)
    try:
        yield
    finally:
        relink(was)


def per_call(worker: Worker, tmp: Path, empty: EmptyPair
             ) -> tuple[float, float, float, int, float]:
    """(added ns per call, empty pair ns, BPF ns per traced call, unreported loss, added
    ns per call in the other launch mode: --launch-returns or not, whichever is not the
    default)."""
    base: list[float] = []
    pair: list[float] = []
    traced: list[float] = []
    other: list[float] = []  # the launch mode that is not the default
    bpf_ns: list[float] = []
    floor: list[float] = []
    with Traced(tmp / "loop.db", [worker.pid]) as t:
        worker.loop_ns(2000)  # warm: first-call costs out of the rounds
        for r in range(ROUNDS):
            with tracer_off(t):
                base.append(worker.loop_ns())
                with empty.attached():
                    pair.append(worker.loop_ns())
            traced.append(worker.loop_ns())
            with launch_mode(t, returns=not t.tracer.cfg.launch_returns):
                other.append(worker.loop_ns())
            with bpf_stats():
                fds = program_fds(t.tracer.bpf)
                s0 = prog_stats(fds)
                worker.loop_ns()
                d = stats_delta(s0, prog_stats(fds))
                # The same accounting of the empty pair: the floor of what the
                # kernel's clock reads around a program report.
                with tracer_off(t), empty.attached():
                    e0 = prog_stats(empty.fds)
                    worker.loop_ns()
                    floor.append(uprobe_ns(stats_delta(e0, prog_stats(empty.fds)))
                                 / LOOP_N)
            bpf_ns.append(uprobe_ns(d) / LOOP_N)
            print(f"  round {r + 1}: untraced {base[-1]:.0f} ns/call, empty pair "
                  f"{pair[-1]:.0f}, traced {traced[-1]:.0f}; tracer's BPF {bpf_ns[-1]:.0f} "
                  f"ns/call (empty pair's {floor[-1]:.0f})", flush=True)
        if d:
            top = sorted(d.items(), key=lambda kv: -kv[1][0])[:4]
            print("  BPF run time by program (last round): " + ", ".join(
                f"{k} {ns / max(cnt, 1):.0f} ns x {cnt}" for k, (ns, cnt) in top if cnt)
                + " (tracepoints: every process's events, filtered in the program)")
    b, e, tr = min(base), min(pair), min(traced)
    added, pair_ns = tr - b, e - b
    mode = "entry-only launches" if t.tracer.cfg.launch_returns else "with launch returns"
    print(f"per call, the other launch mode than the default ({mode}): {spread(other)} ns, "
          f"+{min(other) - b:.0f} over untraced", flush=True)
    print(f"per call: untraced {spread(base)} ns; empty pair {spread(pair)}; traced "
          f"{spread(traced)}", flush=True)
    print(f"per call, minimum of each: empty pair +{pair_ns:.0f} ns, tracer +{added:.0f} ns "
          f"(x{added / pair_ns:.2f} of the empty pair; target <= 1.3); tracer's BPF "
          f"programs {spread(bpf_ns)} ns/call (target <= 250), the empty pair's "
          f"{spread(floor)}", flush=True)
    return added, pair_ns, min(bpf_ns), t.summary.unreported_loss, min(other) - b


# ---- 2. workload ratios ---------------------------------------------------------------------

def workload_ratios(worker: Worker, tmp: Path, empty: EmptyPair
                    ) -> tuple[float, float, float, int, float]:
    """(traced_ratio, cpu_bound_ratio, cpu_sample_ratio, unreported loss,
    always_on_ratio): traced over
    untraced steps/s, best of each over alternating rounds, one tracer switched off and
    on. The empty uprobe pair alone on the launches shows the floor any uprobe tracer
    starts from. Then the sampler's own cost: the CPU-bound loop with the sampler on
    over the same tracer with the sampler alone stopped; then the always-on mode."""
    ratios = []
    with Traced(tmp / "work.db", [worker.pid]) as t:
        for label, cfg in (("GPU-bound step", REALISTIC), ("CPU-bound launch loop", CPU_BOUND)):
            plain: list[float] = []
            traced: list[float] = []
            calls: list[float] = []
            pair: list[float] = []
            for _ in range(WORK_ROUNDS):
                with tracer_off(t):
                    r = worker.ask(op="run", seconds=WORKLOAD_S, cfg=cfg)
                    with empty.attached():
                        pair.append(worker.ask(op="run", seconds=WORKLOAD_S,
                                               cfg=cfg)["steps_per_s"])
                plain.append(r["steps_per_s"])
                calls.append(r["calls_per_s"])
                traced.append(worker.ask(op="run", seconds=WORKLOAD_S, cfg=cfg)["steps_per_s"])
            ratio = max(traced) / max(plain)
            per_round = [q / p for p, q in zip(plain, traced, strict=True)]
            print(f"workload ({label}, {max(calls):,.0f} CUDA calls/s): steps/s untraced "
                  f"{spread(plain, '{:.1f}')}, traced {spread(traced, '{:.1f}')}; ratio of "
                  f"the best {ratio:.3f}, per round {spread(per_round, '{:.3f}')}; the empty "
                  f"pair alone: ratio of the best {max(pair) / max(plain):.3f}", flush=True)
            ratios.append(ratio)
        sampled = cpu_sample_ratio(worker, t)
        always = always_on_ratio(worker, t)
    return ratios[0], ratios[1], sampled, t.summary.unreported_loss, always


# The always-on mode as the agent runs it: its own duty cycle (TraceConfig: 1 s of every
# 10 s aggregate window), each always-on round one whole period, so it holds exactly
# one on-second and two switches whatever its phase. Switching costs the traced process
# too (the kernel writes and restores its breakpoints), so a shorter period here would
# charge it for more switches than the mode makes. Untraced rounds are a quarter as long.
DUTY_ROUNDS = int(os.environ.get("BENCH_DUTY_ROUNDS", "2"))


def always_on_ratio(worker: Worker, t: Traced) -> float:
    """Steps/s of the CPU-bound launch loop under the always-on mode (entry-only launch
    probes on 10% of the time, everything else on) over untraced, best of each over
    alternating rounds; the same tracer, its links made again in that mode."""
    plain: list[float] = []
    on: list[float] = []
    cfg = t.tracer.cfg
    period_s = cfg.agg_interval_ns / 1e9
    with launch_mode(t, returns=False):
        t.tracer.start_duty_cycle(cfg.duty_on_ns, cfg.agg_interval_ns)
        try:
            for _ in range(DUTY_ROUNDS):
                with tracer_off(t):
                    plain.append(worker.ask(op="run", seconds=period_s / 4,
                                            cfg=CPU_BOUND)["steps_per_s"])
                on.append(worker.ask(op="run", seconds=period_s,
                                     cfg=CPU_BOUND)["steps_per_s"])
        finally:
            t.tracer.stop_duty_cycle()
    ratio = max(on) / max(plain)
    print(f"always-on mode (launch probes {cfg.duty_on_ns / 1e9:g} s of every {period_s:g} s, "
          f"CPU-bound launch loop, rounds of one period): steps/s untraced "
          f"{spread(plain, '{:.1f}')}, always-on {spread(on, '{:.1f}')}; ratio of the best "
          f"{ratio:.3f}", flush=True)
    return ratio


def cpu_sample_ratio(worker: Worker, t: Traced) -> float:
    """Steps/s of the CPU-bound launch loop, traced, with the on-CPU sampler at its
    default rate over the sampler stopped (everything else attached in both): the
    median of the per-round ratios, each round a pair of back-to-back runs in
    alternating order. The effect is a fraction of a percent, far below what other
    tenants of a shared machine do to single runs; a pair shares their conditions and
    the median drops the rounds they hit."""
    sampler = t.tracer._oncpu
    if sampler is None:
        raise RuntimeError("the tracer runs without its on-CPU sampler (--cpu-sample-hz 0)")
    off: list[float] = []
    on: list[float] = []

    def run(sampling: bool) -> None:
        (sampler.resume if sampling else sampler.pause)()
        time.sleep(SETTLE_S)
        r = worker.ask(op="run", seconds=WORKLOAD_S, cfg=CPU_BOUND)["steps_per_s"]
        (on if sampling else off).append(r)

    sampler.pause()
    taken = sampler.samples
    with bpf_stats():
        fds = {k: v for k, v in program_fds(t.tracer.bpf).items() if k == "fl_cpu_sample"}
        s0 = prog_stats(fds)
        for i in range(SAMPLE_ROUNDS):
            for sampling in ((False, True) if i % 2 == 0 else (True, False)):
                run(sampling)
        ns, runs = stats_delta(s0, prog_stats(fds)).get("fl_cpu_sample", (0, 0))
    sampler.resume()
    per_round = sorted(b / a for a, b in zip(off, on, strict=True))
    ratio = per_round[len(per_round) // 2]
    # The kernel's own accounting: all of the program's time (every CPU, every task it
    # looked at) against the time it was attached, one CPU's worth.
    share = ns / (SAMPLE_ROUNDS * WORKLOAD_S * 1e9)
    print(f"on-CPU sampler ({sampler.hz} Hz per CPU, CPU-bound launch loop): steps/s "
          f"sampler off {spread(off, '{:.1f}')}, on {spread(on, '{:.1f}')}; per round "
          f"{spread(per_round, '{:.3f}')}, median {ratio:.3f}; ratio of the best "
          f"{max(on) / max(off):.3f}; {sampler.samples - taken} samples of the worker; "
          f"the BPF program ran {runs} times, {ns / max(runs, 1):.0f} ns each: "
          f"{share:.4%} of one CPU while attached", flush=True)
    return ratio


def stacks_ratio(worker: Worker, tmp: Path) -> int:
    """The realistic step again with stacks on (--stacks, default --stack-sample 100 and
    --stack-slow 1ms: native and Python stacks on 1 in 100 kept calls and every slow
    one), printed only; returns the unreported loss."""
    plain: list[float] = []
    traced: list[float] = []
    with Traced(tmp / "stacks.db", [worker.pid], stacks=True) as t:
        for _ in range(WORK_ROUNDS):
            with tracer_off(t):
                plain.append(worker.ask(op="run", seconds=WORKLOAD_S,
                                        cfg=REALISTIC)["steps_per_s"])
            traced.append(worker.ask(op="run", seconds=WORKLOAD_S, cfg=REALISTIC)["steps_per_s"])
    print(f"workload (GPU-bound step) with stacks: steps/s untraced {spread(plain, '{:.1f}')}, "
          f"traced {spread(traced, '{:.1f}')}; ratio of the best {max(traced) / max(plain):.3f}",
          flush=True)
    return int(t.summary.unreported_loss)


# ---- 3. events into SQLite ------------------------------------------------------------------

def launch_rows(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as c:
        return int(c.execute("SELECT count(*) FROM event_data WHERE op = ?",
                             (LAUNCH,)).fetchone()[0])


def _stage_snapshot(t: Traced) -> tuple[dict[str, int], int, int]:
    return dict(t.tracer.stage_ns), t.writer.stats.commit_cpu_ns, t.writer.stats.events_written


def _stage_us(t: Traced, snap: tuple[dict[str, int], int, int], bpf_ns: int
              ) -> tuple[int, dict[str, float]]:
    """(events written since ``snap``, CPU us per event by stage)."""
    st0, c0, w0 = snap
    n = max(1, t.writer.stats.events_written - w0)
    us = {"bpf": bpf_ns / 1e3 / n}
    us.update({k: (t.tracer.stage_ns[k] - st0[k]) / 1e3 / n for k in STAGES})
    us["insert"] = (t.writer.stats.commit_cpu_ns - c0) / 1e3 / n
    return n, us


def events_per_s(worker: Worker, tmp: Path) -> tuple[float, int]:
    """Events/s from the rings into SQLite, per round two ways, one tracer for all:

    * live: the worker floods while the tracer drains, both on the same CPUs; the
      worker's own rate of traced calls is printed, since it can set the pace;
    * backlog: the tracer paused while the worker makes EVENTS_N launches into a ring
      large enough to hold them all, then timed from resuming until the last row is
      committed: the path from the ring buffer to SQLite alone, at full speed (the
      figure on the BENCH line; the CPU per event by stage is this run's).
    """
    db = tmp / "events.db"
    live: list[float] = []
    backlog: list[float] = []
    stages: list[dict[str, float]] = []
    with Traced(db, [worker.pid], sample=1, ring_pages=8192) as t:
        fds = program_fds(t.tracer.bpf)
        for r in range(EVENT_ROUNDS):
            snap = _stage_snapshot(t)
            t0 = time.perf_counter()
            made_s = worker.ask(op="loop", n=EVENTS_N)["ns"] / 1e9
            t.drain()
            elapsed = time.perf_counter() - t0
            n, _ = _stage_us(t, snap, 0)
            live.append(n / elapsed)
            # Backlog: the kernel's run time is taken while the worker fills the ring.
            t.pause()
            with bpf_stats():
                s0 = prog_stats(fds)
                worker.ask(op="loop", n=EVENTS_N)
                bpf = uprobe_ns(stats_delta(s0, prog_stats(fds)))
            snap = _stage_snapshot(t)
            t0 = time.perf_counter()
            t.resume()
            t.drain()
            elapsed = time.perf_counter() - t0
            n, us = _stage_us(t, snap, bpf)
            backlog.append(n / elapsed)
            stages.append(us)
            print(f"  round {r + 1}: live {live[-1]:,.0f} events/s (the worker made "
                  f"{EVENTS_N / made_s:,.0f} calls/s); backlog of {n} drained at "
                  f"{backlog[-1]:,.0f} events/s; CPU us/event: "
                  + " ".join(f"{k} {v:.2f}" for k, v in us.items()), flush=True)
    s = t.summary
    lost = s.lost
    # The launches the worker made: each one is a stored row or a counted loss.
    made = 2 * EVENT_ROUNDS * EVENTS_N
    made_vs_kept = made - launch_rows(db) - (lost.get("cuda", 0) + lost.get("calls_full", 0)
                                             + lost.get("writer_queue", 0)
                                             + lost.get("writer_failed", 0))
    unreported = s.unreported_loss + max(0, made_vs_kept)
    best = max(range(len(backlog)), key=backlog.__getitem__)
    # The kernel's part runs in the worker as it calls; the rest is the tracer's.
    total = sum(v for k, v in stages[best].items() if k != "bpf")
    print(f"events into SQLite: live {spread(live)} events/s; backlog {spread(backlog)} "
          f"events/s; {s.events_written} written, {s.lost_total} lost and reported "
          f"{({k: v for k, v in lost.items() if v})}, {s.unreported_loss} unreported by the "
          f"kernel's count, {made_vs_kept} of {made} launches neither stored nor counted",
          flush=True)
    print(f"tracer's CPU per event in the best backlog round: {total:.2f} us = "
          + " + ".join(f"{k} {v:.2f}" for k, v in stages[best].items() if k != "bpf")
          + f" (one core's worth: {1e6 / total:,.0f} events/s); in the worker, the BPF "
          f"programs' {stages[best]['bpf']:.2f} us", flush=True)
    return max(backlog), unreported


def launch_keys(added: float, other: float) -> str:
    """launch_added_ns (per launch, the default mode: the loop calls only
    cudaLaunchKernel) and launch_returns_added_ns (with --launch-returns), whichever of
    them the default is."""
    from fleetd.trace.bpf.modes import LAUNCH_RETURNS

    full, entry = (added, other) if LAUNCH_RETURNS else (other, added)
    return (f"launch_added_ns={added:.0f} launch_returns_added_ns={full:.0f} "
            f"entry_only_added_ns={entry:.0f}")


def main() -> int:
    if os.geteuid() != 0:
        print("BENCH tracer_overhead needs root (BPF)", file=sys.stderr)
        return 1
    worker = Worker()
    unreported = 0
    try:
        with tempfile.TemporaryDirectory(prefix="fleetd-bench-") as d:
            tmp = Path(d)
            t0 = time.monotonic()
            empty = EmptyPair(worker)
            try:
                added, pair_ns, bpf_ns, u, other_ns = per_call(worker, tmp, empty)
                unreported += u
                t1 = time.monotonic()
                ratio, cpu_ratio, sample_ratio, u, always = workload_ratios(worker, tmp,
                                                                           empty)
            finally:
                empty.close()
            unreported += u
            if STACKS:
                unreported += stacks_ratio(worker, tmp)
            t2 = time.monotonic()
            eps, u = events_per_s(worker, tmp)
            unreported += u
            print(f"phases: per call {t1 - t0:.0f} s, workloads {t2 - t1:.0f} s, events "
                  f"{time.monotonic() - t2:.0f} s", flush=True)
    finally:
        worker.close()
    print(f"BENCH tracer_overhead traced_ratio={ratio:.3f} cpu_bound_ratio={cpu_ratio:.3f} "
          f"added_ns_per_call={added:.0f} empty_pair_ns={pair_ns:.0f} "
          f"bpf_ns_per_event={bpf_ns:.0f} events_per_s={eps:.0f} unreported_loss={unreported} "
          f"cpu_sample_ratio={sample_ratio:.3f} {launch_keys(added, other_ns)} "
          f"always_on_ratio={always:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
