"""``fleetd watch``: poll the fleet's NCCL ranks, flag stragglers as they happen, and name
the rank a hung job waits for.

Every ``--interval`` it asks each agent for its ranks' last collectives and process
states (``GET /api/v1/ranks``, over one client session kept for the whole watch) and
judges them as one job (:mod:`fleetd.fleet.hang`). While nothing hangs it shows a
status line on a terminal and stays quiet in a pipe; on a hang it prints the verdict
and exits 6. A node that does not answer is a warning (printed when it starts or
stops failing), never a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fleetd.cli.fleet_args import add_fleet_args, fleet_options, seconds
from fleetd.errors import UsageError
from fleetd.fleet.notify import Delivery
from fleetd.printable import printable, printable_tree
from fleetd.wire.headers import WEBHOOK_SIGNATURE

if TYPE_CHECKING:  # the command loads it only when it runs: `fleetd --version` stays quick
    from fleetd.fleet.client import FleetClient
    from fleetd.fleet.hang import HangJson, HangVerdict
    from fleetd.fleet.notify import Notifier
    from fleetd.fleet.straggle import Changes, StragglerJson, StraggleWatch

log = logging.getLogger("fleetd.watch")

EXIT_OK = 0
EXIT_PARTIAL = 3  # --once: some node did not answer (as every fleet command)
EXIT_NO_ANSWER = 4  # no node answered any poll
EXIT_HANG = 6  # a hang (or a job that died while watched) was found
POLL_TIMEOUT_S = 3.0  # per poll, unless --timeout says otherwise (at least the interval)


@dataclass(frozen=True, slots=True)
class WatchSpec:
    hang_after_s: float
    interval_s: float
    once: bool
    for_s: float | None
    fmt: str
    # Where findings and recoveries go (fleetd.fleet.notify); with one, watch keeps
    # watching after a hang to see it recover.
    delivery: Delivery | None = None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "watch",
        help="watch the fleet's NCCL ranks; flag stragglers, name the rank a hung job waits "
        "for (exit 6)",
        description="Poll every agent's NCCL ranks (their last collective per communicator, "
        "last send/receive per peer, last CUDA call and process state) every --interval "
        "and judge them as one fleet. When some ranks of a communicator or torchrun job "
        "have entered collective N and another rank has not within --hang-after (or no "
        "rank has progressed for that long while one is stopped, in D state or dead, or a "
        "send has had no matching receive), print the verdict: which rank (node, pid) "
        "never arrived, where it is instead, its top causal chain, and the ranks waiting "
        "on it; then exit 6. A job that dies while watched is reported the same way. A "
        "rank that enters last at most of its group's collectives of the last 5 s, by a "
        "margin, for 2 polls is a straggler: STRAGGLER, then CAUSE (the causal chain of "
        "the cause whose share of its time rose most over the same rank's before the onset "
        "and its on-time peers' meanwhile), and RECOVERED once it is on time for 3 polls; "
        "watch goes on. A "
        "node that does not answer within --timeout (here 3 s by default, or the interval "
        "when longer) is a warning, not a hang. Exit status: 0 no hang (--once, --for), "
        "3 no hang but some node did not answer (--once), 6 a hang, 4 no node ever "
        "answered, 2 a usage mistake.",
    )
    p.add_argument("--hang-after", default="15s", metavar="DURATION",
                   help="how long ranks may wait for one that has not arrived (default 15s)")
    p.add_argument("--interval", default="1s", metavar="DURATION",
                   help="time between polls (default 1s)")
    p.add_argument("--once", action="store_true",
                   help="poll once, print the verdict (hang or not) and exit")
    p.add_argument("--for", dest="for_", metavar="DURATION",
                   help="stop after watching this long without a hang (exit 0)")
    p.add_argument("--format", default="table", help="output format: table|json")
    n = p.add_argument_group(
        "telling someone", "send each finding and each recovery as JSON (docs/fleet.md); "
        "with either, watch keeps watching after a hang until it recovers, --for ends or "
        "Ctrl-C (exit 6 if any hang was found)")
    n.add_argument("--webhook", metavar="URL",
                   help="POST each finding and recovery to this http(s) URL (redirects are "
                   "not followed)")
    n.add_argument("--webhook-secret-file", type=Path, metavar="FILE",
                   help=f"shared secret: each POST carries {WEBHOOK_SIGNATURE}, "
                   "sha256=HMAC(secret, timestamp '.' body)")
    n.add_argument("--exec", dest="exec_", metavar="CMD",
                   help="run CMD (split as a shell would, no shell) with each finding as "
                   "JSON on its stdin")
    n.add_argument("--notify-timeout", default="5s", metavar="DURATION",
                   help="time allowed per POST or per run of --exec (default 5s)")
    n.add_argument("--notify-attempts", type=int, default=3, metavar="N",
                   help="tries per message, the pause doubling from 0.5 s (default 3)")
    add_fleet_args(p, skew=False, timeout_default=f"{POLL_TIMEOUT_S:g}s per poll, or "
                   "--interval when longer, at most the config's timeout_s")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.runner import run_loop

    if args.format not in ("table", "json"):
        raise UsageError(f"unknown format {args.format!r} for watch", "use table or json")
    spec = WatchSpec(
        hang_after_s=seconds(args.hang_after, "--hang-after"),
        interval_s=seconds(args.interval, "--interval"),
        once=bool(args.once),
        for_s=seconds(args.for_, "--for") if args.for_ else None,
        fmt=args.format,
        delivery=_delivery(args))
    opts = fleet_options(args)
    if not args.timeout:  # one slow node must not hold a poll back for 10 s
        per_poll = max(POLL_TIMEOUT_S, spec.interval_s)
        client = dataclasses.replace(
            opts.client, timeout_s=min(opts.client.timeout_s, per_poll),
            connect_timeout_s=min(opts.client.connect_timeout_s, per_poll))
        opts = dataclasses.replace(opts, client=client)
    code: int = run_loop(watch(opts, spec, sys.stdout, sys.stderr))
    return code


def _delivery(args: argparse.Namespace) -> Delivery | None:
    d = Delivery.parse(args.webhook, args.webhook_secret_file, args.exec_,
                       seconds(args.notify_timeout, "--notify-timeout"), args.notify_attempts)
    return d if d.wanted else None


def _evidence(answer: Any, hangs: list[HangJson], node: str | None = None
              ) -> str | None:
    """Where the first culprit's node (or ``node``) shows its ranks (the agent's ranks
    route)."""
    from fleetd.wire.paths import RANKS

    if node is None:
        culprits = hangs[0]["culprits"] if hangs else []
        node = culprits[0]["node"] if culprits else None
    for o in answer.outcomes:
        if o.name == node:
            return f"https://{o.target.address}{RANKS}"
    return None


async def watch(opts: Any, spec: WatchSpec, out: TextIO, err: TextIO) -> int:
    """Poll until a hang, --once, --for, Ctrl-C or SIGTERM; returns the exit status."""
    from fleetd.fleet.client import FleetClient
    from fleetd.fleet.notify import Notifier
    from fleetd.fleet.straggle import CAUSE_ASK_S, StraggleWatch

    notifier = Notifier(spec.delivery) if spec.delivery is not None else None
    stop = _Stop.install()
    try:
        # the causes' chains asks on connections of their own, with time to answer
        asks = dataclasses.replace(opts.client, timeout_s=max(opts.client.timeout_s,
                                                              CAUSE_ASK_S))
        async with FleetClient(opts.client) as client, FleetClient(asks) as asker:
            straggle = StraggleWatch(asker=asker)
            try:
                return await _polls(opts, spec, out, err, client, notifier, stop, straggle)
            finally:
                await straggle.aclose()
    except asyncio.CancelledError:
        if stop.requested:  # the second signal
            raise KeyboardInterrupt from None
        raise
    finally:
        stop.remove()


async def _polls(opts: Any, spec: WatchSpec, out: TextIO, err: TextIO, client: FleetClient,
                 notifier: Notifier | None, stop: _Stop, straggle: StraggleWatch) -> int:
    from fleetd.fleet.hang import DetailAsks, poll

    live = _tty(err)
    started = time.monotonic()
    shown: set[str] = set()
    answered_ever = False
    hung_ever = False
    polls = 0
    detail = DetailAsks()
    while True:
        t0 = time.monotonic()
        # A job that died while we watched is a finding; one that died before is not.
        within = spec.hang_after_s if spec.once else max(
            spec.hang_after_s, t0 - started + 2 * spec.interval_s)
        answer, result = await poll(opts, client, spec.hang_after_s,
                                    deaths_within_s=within, detail=detail,
                                    straggle=straggle)
        polls += 1
        answered_ever = answered_ever or bool(answer.answered)
        warnings = result["warnings"]
        fresh = [w for w in warnings if w not in shown]
        if fresh and live:
            err.write("\r\x1b[K")
        for w in fresh:  # a node's text: one escaped line
            print(f"fleetd: warning: {printable(str(w))}", file=err)
        shown = set(warnings)
        hangs = result.get("hangs") or [] if result["status"] == "hang" else []
        if not spec.once:
            print_straggle(straggle.changes, spec.fmt, out, live and err)
        if notifier is not None and answer.answered:  # no answer: nothing recovered
            late = [{**s, "evidence": _evidence(answer, [], s["node"])}
                    for s in straggle.current()]
            sent = await notifier.update(hangs, _evidence(answer, hangs), stragglers=late)
            if live and sent:
                err.write("\r\x1b[K")
            for f in sent:
                if f["kind"] == "straggler":  # printed above, as it turned
                    continue
                if f["status"] == "resolved":
                    print(printable(f"RECOVERED ({f['kind']}): {f['job']}: "
                                    f"{f['culprit']} (first seen {f['first_seen']})"),
                          file=out, flush=True)
                elif not spec.once:
                    print_verdict({**result, "hangs": [
                        h for h in hangs if f["summary"] == h.get("summary")]},
                        spec.fmt, out)
        if hangs:
            hung_ever = True
            if notifier is None or spec.once:
                if live:
                    err.write("\r\x1b[K")
                print_verdict(result, spec.fmt, out)
                return EXIT_HANG
        code = EXIT_OK if answered_ever else EXIT_NO_ANSWER
        if hung_ever:
            code = EXIT_HANG
        elif answer.failed and answer.answered and spec.once:
            code = EXIT_PARTIAL
        if spec.once:
            print_verdict(result, spec.fmt, out)
            return code
        watched = time.monotonic() - started
        line = status_line(result, len(answer.answered), len(answer.outcomes), watched)
        if live:
            err.write(f"\r\x1b[K{line}")
            err.flush()
        else:
            log.debug("%s", line)
        if stop.requested or (spec.for_s is not None and watched >= spec.for_s):
            if live:
                err.write("\r\x1b[K")
            if spec.fmt == "json":
                print_verdict(result, spec.fmt, out)
            log.info("%s in %d poll(s) over %.1f s",
                     "stopped" if stop.requested else "no hang", polls, watched)
            return code
        pause = spec.interval_s - (time.monotonic() - t0)
        if spec.for_s is not None:
            pause = min(pause, spec.for_s - (time.monotonic() - started))
        await stop.wait(max(0.0, pause))


@dataclass(slots=True)
class _Stop:
    """SIGTERM or Ctrl-C asks the watch to end after the poll in hand: a recovery being
    posted is posted (a supervisor stopping the watch right after a job recovered lost
    the --exec half of it), and the exit status is what --for would give. A second
    signal stops at once (130)."""

    event: asyncio.Event
    task: asyncio.Task[Any] | None
    signals: tuple[int, ...] = ()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    @classmethod
    def install(cls) -> _Stop:
        import signal

        loop = asyncio.get_running_loop()
        stop = cls(asyncio.Event(), asyncio.current_task())
        wanted = (signal.SIGTERM, signal.SIGINT)
        try:
            for sig in wanted:
                loop.add_signal_handler(sig, stop._signalled)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            stop.remove()
            return stop
        stop.signals = wanted
        return stop

    def _signalled(self) -> None:
        if self.event.is_set() and self.task is not None:
            self.task.cancel()  # the second signal: the CLI reports 130
        self.event.set()

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            loop.remove_signal_handler(sig)
        self.signals = ()

    async def wait(self, timeout_s: float) -> None:
        """Sleep ``timeout_s``, or less if a stop is asked for."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout_s)


def status_line(result: HangVerdict, answered: int, total: int, watched: float) -> str:
    groups = result.get("groups") or []
    what = "; ".join(f"{g['group']} at collective {g['seq']}" for g in groups[:2])
    if len(groups) > 2:
        what += f" and {len(groups) - 2} more"
    late = result.get("stragglers") or []
    flagged = f"{len(late)} straggler(s)" if late else "no straggler"
    return printable(f"fleetd: watching {answered}/{total} node(s), "
                     f"{result.get('ranks', 0)} rank(s){': ' + what if what else ''}; "
                     f"no hang, {flagged} ({watched:.0f} s)")


def print_straggle(changes: Changes, fmt: str, out: TextIO, live: TextIO | bool) -> None:
    """What this poll turned, one line each: a rank flagged late (STRAGGLER), its cause
    named (CAUSE), a flagged rank on time again (RECOVERED); JSON lines with --format
    json."""
    from fleetd.cli.output import dumps

    events = ([("straggler", s) for s in changes.flagged]
              + [("cause", s) for s in changes.named]
              + [("recovered", s) for s in changes.recovered])
    if events and not isinstance(live, bool):
        live.write("\r\x1b[K")
    for event, s in events:
        if fmt == "json":
            out.write(dumps({"event": event, **s}).decode() + "\n")
        elif event == "straggler":
            out.write(printable(f"STRAGGLER: {s['summary']}") + "\n")
        elif event == "cause":
            chain = s["top_chain"]
            severity, cause, summary = ((chain["severity"], chain["root_cause"],
                                         chain["summary"]) if chain else (None, None, None))
            out.write(printable(f"CAUSE of rank {s['rank']} ({s['node']} pid {s['pid']}): "
                                f"[{severity}] {cause}: {summary}{_change(s)}") + "\n")
        else:
            out.write(printable(f"RECOVERED (straggler): {s['group']}: rank {s['rank']} "
                                f"({s['node']} pid {s['pid']}) on time again") + "\n")
    out.flush()


def _change(s: StragglerJson) -> str:
    """How much the named cause rose: the reason it, not the costliest, is named."""
    x = s.get("changed")
    if x is None:
        return ""
    before = [f"{name} {v:.1%}" for name, v in (("before", x["baseline"]),
                                                   ("peers", x["peers"])) if v is not None]
    return f" (now {x['share']:.1%} of its time; {', '.join(before) or 'no reference'})"


def print_verdict(result: HangVerdict, fmt: str, out: TextIO) -> None:
    from fleetd.cli.output import dumps

    if fmt == "json":
        out.write(dumps(result).decode() + "\n")
        out.flush()
        return
    result = printable_tree(result)  # job, culprit and chain text come from the nodes
    if result["status"] != "hang":
        out.write(f"{result['verdict']} ({result['ranks']} rank(s) on "
                  f"{len(result['nodes'])} node(s))\n")
        return
    for i, h in enumerate(result["hangs"]):
        if i:
            out.write("\n")
        out.write(f"HANG ({h['kind']}, {h['matching']} matching): {h['summary']}\n")
        al = h.get("alignment")
        if al and al.get("ambiguous_ranks"):
            out.write(f"ambiguous: the numbers of rank(s) "
                      f"{', '.join(map(str, al['ambiguous_ranks']))} could not be aligned\n")
        out.write(_culprit_table(h))
        out.write(_waiting_table(h))
        for c in h["culprits"]:
            chain = c.get("top_chain")
            if chain and chain.get("summary"):
                out.write(f"top chain of {c['node']} pid {c['pid']}: [{chain.get('severity')}] "
                          f"{chain.get('root_cause')}: {chain['summary']}\n")
    out.flush()


def _culprit_table(h: HangJson) -> str:
    from fleetd.cli.output import table

    rows = []
    for c in h["culprits"]:
        lc = c["last_call"]
        last = f"{lc['op']} {lc['age_s']:.1f} s ago" if lc else None
        rows.append([c["node"], c["pid"], c["rank"], c["state"], c.get("wchan"),
                     c.get("exit_code"), c["seq"], last])
    title = "never arrived" if h["kind"] in ("collective", "p2p") else "stuck"
    if h["kind"] == "exited":
        title = "died first"
    return f"{title}:\n" + table(["node", "pid", "rank", "state", "wchan", "exit_code",
                                   "last_seq", "last_call"], rows)


def _waiting_table(h: HangJson) -> str:
    from fleetd.cli.output import table

    rows = [[w["node"], w["pid"], w["rank"], w["state"], w["op"], w["seq"], w["age_s"]]
            for w in h["waiting"]]
    title = "exited after it" if h["kind"] == "exited" else "waiting"
    return f"{title}:\n" + table(["node", "pid", "rank", "state", "op", "seq", "for_s"], rows)


def _tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
