"""``fleetd trace``: record CUDA calls and host events of processes into the node store."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from fleetd.cli.argtypes import byte_size
from fleetd.cli.launch import SIGNALS, Child, command_of, resolve
from fleetd.cli.output import warn
from fleetd.cli.progress import task
from fleetd.cli.trace_args import add_cpu_sample_arg, add_launch_returns_arg, cpu_sample_hz
from fleetd.errors import UsageError
from fleetd.store.db import default_db_path, validate_node_name
from fleetd.store.timeparse import parse_duration

if TYPE_CHECKING:
    from fleetd.trace.tracer import TraceConfig, Tracer, TraceSummary

log = logging.getLogger("fleetd.cli.trace")

HOST_PARTS = ("sched", "mem", "block", "irq", "syscall")
GPU_LAYERS = ("cuda", "driver", "nccl")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace",
        help="record CUDA calls and host events into the node database",
        description="Trace CUDA runtime/driver/graph/NCCL calls (uprobes) and the host "
        "events that delay them (scheduler, D-state, wakeups, page allocations, block I/O, "
        "interrupts, slow syscalls) into the node database, until Ctrl-C, --duration, or "
        "the traced processes exit. Without --pid/--cgroup, every process that calls CUDA "
        "is traced. With -- CMD ARGS, CMD is started under the tracer (its probes in place "
        "before its first instruction), traced with its children until it exits, and its "
        "exit status is fleetd's (SIGTERM and SIGHUP go on to it). Needs root.",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="start this program under the tracer (e.g. fleetd trace -- "
                   "python3 train.py)")
    p.add_argument("--pid", type=int, action="append", default=[], metavar="PID",
                   help="trace this process and the children it starts (repeatable)")
    p.add_argument("--cgroup", action="append", default=[], metavar="PATH",
                   help="trace every process in this cgroup v2 directory (repeatable)")
    p.add_argument("--duration", help="stop after this long, e.g. 30s, 5m (default: Ctrl-C)")
    p.add_argument("--db", type=Path, help="database file (default: $FLEETD_DB or per-user)")
    p.add_argument("--node", help="node name stored with every row (default: hostname)")
    p.add_argument("--cuda-lib", action="append", default=[], metavar="PATH",
                   help="attach to this libcudart/libcuda/libnccl instead of discovering "
                   "(repeatable)")
    p.add_argument("--no-host", action="store_true",
                   help="CUDA calls only: no scheduler, memory, block, irq, syscall events")
    p.add_argument("--host-events", default=",".join(HOST_PARTS), metavar="LIST",
                   help=f"host event groups to trace (default: {','.join(HOST_PARTS)})")
    p.add_argument("--layers", default=",".join(GPU_LAYERS), metavar="LIST",
                   help=f"GPU-side layers to probe (default: {','.join(GPU_LAYERS)})")
    p.add_argument("--sample", type=int, default=100, metavar="N",
                   help="keep 1 in N ordinary launches/async copies as events; every call "
                   "is in the histograms, and anomalies, errors, syncs, allocations, graph "
                   "and NCCL calls are always kept (1 = keep all; default 100)")
    p.add_argument("--slow-k", type=int, default=8, metavar="K",
                   help="a call slower than K x its running median is kept (default 8)")
    p.add_argument("--slow-min", default="20us",
                   help="... if it also took at least this long (default 20us)")
    p.add_argument("--offcpu-min", default="50us",
                   help="keep off-CPU and run-queue intervals at least this long (default 50us)")
    p.add_argument("--syscall-min", default="1ms",
                   help="keep system calls at least this slow (default 1ms)")
    p.add_argument("--irq-min", default="20us",
                   help="keep interrupts that preempted a traced thread this long (default 20us)")
    p.add_argument("--block-min", default="10ms",
                   help="keep other processes' block I/O this slow (default 10ms; the "
                   "targets' own I/O is always kept)")
    p.add_argument("--stacks", action="store_true",
                   help="native and Python stacks on CUDA calls (every call slower than "
                   "--stack-slow and 1 in --stack-sample kept calls), and the waker's "
                   "stack on wakeups of Python processes (at most one per thread pair "
                   "every 20 ms): where a lock holder was when it let go")
    p.add_argument("--stack-sample", type=int, metavar="N",
                   help="with stacks: 1 in N kept calls carries a stack (default 100; 0: "
                   "only slow calls); implies --stacks")
    p.add_argument("--stack-slow", metavar="DUR",
                   help="with stacks: every call at least this long is kept with its stack "
                   "(default 1ms, an absolute threshold); implies --stacks")
    add_cpu_sample_arg(p)
    add_launch_returns_arg(p)
    p.add_argument("--ring-mb", type=int, default=1, metavar="MB",
                   help="size of each ring buffer in MiB, a power of two (default 1)")
    p.add_argument("--max-db-bytes", type=byte_size, metavar="SIZE",
                   help="prune the oldest events beyond this size, e.g. 10G, 512M")
    p.add_argument("--summary-json", action="store_true",
                   help="print a JSON summary of the session on stdout at the end")
    p.add_argument("--status-interval", default="10s",
                   help="how often to log progress when stderr is not a terminal")
    p.set_defaults(func=run)


def _ns(text: str, flag: str) -> int:
    try:
        return parse_duration(text)
    except UsageError as exc:
        raise UsageError(f"{flag}: {exc.message}", exc.hint) from exc


def _csv(text: str, known: tuple[str, ...], flag: str) -> frozenset[str]:
    items = frozenset(x.strip() for x in text.split(",") if x.strip())
    bad = sorted(items - set(known))
    if bad:
        raise UsageError(f"{flag}: unknown {', '.join(map(repr, bad))}",
                         f"choose from {','.join(known)}")
    return items


def _stack_sample(n: int | None) -> int:
    if n is None:
        return 100
    if n < 0:
        raise UsageError(f"--stack-sample {n} is negative",
                         "use 1 for a stack on every kept call, N for 1 in N, 0 for slow "
                         "calls only")
    return n


def build_config(args: argparse.Namespace) -> TraceConfig:
    from fleetd.trace.tracer import TraceConfig

    node = args.node or socket.gethostname()
    validate_node_name(node)
    if args.sample < 0:
        raise UsageError(f"--sample {args.sample} is negative",
                         "use 1 to keep every call, N to keep 1 in N, 0 for anomalies only")
    if args.ring_mb < 1 or args.ring_mb & (args.ring_mb - 1):
        raise UsageError(f"--ring-mb {args.ring_mb} is not a power of two", "e.g. 1, 4 or 16")
    for pid in args.pid:
        if pid <= 0:
            raise UsageError(f"--pid {pid} is not a process id", "pass a positive pid")
    layers = set(_csv(args.layers, GPU_LAYERS, "--layers"))
    parts = _csv(args.host_events, HOST_PARTS, "--host-events")
    if not args.no_host:
        layers.add("host")
    return TraceConfig(
        db=args.db or default_db_path(),
        node=node,
        pids=list(dict.fromkeys(args.pid)),
        cgroups=list(args.cgroup),
        cuda_libs=list(args.cuda_lib),
        layers=frozenset(layers),
        host_parts=parts,
        sample=args.sample,
        slow_k=max(1, args.slow_k),
        slow_min_ns=_ns(args.slow_min, "--slow-min"),
        stacks=bool(args.stacks or args.stack_sample is not None or args.stack_slow),
        stack_sample=_stack_sample(args.stack_sample),
        stack_slow_ns=_ns(args.stack_slow or "1ms", "--stack-slow"),
        ring_pages=args.ring_mb * 256,
        thresholds_ns={
            "offcpu": _ns(args.offcpu_min, "--offcpu-min"),
            "runq": _ns(args.offcpu_min, "--offcpu-min"),
            "irq": _ns(args.irq_min, "--irq-min"),
            "syscall": _ns(args.syscall_min, "--syscall-min"),
            "block": _ns(args.block_min, "--block-min"),
        },
        max_db_bytes=args.max_db_bytes,
        cpu_sample_hz=cpu_sample_hz(args.cpu_sample_hz),
        launch_returns=args.launch_returns, mode=args.mode,
        command=" ".join(["fleetd", *sys.argv[1:]]) if sys.argv else None,
    )


class _Stop:
    """SIGTERM/SIGINT set a flag; the loop stops and flushes (no traceback, no loss).
    With a program started under the tracer, they go on to it instead (launch.Child) and
    tracing stops when it exits."""

    def __init__(self, child: Child | None = None) -> None:
        self.event = threading.Event()
        self.signal: int | None = None
        self.child = child

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.child is not None:
            self.child.forward(signum)
            return
        self.signal = signum
        self.event.set()

    def done(self) -> str | None:
        """Why the loop should end now, if it should."""
        if self.event.is_set():
            return "interrupted" if self.signal == signal.SIGINT else "terminated"
        if self.child is not None and self.child.poll() is not None:
            return f"the command exited with status {self.child.code}"
        return None


def _command(args: argparse.Namespace) -> list[str]:
    cmd = command_of(list(args.command or []))
    if cmd and (args.pid or args.cgroup):
        raise UsageError("a command after -- with --pid/--cgroup",
                         "trace either the program you start or running processes")
    if cmd:
        resolve(cmd)  # not found: said before anything starts
    return cmd


def run(args: argparse.Namespace) -> int:
    from fleetd.trace.host.require import require_tracing

    duration_ns = _ns(args.duration, "--duration") if args.duration else None
    interval_s = _ns(args.status_interval, "--status-interval") / 1e9
    cmd = _command(args)
    cfg = build_config(args)
    require_tracing("fleetd trace")  # a client-only install says so, and how to fix it
    from fleetd.trace.tracer import Tracer

    child = Child.spawn(cmd) if cmd else None
    if child is not None:
        cfg.pids = [child.pid]
    tracer = Tracer(cfg)
    try:
        # Each stage the tracer names (compiling, loading from the cache, attaching) is a
        # line at once; in a pipe a line every few seconds while it lasts (a compile
        # under load takes a minute), on a terminal one live line; none with --quiet.
        with task("starting", first_s=0.0) as shown:
            tracer.start(shown.step)
    except BaseException:
        if child is not None:
            child.abandon()
        raise
    _announce(tracer, cfg, sys.stderr)
    stop = _Stop(child)
    old = {s: signal.signal(s, stop) for s in SIGNALS}
    if child is not None:
        child.release()
    try:
        reason = _loop(tracer, stop, duration_ns, interval_s, sys.stderr)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    summary = tracer.stop()
    _report(summary, cfg, reason, sys.stderr)
    if args.summary_json:
        print(_summary_json(summary, cfg), flush=True)
    return _exit_status(child)


def _exit_status(child: Child | None) -> int:
    """fleetd's status: the program's when it ran one (waiting for it if --duration ended
    the trace first: it was never fleetd's to stop)."""
    if child is None:
        return 0
    while child.poll() is None:
        time.sleep(0.05)
    assert child.code is not None
    return child.code


def _announce(tracer: Tracer, cfg: TraceConfig, err: TextIO) -> None:
    what = (f"pid {', '.join(map(str, cfg.pids))}" if cfg.pids else
            f"cgroup {', '.join(cfg.cgroups)}" if cfg.cgroups else "every CUDA process")
    warn(tracer.warnings, out=err)
    libs = len(tracer.libs)
    route = tracer.route.name if tracer.route else "?"
    print(f"fleetd: tracing {what}: {tracer.report.uprobes} uprobes on {libs} "
          f"librar{'y' if libs == 1 else 'ies'}, host events "
          f"{'on' if 'host' in cfg.layers else 'off'}, headers {route}; writing {cfg.db} "
          f"(session {cfg.node}:{tracer.session}); Ctrl-C to stop", file=err, flush=True)


def _loop(tracer: Tracer, stop: _Stop, duration_ns: int | None, interval_s: float,
          err: TextIO) -> str:
    t0 = time.monotonic()
    tty = err.isatty()
    last_status, last_records, last_t, last_check = t0, 0, t0, t0
    while (why := stop.done()) is None:
        tracer.poll(100)
        now = time.monotonic()
        if duration_ns is not None and (now - t0) * 1e9 >= duration_ns:
            _end_line(err, tty)
            return "duration reached"
        if now - last_check >= 0.25 and stop.child is None:
            last_check = now
            if tracer.targets_gone():
                _end_line(err, tty)
                return "the traced processes exited"
        if now - last_status >= (1.0 if tty else interval_s):
            st = tracer.status()
            rate = (st["records"] - last_records) / max(now - last_t, 1e-9)
            line = (f"fleetd: {now - t0:7.1f}s  events {st['records']} ({rate:,.0f}/s)  "
                    f"lost {st['lost']}  targets {st['targets']}  probes {st['probes']}")
            if tty:
                err.write("\r\x1b[K" + line)
                err.flush()
            else:
                print(line, file=err, flush=True)
            last_status, last_records, last_t = now, st["records"], now
    _end_line(err, tty)
    return why


def _end_line(err: TextIO, tty: bool) -> None:
    if tty:
        err.write("\n")
        err.flush()


def _report(s: TraceSummary, cfg: TraceConfig, reason: str, err: TextIO) -> None:
    rate = s.records / s.duration_s if s.duration_s > 0 else 0.0
    print(f"fleetd: stopped ({reason}) after {s.duration_s:.1f}s: {s.events_written} events "
          f"({rate:,.0f}/s), {s.sampled_out} calls kept only in histograms, "
          f"{s.lost_total} lost; session {cfg.node}:{s.session} in {cfg.db}",
          file=err, flush=True)
    if s.lost_total:
        worst = ", ".join(f"{k}={v}" for k, v in s.lost.items() if v)
        print(f"fleetd: warning: events were lost ({worst}); try a larger --ring-mb or a "
              "higher --sample", file=err)
    if s.writer.last_error:
        warn([f"database writes failed: {s.writer.last_error}"], out=err)
    if s.mapping.get("late"):
        warn([f"{s.mapping['late']} libraries were probed after their process mapped them: "
              "calls before the probes may be missing (sessions.targets.mapping)"], out=err)


def _summary_json(s: TraceSummary, cfg: TraceConfig) -> str:
    return json.dumps({
        "node": cfg.node, "session": s.session, "db": str(cfg.db),
        "duration_s": round(s.duration_s, 3), "records": s.records,
        "events_written": s.events_written, "made_in_user_space": s.made_in_user_space,
        "sampled_out": s.sampled_out,
        "lost": s.lost, "lost_total": s.lost_total, "unreported_loss": s.unreported_loss,
        "targets": s.targets, "libraries": s.libraries, "probes": s.probes,
        "headers_route": s.headers_route, "mapping": s.mapping,
    }, sort_keys=True)
