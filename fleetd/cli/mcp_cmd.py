"""``fleetd mcp``: serve the Model Context Protocol, so an AI assistant can investigate.

Over stdio by default (an MCP client starts ``fleetd mcp`` itself); with ``--http``,
over Streamable HTTP under the agent's TLS rules plus client authentication. The source
is one database (``--db``) or the live fleet (``--nodes``/``--config``, with the same
certificate flags as every fleet command). See docs/mcp.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fleetd.cli.fleet_args import add_fleet_args, fleet_mode, fleet_options
from fleetd.errors import UsageError

if TYPE_CHECKING:
    from fleetd.mcp.https import HttpSettings


DESCRIPTION = (
    "Serve the Model Context Protocol over stdio (or Streamable HTTP with --http): tools "
    "for trace statistics, causal chains, latency breakdown, stacks, read-only SQL, CUDA "
    "graph lifecycle and timeline export over one database, or fleet-wide queries over "
    "live agents. Nothing it does writes the database.")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("mcp", description=DESCRIPTION,
                       help="serve MCP tools for AI assistants (stdio, or HTTPS with --http)")
    p.add_argument("--db", type=Path,
                   help="database file (default: $FLEETD_DB, else a per-user path)")
    p.add_argument("--export-dir", type=Path, metavar="DIR",
                   help="where export_timeline writes (default: $XDG_CACHE_HOME/fleetd/"
                   "mcp-exports, i.e. ~/.cache/...); made 0700, and refused when it is a "
                   "symlink, someone else's, or writable by group or others")
    p.add_argument("--max-result-kb", type=int, default=64, metavar="KB",
                   help="cap on one tool answer; longer lists are cut (default 64)")
    h = p.add_argument_group("http", "serve Streamable HTTP instead of stdio (TLS 1.3 "
                             "only; a client certificate and/or a bearer token required)")
    h.add_argument("--http", metavar="HOST:PORT", help="listen here (port 0: any free port)")
    h.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    h.add_argument("--tls-key", type=Path, help="its private key")
    h.add_argument("--client-ca", type=Path,
                   help="require client certificates from this CA (mandatory beyond loopback)")
    h.add_argument("--http-token-file", type=Path, metavar="FILE",
                   help="require Authorization: Bearer <token in FILE> (--token-file is the "
                   "token this server sends to fleet agents)")
    add_fleet_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.mcp.fleet import FleetBackend
    from fleetd.mcp.local import LocalBackend, default_export_dir
    from fleetd.mcp.server import ServerSettings, build_server
    from fleetd.store.db import default_db_path

    if args.max_result_kb <= 0:
        raise UsageError(f"--max-result-kb {args.max_result_kb} must be positive", "e.g. 64")
    http = _http_settings(args)  # checked before anything starts
    export_dir = args.export_dir or default_export_dir()
    backend: LocalBackend | FleetBackend
    if fleet_mode(args):
        backend = FleetBackend(fleet_options(args), export_dir)
    else:
        backend = LocalBackend(args.db or default_db_path(), export_dir)
    server = build_server(backend, ServerSettings(max_result_bytes=args.max_result_kb * 1024))
    if http is None:
        import asyncio

        asyncio.run(server.run_stdio_async())
        return 0
    from fleetd.mcp.https import serve

    serve(server, http)
    return 0


def _http_settings(args: argparse.Namespace) -> HttpSettings | None:
    from fleetd.config import parse_hostport
    from fleetd.mcp.https import HttpSettings, check_settings
    from fleetd.security.tls import load_token

    given = [f for f in ("tls_cert", "tls_key", "client_ca", "http_token_file")
             if getattr(args, f) is not None]
    if args.http is None:
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} only applies with --http",
                             "add --http HOST:PORT, or drop it to serve stdio")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise UsageError("--http needs --tls-cert and --tls-key (TLS 1.3 only, never plain "
                         "HTTP)", "make them with: fleetd certs issue-node NAME --san HOST")
    host, port = parse_hostport(args.http, "--http")
    token = load_token(args.http_token_file) if args.http_token_file else None
    settings = HttpSettings(host, port, args.tls_cert, args.tls_key, args.client_ca, token)
    check_settings(settings)
    return settings
