"""The options every fleet command shares, and how their answers are reported.

A command runs against the fleet when ``--nodes`` or ``--config`` is given, else on a
local database (``--db``, ``$FLEETD_DB``); with neither, a config found where users keep
one (``$FLEETD_CONFIG``, ``~/.config/fleetd/fleetd.yaml``, ``/etc/fleetd/fleetd.yaml``)
that lists fleet nodes makes it a fleet command. Flags override environment variables
(``FLEETD_CA_CERT``, ``FLEETD_CLIENT_CERT``, ``FLEETD_CLIENT_KEY``, ``FLEETD_TOKEN_FILE``),
which override the config's ``fleet:`` section.

Exit codes of a fleet command (docs/cli.md): 0 every node answered; 3 partial (some
nodes answered, a warning names each one that did not); 4 no node answered; 2 a usage
error, including a request every node refused as malformed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from fleetd.errors import UsageError
from fleetd.printable import printable
from fleetd.store.timeparse import parse_duration

if TYPE_CHECKING:
    from fleetd.fleet.combine import NodeWarning
    from fleetd.fleet.fanout import FleetAnswer, FleetOptions

FLEET_FLAGS = ("nodes", "config", "ca_cert", "client_cert", "client_key", "token_file",
               "show_skew", "clock_skew_threshold", "no_skew_correct", "relay_via",
               "fanout_degree")
_FLAG_NAMES = {"no_skew_correct": "--no-clock-correction"}  # dest -> the flag's one name


TIMEOUT_DEFAULT = "the config's timeout_s, else 10s"


def add_fleet_args(p: argparse.ArgumentParser, *, timeout: bool = True,
                   skew: bool = True, correction: bool = True,
                   timeout_default: str = TIMEOUT_DEFAULT) -> None:
    """The shared fleet flags; ``skew=False`` leaves out --show-skew and
    --no-clock-correction for commands that always report offsets and never shift
    timestamps; ``correction=False`` leaves --no-clock-correction to the command;
    ``timeout_default`` says what --timeout is when not given, where a command differs."""
    g = p.add_argument_group(
        "fleet", "ask every node's agent (in parallel, over mTLS) instead of a local --db")
    g.add_argument("--nodes", metavar="HOST:PORT,...",
                   help="the agents to ask; an entry may be NAME=HOST:PORT; @FILE reads them "
                   "from a file (a fleetd.yaml with fleet.nodes, or one per line)")
    g.add_argument("--config", type=Path, metavar="CONFIG",
                   help="fleetd.yaml whose fleet: section lists nodes and certificates "
                   "(default: $FLEETD_CONFIG, ~/.config/fleetd/fleetd.yaml, "
                   "/etc/fleetd/fleetd.yaml)")
    g.add_argument("--ca-cert", type=Path, metavar="PEM",
                   help="fleet CA that the agents' certificates chain to ($FLEETD_CA_CERT)")
    g.add_argument("--client-cert", type=Path, metavar="PEM",
                   help="this client's certificate, mTLS ($FLEETD_CLIENT_CERT)")
    g.add_argument("--client-key", type=Path, metavar="PEM",
                   help="its private key ($FLEETD_CLIENT_KEY)")
    g.add_argument("--token-file", type=Path, metavar="FILE",
                   help="bearer token, if the agents require one ($FLEETD_TOKEN_FILE)")
    g.add_argument("--relay-via", metavar="NODE,...",
                   help="ask these agents to relay to the other nodes, which are split "
                   "evenly between them (a node of --nodes by NAME or HOST:PORT, or another "
                   "HOST:PORT); see docs/fleet.md, Relays")
    g.add_argument("--fanout-degree", type=int, metavar="K",
                   help="relay automatically: the first node of every group of K asks the "
                   "other K-1 (a two-level tree)")
    if timeout:
        g.add_argument("--timeout", metavar="DURATION",
                       help="time for the whole fan-out; slower nodes become warnings "
                       f"(default: {timeout_default})")
    if skew:
        g.add_argument("--show-skew", action="store_true",
                       help="print each node's clock offset and its error bound")
    g.add_argument("--clock-skew-threshold", metavar="DURATION",
                   help="warn when a node's clock is further off than this (default 10ms)")
    if skew and correction:
        g.add_argument("--no-clock-correction", dest="no_skew_correct", action="store_true",
                       help="leave node timestamps in each node's own clock")
        g.add_argument("--no-skew-correct", dest="no_skew_correct", action="store_true",
                       help=argparse.SUPPRESS)  # the old name, kept working


def fleet_mode(args: argparse.Namespace) -> bool:
    """True when the command should ask the fleet; refuses --db together with it. A
    config found without --config is put in ``args.config`` when it decides."""
    wanted = bool(getattr(args, "nodes", None) or getattr(args, "config", None))
    on_disk = getattr(args, "db", None) or getattr(args, "lake", None)  # a file or a lake
    if not wanted and not on_disk and not os.environ.get("FLEETD_DB"):
        found = _discovered_fleet()
        if found is not None:
            args.config = found
            return True
    if wanted and getattr(args, "db", None):
        raise UsageError("--db reads a local database; --nodes/--config ask the fleet",
                         "use one of them (merge copied databases with fleetd merge)")
    if wanted and getattr(args, "lake", None):
        raise UsageError("--lake reads a Parquet lake; --nodes/--config ask the fleet",
                         "use one of them (fill a lake with fleetd export --format parquet)")
    if not wanted:
        local = getattr(args, "local_flags", ())  # flags the command also uses on a file
        given = [_FLAG_NAMES.get(f, f"--{f.replace('_', '-')}") for f in FLEET_FLAGS
                 if f not in local and getattr(args, f, None) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} only apply to a fleet query",
                             "add --nodes HOST:PORT,... or --config fleetd.yaml")
    return wanted


def _discovered_fleet() -> Path | None:
    """A config found where users keep one, when it lists fleet nodes to ask."""
    from fleetd.config import discover_config, load_config

    path = discover_config()
    return path if path is not None and load_config(path).fleet.nodes else None


def _cert_path(flag: Path | None, env: str, configured: Path | None) -> Path | None:
    named = os.environ.get(env)
    return flag or (Path(named).expanduser() if named else None) or configured


def seconds(text: str, what: str) -> float:
    """``10s``, ``500ms`` or a bare number of seconds."""
    try:
        value = float(text)
    except ValueError:
        return parse_duration(text) / 1e9
    if value <= 0:
        raise UsageError(f"{what} {text!r} must be more than zero", "e.g. 10s or 500ms")
    return value


def milliseconds(text: str, what: str) -> float:
    """``10ms``, ``0.5s`` or a bare number of milliseconds."""
    try:
        value = float(text)
    except ValueError:
        return parse_duration(text) / 1e6
    if value < 0:
        raise UsageError(f"{what} {text!r} must not be negative", "e.g. 10ms")
    return value


def fleet_options(args: argparse.Namespace) -> FleetOptions:
    """Targets, TLS material and limits from the flags, then the config, then defaults."""
    from fleetd.config import FleetConfig, load_config
    from fleetd.fleet.client import ClientOptions
    from fleetd.fleet.fanout import FleetOptions
    from fleetd.fleet.relayed import plan_routes
    from fleetd.fleet.targets import from_config, parse_nodes
    from fleetd.security import tls

    if not args.config and not args.nodes:
        args.config = _discovered_fleet()
    elif not args.config:
        # --nodes with certificates from the config users keep (when there is one).
        from fleetd.config import discover_config
        args.config = discover_config()
    fleet = load_config(args.config).fleet if args.config else FleetConfig()
    targets = parse_nodes(args.nodes) if args.nodes else from_config(fleet, str(args.config))
    routes = plan_routes(targets, getattr(args, "relay_via", None),
                         getattr(args, "fanout_degree", None))
    # Values first, certificates after: a typo is reported before any file is read.
    timeout_text = getattr(args, "timeout", None)
    timeout = seconds(timeout_text, "--timeout") if timeout_text else fleet.timeout_s
    threshold = (milliseconds(args.clock_skew_threshold, "--clock-skew-threshold")
                 if args.clock_skew_threshold else fleet.clock_skew_threshold_ms)
    ca = _cert_path(args.ca_cert, "FLEETD_CA_CERT", fleet.ca)
    if ca is None:
        raise UsageError(
            "asking the fleet needs the fleet CA, to verify each agent",
            "pass --ca-cert certs/ca.pem --client-cert certs/NAME.pem --client-key "
            "certs/NAME.key (or set FLEETD_CA_CERT, FLEETD_CLIENT_CERT, FLEETD_CLIENT_KEY), "
            "or keep a fleetd.yaml with fleet.ca, fleet.client_cert, fleet.client_key in "
            "~/.config/fleetd/")
    cert = _cert_path(args.client_cert, "FLEETD_CLIENT_CERT", fleet.client_cert)
    key = _cert_path(args.client_key, "FLEETD_CLIENT_KEY", fleet.client_key)
    context = tls.client_context(ca, cert, key)
    token_file = _cert_path(args.token_file, "FLEETD_TOKEN_FILE", fleet.token_file)
    client = ClientOptions(
        ssl=context, token=tls.load_token(token_file) if token_file else None,
        timeout_s=timeout, connect_timeout_s=min(fleet.connect_timeout_s, timeout),
        concurrency=max(1, fleet.concurrency), has_client_cert=cert is not None)
    return FleetOptions(tuple(targets), client,
                        correct=not getattr(args, "no_skew_correct", False),
                        skew_threshold_ms=threshold, relays=routes)


def report(answer: FleetAnswer, show_skew: bool, out: TextIO = sys.stderr) -> None:
    """Warnings, one line per node, and the skew table when asked; on stderr so that
    piped rows stay clean."""
    print_warnings(answer.warnings, out)
    if show_skew:
        print_skew(answer, out)
    if answer.status != "complete":
        n, total = len(answer.answered), len(answer.outcomes)
        what = "partial answer" if n else "no answer"
        print(f"fleetd: {what}: {n} of {total} node(s) answered", file=out)


def print_warnings(warnings: list[NodeWarning], out: TextIO = sys.stderr) -> None:
    for w in warnings:
        # A node's error text is the node's to choose: one line, no escape sequence.
        print(f"fleetd: warning: {printable(f'node {w.node}: {w.error}')}", file=out)


def print_skew(answer: FleetAnswer, out: TextIO = sys.stderr) -> None:
    from fleetd.cli.output import table

    rows = []
    for o in answer.outcomes:
        if o.skew is not None:
            rows.append([o.name, round(o.skew.offset_ms, 3), round(o.skew.error_ms, 3),
                         o.skew.used, "yes" if answer.correct and o.skew.offset_ns else "no"])
        else:
            rows.append([o.name, None, None, 0, "no"])
    out.write("clock skew (node clock minus this machine's):\n")
    out.write(table(["node", "offset_ms", "error_ms", "samples", "corrected"], rows))
