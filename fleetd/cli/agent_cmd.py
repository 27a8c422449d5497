"""``fleetd agent``: trace into the local store and serve the node API over TLS."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fleetd.cli.argtypes import byte_size
from fleetd.cli.trace_args import add_cpu_sample_arg, add_launch_returns_arg, cpu_sample_hz
from fleetd.config import Config, load_config
from fleetd.errors import UsageError

if TYPE_CHECKING:
    from fleetd.node.agent import AgentSettings, TracerFactory
    from fleetd.node.lake import LakeSettings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "agent",
        help="run the node agent: trace and serve the TLS query API",
        description="Run the node daemon: trace CUDA and host events into the local database "
        "and serve the query API (TLS 1.3; mTLS beyond loopback). Flags override the config.",
    )
    p.add_argument("--config", type=Path, metavar="CONFIG",
                   help="fleetd.yaml (see configs/fleetd.yaml)")
    p.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:7600)")
    p.add_argument("--db", type=Path, help="database file (default: $FLEETD_DB or per-user)")
    p.add_argument("--node", help="node name (default: config, then hostname)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--pid", type=int, action="append", help="trace this process (repeatable)")
    target.add_argument("--all", action="store_true", help="trace every CUDA process")
    p.add_argument("--no-trace", action="store_true", help="serve the database only, no tracing")
    p.add_argument("--tls-cert", type=Path, metavar="PEM", help="node certificate")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="node private key")
    p.add_argument("--client-ca", type=Path, metavar="PEM",
                   help="CA that client certificates must chain to")
    p.add_argument("--plain-http", action="store_true",
                   help="serve plain HTTP (loopback only; for debugging)")
    p.add_argument("--token-file", type=Path, metavar="FILE",
                   help="require this bearer token too")
    p.add_argument("--cuda-lib", type=Path, help="CUDA library to attach to (overrides discovery)")
    p.add_argument("--sample", type=int, help="keep 1 in N ordinary CUDA calls as events")
    p.add_argument("--no-host", action="store_true", help="no host tracepoints")
    add_cpu_sample_arg(p)
    add_launch_returns_arg(p)
    p.add_argument("--max-db-bytes", type=byte_size, metavar="SIZE",
                   help="prune the oldest events beyond this size, e.g. 10G, 512M")
    p.add_argument("--parquet-dir", type=Path, metavar="DIR",
                   help="keep a Parquet lake here too (local or a mounted shared "
                   "filesystem): a closed segment every --parquet-every (docs/scale-out.md)")
    p.add_argument("--parquet-every", default="10m", metavar="DURATION",
                   help="close a lake segment this often (default 10m; at least 1s)")
    p.add_argument("--parquet-keep-days", type=float, metavar="DAYS",
                   help="remove lake files of dates older than this many days")
    p.add_argument("--parquet-max-bytes", type=byte_size, metavar="SIZE",
                   help="remove the oldest lake files beyond this total size, e.g. 50G")
    p.set_defaults(func=run)


def _lake(args: argparse.Namespace) -> LakeSettings | None:
    """--parquet-*: the agent's lake, or None; every value checked before it starts."""
    from fleetd.node.lake import LakeSettings
    from fleetd.store.lake import Retention
    from fleetd.store.timeparse import parse_duration

    rest = [f for f, v in (("--parquet-keep-days", args.parquet_keep_days),
                           ("--parquet-max-bytes", args.parquet_max_bytes)) if v is not None]
    if args.parquet_dir is None:
        if rest:
            raise UsageError(f"{rest[0]} needs --parquet-dir", "add --parquet-dir DIR")
        return None
    every_s = parse_duration(args.parquet_every) / 1e9
    if every_s < 1:
        raise UsageError(f"--parquet-every {args.parquet_every!r} is under a second",
                         "close segments every few minutes, e.g. --parquet-every 10m")
    if args.parquet_keep_days is not None and args.parquet_keep_days <= 0:
        raise UsageError(f"--parquet-keep-days {args.parquet_keep_days:g} must be positive",
                         "e.g. --parquet-keep-days 30")
    return LakeSettings(args.parquet_dir, every_s,
                        Retention(args.parquet_keep_days, args.parquet_max_bytes))


def _settings(args: argparse.Namespace, cfg: Config) -> AgentSettings:
    from fleetd.node.agent import AgentSettings, default_node_name, hardening, served_node
    from fleetd.security.tls import load_token
    from fleetd.store.db import default_db_path
    from fleetd.store.guard import Limits

    lim = cfg.limits
    token_file = args.token_file or cfg.token_file
    tracing = not args.no_trace and cfg.trace.enabled
    db = args.db or cfg.store.db or default_db_path()
    node = args.node or cfg.node
    if node is None and not tracing and db.exists():
        node = served_node(db)  # a copied database names its own node
    settings = AgentSettings(
        node=node or default_node_name(),
        db=db,
        listen=args.listen or cfg.listen,
        tls_cert=args.tls_cert or cfg.tls.cert,
        tls_key=args.tls_key or cfg.tls.key,
        client_ca=args.client_ca or cfg.tls.client_ca,
        plain_http=args.plain_http or cfg.tls.plain_http,
        token=load_token(token_file) if token_file else None,
        limits=Limits(timeout_s=lim.query_timeout_s, max_rows=lim.max_rows,
                      max_bytes=lim.max_bytes),
        max_body_bytes=lim.max_body_bytes,
        max_concurrent_queries=lim.max_concurrent_queries,
        store_max_bytes=args.max_db_bytes or cfg.store.max_bytes,
        on_damaged_db=cfg.store.on_damaged_db,
        **hardening(cfg),  # connection caps, deadlines, reader shares, relay nodes
    )
    settings.lake = _lake(args)
    if tracing:
        settings.tracer = _tracer_factory(args, cfg, settings)
    _relaying(cfg, settings)
    return settings


def _relaying(cfg: Config, s: AgentSettings) -> None:
    """The relay route (refusing unless relay.enabled) and, on every agent, the rules
    for requests a relay forwards (fleetd/relay.py)."""
    from fleetd.fleet.client import ClientOptions
    from fleetd.relay import RelaySettings, relay_peers, relay_routes, relayed_middleware
    from fleetd.security.tls import client_context, load_token

    r = cfg.relay
    client = None
    peers = relay_peers(r.peers)
    if r.enabled:
        if not peers:
            raise UsageError("relay.enabled needs relay.peers: the nodes this agent may "
                             "forward to (it forwards to no other address)",
                             "list them in its fleetd.yaml: relay: {peers: [gpu-02=HOST:PORT, "
                             "...]} (docs/fleet.md, Relays)")
        if not (s.tls_cert and s.tls_key):
            raise UsageError("relay.enabled needs this node's certificate, to present to "
                             "its peers", "pass --tls-cert and --tls-key (fleetd certs "
                             "issue-node NAME), or set relay.enabled: false")
        ca = r.ca or s.client_ca
        if ca is None:
            raise UsageError("relay.enabled needs the fleet CA, to verify its peers",
                             "set relay.ca (or tls.client_ca / --client-ca) to the fleet's "
                             "ca.pem")
        client = ClientOptions(ssl=client_context(ca, s.tls_cert, s.tls_key,
                                                  session_cache=False),  # no ~/.cache
                               token=load_token(r.token_file) if r.token_file else None,
                               timeout_s=r.timeout_s, concurrency=max(1, r.concurrency),
                               has_client_cert=True)
    s.extra_routes.extend(relay_routes(RelaySettings(
        node=s.node, enabled=r.enabled, peers=peers, client=client, limits=s.limits,
        max_targets=max(1, r.max_targets), timeout_s=r.timeout_s,
        max_answer_bytes=max(1, r.max_answer_bytes))))
    s.extra_middlewares.append(relayed_middleware(s.relay_nodes))


def _tracer_factory(args: argparse.Namespace, cfg: Config, s: AgentSettings) -> TracerFactory:
    from fleetd.trace.host.require import require_tracing

    require_tracing("fleetd agent")  # a client-only install says so, and how to fix it
    from fleetd.trace.agent_hook import tracer_factory

    pids = args.pid or cfg.trace.pids
    all_processes = bool(args.all or cfg.trace.all)
    if not pids and not all_processes:
        raise UsageError("nothing to trace: no --pid and no --all",
                         "pass --pid PID (repeatable) or --all, or --no-trace to only serve")
    return tracer_factory(
        node=s.node, pids=list(pids or []), all_processes=all_processes,
        cuda_lib=args.cuda_lib or cfg.trace.cuda_lib, host=not args.no_host and cfg.trace.host,
        sample=args.sample or cfg.trace.sample,
        cpu_sample_hz=cpu_sample_hz(args.cpu_sample_hz), launch_returns=args.launch_returns,
        mode=args.mode,
    )


def run(args: argparse.Namespace) -> int:
    from fleetd.node.agent import run as run_agent

    # A daemon's life cycle (a stop, the final flush) and its audit lines (relayed
    # requests, launch-detail windows opened and refused) belong in its log at the
    # default verbosity; -v adds everyone else's info lines, -vv debug.
    for name in ("fleetd.node.agent", "fleetd.trace.agent", "fleetd.relay",
                 "fleetd.node.detail"):
        lifecycle = logging.getLogger(name)
        if lifecycle.getEffectiveLevel() > logging.INFO:
            lifecycle.setLevel(logging.INFO)
    cfg = load_config(args.config) if args.config else Config()
    return run_agent(_settings(args, cfg))
