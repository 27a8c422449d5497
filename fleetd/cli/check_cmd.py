"""``fleetd check``: can this machine trace, serve and reach its fleet?

Groups of checks, each selectable with ``--only``: ``host`` (kernel, privileges, BPF,
tracefs, bcc, headers, clock), ``cuda`` (libraries, symbols, a real compile and attach),
``db`` (the database path), ``certs`` (the agent's and the client's certificates) and
``nodes`` (every fleet node over mTLS). Only host and cuda need root. Exit status 1 when
any check fails, else 0; 2 for a usage mistake, as everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from fleetd.checks import FAIL, GROUPS, OK, SKIP, Check, counts, worst
from fleetd.cli.fleet_args import add_fleet_args, milliseconds, seconds
from fleetd.cli.progress import Progress, task
from fleetd.errors import ConfigError, FleetdError, UsageError
from fleetd.store.timeparse import parse_duration

if TYPE_CHECKING:
    from fleetd.config import Config

DEFAULT_CERT_WARNING = "14d"
# The groups each flag feeds: a flag none of the selected groups reads is a mistake.
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    "cuda_lib": ("cuda",), "no_attach": ("cuda",), "db": ("db",),
    "listen": ("certs",), "tls_cert": ("certs",), "tls_key": ("certs",),
    "client_ca": ("certs",), "cert_warn_within": ("certs",),
    "ca_cert": ("certs", "nodes"), "client_cert": ("certs", "nodes"),
    "client_key": ("certs", "nodes"), "config": ("db", "certs", "nodes"),
    "nodes": ("nodes",), "token_file": ("nodes",), "timeout": ("nodes",),
    "clock_skew_threshold": ("nodes",),
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        help="check that this machine can trace and serve, and reach its fleet",
        description="Check, with a fix for each problem: the kernel, root and capabilities, "
        "BPF, BTF, tracefs, bcc, the kernel header route, host tracepoints and the clock "
        "(group host); the CUDA libraries, their symbols and a real compile and attach of "
        "every probe (cuda); the database path (db); the agent's and the client's "
        "certificates (certs); every fleet node over a real mTLS handshake (nodes). "
        "--config gives the agent's and the fleet's settings, flags override it. Each "
        "check is ok, warn, fail or skip. Exit status 1 when a check fails, else 0.",
    )
    p.add_argument("--format", default="table", help="table or json (default: table)")
    p.add_argument("--only", metavar="GROUPS",
                   help=f"comma list of check groups to run: {','.join(GROUPS)} (default: all; "
                   "db, certs and nodes need no root)")
    p.add_argument("--cuda-lib", action="append", default=[], metavar="PATH",
                   help="check this library instead of discovering (repeatable)")
    p.add_argument("--no-attach", action="store_true",
                   help="skip compiling the programs and attaching the probes")
    g = p.add_argument_group("agent", "what `fleetd agent` would use (default: --config's)")
    g.add_argument("--db", type=Path, help="database file (default: store.db, else $FLEETD_DB, "
                   "else a per-user path)")
    g.add_argument("--listen", metavar="HOST:PORT", help="the agent's listen address (default: "
                   "listen, else 127.0.0.1:7600), for the TLS policy and the certificate's SANs")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", help="node certificate")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="its private key")
    g.add_argument("--client-ca", type=Path, metavar="PEM",
                   help="CA that client certificates must chain to (the fleet CA)")
    g.add_argument("--cert-warn-within", metavar="DURATION",
                   help=f"warn about certificates that expire within this (default "
                   f"{DEFAULT_CERT_WARNING})")
    add_fleet_args(p, skew=False)
    _adapt_fleet_flags(p)
    p.set_defaults(func=run)


# The shared fleet flags, as they apply to a check (without the skew display and
# correction flags: every node's offset is always shown); a slow node fails instead of
# becoming a warning.
_FLEET_HELP = {
    "config": "fleetd.yaml: the agent's settings (listen, tls, store) and the fleet: section",
    "timeout": "time for all node checks (default: the config's timeout_s, else 10s)",
    "clock_skew_threshold": "warn about a node whose clock is further off than this "
    "(default 10ms)",
}


def _adapt_fleet_flags(p: argparse.ArgumentParser) -> None:
    for action in p._actions:
        action.help = _FLEET_HELP.get(action.dest, action.help)
    for group in p._action_groups:
        if group.title == "fleet":
            group.description = ("the nodes to reach over mTLS (group nodes), and this "
                                 "client's certificate files (checked in group certs too)")


def run(args: argparse.Namespace) -> int:
    if args.format not in ("table", "json"):
        raise UsageError(f"--format {args.format!r} is not supported", "use table or json")
    groups, explicit = parse_groups(args.only)
    _refuse_unused(args, groups)
    warn_within = _cert_warning(args.cert_warn_within)
    if args.listen:
        _validate_listen(args.listen)
    if args.cuda_lib:
        from fleetd.trace.host.libs import override_libraries

        override_libraries(args.cuda_lib)  # a wrong path is a usage error, before any check
    cfg, found = _config(args.config)
    with task("checking") as shown:
        if {"host", "cuda"} & set(groups):
            shown.step("this machine's kernel, BPF and CUDA libraries (compiling and "
                       "attaching BPF takes a few seconds)")
        found += _host(args, groups)
        if cfg is None and args.config is not None:
            found += [_unread_config(g) for g in ("db", "certs", "nodes") if g in groups]
        else:
            found += _agent_side(args, groups, cfg, warn_within, shown)
            if "nodes" in groups:
                shown.step("the fleet's nodes")
                found += _nodes(args, cfg, explicit)
    _print(found, args.format, sys.stdout)
    return 1 if any(c.status == FAIL for c in found) else 0


def parse_groups(text: str | None) -> tuple[list[str], bool]:
    """``--only db,certs`` -> (the groups in report order, whether they were named)."""
    if text is None:
        return list(GROUPS), False
    wanted = [g.strip() for g in text.split(",") if g.strip()]
    unknown = [g for g in wanted if g not in GROUPS]
    if unknown or not wanted:
        raise UsageError(f"--only {text!r}: unknown check group {', '.join(unknown) or '(none)'}",
                         f"use a comma list of: {', '.join(GROUPS)}")
    return [g for g in GROUPS if g in wanted], True


def _refuse_unused(args: argparse.Namespace, groups: Sequence[str]) -> None:
    for dest, feeds in FLAG_GROUPS.items():
        if getattr(args, dest, None) in (None, False, []) or set(feeds) & set(groups):
            continue
        flag = "--" + dest.replace("_", "-")
        raise UsageError(f"{flag} is only used by the {'/'.join(feeds)} checks, and --only "
                         f"{args.only!r} leaves them out", f"add {feeds[0]} to --only, or "
                         f"drop {flag}")


def _cert_warning(text: str | None) -> timedelta:
    return timedelta(microseconds=parse_duration(text or DEFAULT_CERT_WARNING) / 1e3)


def _validate_listen(text: str) -> None:
    from fleetd.config import parse_hostport

    try:
        parse_hostport(text, "--listen address")
    except ConfigError as exc:
        raise UsageError(exc.message, exc.hint) from None


def _config(path: Path | None) -> tuple[Config | None, list[Check]]:
    """The config and a check of it; a broken config is a finding, not an abort."""
    from fleetd.config import Config, load_config

    if path is None:
        return Config(), []
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        return None, [Check("config", FAIL, exc.message, exc.hint or "", group="config")]
    detail = (f"{path}: node {cfg.node or '(the hostname)'}, listen {cfg.listen}, "
              f"{len(cfg.fleet.nodes)} fleet node(s)")
    return cfg, [Check("config", OK, detail, group="config")]


def _unread_config(group: str) -> Check:
    return Check(group, SKIP, "not checked: the config could not be read",
                 "fix the config first (see the config check)", group=group)


def _host(args: argparse.Namespace, groups: Sequence[str]) -> list[Check]:
    wanted = [g for g in groups if g in ("host", "cuda")]
    if not wanted:
        return []
    from fleetd.errors import TraceError
    from fleetd.trace.host.require import require_tracing

    try:
        require_tracing("tracing")
    except TraceError as exc:  # a client-only install: say so once per group, no more
        return [Check(g, SKIP, f"node side not installed here: {exc.message}",
                      exc.hint or "", group=g) for g in wanted]
    from fleetd.trace.checks import run_checks

    return run_checks(args.cuda_lib, attach=not args.no_attach, groups=wanted, skips=True)


def _agent_side(args: argparse.Namespace, groups: Sequence[str], cfg: Config | None,
                warn_within: timedelta, shown: Progress) -> list[Check]:
    from fleetd.config import Config
    from fleetd.security.checks import TlsFiles, cert_checks
    from fleetd.store.checks import db_check
    from fleetd.store.db import default_db_path

    c = cfg or Config()
    out: list[Check] = []
    if "db" in groups:
        shown.step("the database (an integrity check of its pages)")
        out.append(db_check(args.db or c.store.db or default_db_path(), c.store.max_bytes))
    if "certs" in groups:
        shown.step("the certificates")
        files = TlsFiles(
            listen=args.listen or c.listen, node_cert=args.tls_cert or c.tls.cert,
            node_key=args.tls_key or c.tls.key, client_ca=args.client_ca or c.tls.client_ca,
            plain_http=c.tls.plain_http, fleet_ca=args.ca_cert or c.fleet.ca,
            client_cert=args.client_cert or c.fleet.client_cert,
            client_key=args.client_key or c.fleet.client_key)
        out += cert_checks(files, warn_within)
    return out


def _nodes(args: argparse.Namespace, cfg: Config | None, explicit: bool) -> list[Check]:
    from fleetd.cli.fleet_args import fleet_options
    from fleetd.fleet.checks import node_checks
    from fleetd.fleet.targets import parse_nodes

    if not args.nodes and not (cfg and cfg.fleet.nodes):
        how = ("pass --nodes HOST:PORT,... with --ca-cert, --client-cert and --client-key, "
               "or --config with a fleet: section")
        if explicit:
            raise UsageError("--only nodes needs the nodes to check", how)
        return [Check("nodes", SKIP, "no fleet nodes given", how, group="nodes")]
    # Typos are usage errors (exit 2); what is wrong with the files is a finding.
    if args.nodes:
        parse_nodes(args.nodes)
    if args.timeout:
        seconds(args.timeout, "--timeout")
    if args.clock_skew_threshold:
        milliseconds(args.clock_skew_threshold, "--clock-skew-threshold")
    try:
        opts = fleet_options(args)
    except FleetdError as exc:
        return [Check("nodes", FAIL, exc.message, exc.hint or "", group="nodes")]
    return node_checks(opts)


# ---- output ---------------------------------------------------------------------------


def summary(checks: list[Check]) -> dict[str, object]:
    """The JSON report: overall status (skips do not count), counts, every check."""
    status = worst([c.status for c in checks if c.status != SKIP]) if checks else OK
    return {"status": status, "counts": counts(checks),
            "checks": [c.as_dict() for c in checks]}


def _print(checks: list[Check], fmt: str, out: TextIO) -> None:
    if fmt == "json":
        out.write(json.dumps(summary(checks), indent=2) + "\n")
        return
    name_w = max([len("check"), *(len(c.name) for c in checks)])
    out.write(f"{'check':<{name_w}}  status  detail\n")
    for c in checks:
        out.write(f"{c.name:<{name_w}}  {c.status:<6}  {c.detail}\n")
        if c.status != OK and c.fix:
            out.write(f"{'':<{name_w}}  {'':<6}  fix: {c.fix}\n")
    n = counts(checks)
    noun = "check" if len(checks) == 1 else "checks"
    out.write(f"{len(checks)} {noun}: " + ", ".join(f"{v} {k}" for k, v in n.items()) + "\n")
