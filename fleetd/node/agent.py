"""``fleetd agent``: one asyncio process (uvloop) that traces into the store and serves the API.

Each resource has one aiohttp cleanup context, entered in order and left in reverse:
the writer (flushes on exit), the tracer (stops, writes its session record), the reader
pool. The first SIGTERM/SIGINT drains and flushes, then exits 0; a second one exits at
once (SQLite in WAL mode stays consistent when a process dies mid-write).

Under systemd (``Type=notify``, configs/fleetd-agent.service) the agent says READY=1
on ``$NOTIFY_SOCKET`` once the probes are attached and the socket listens, and
STOPPING=1 when it begins to shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypedDict

from aiohttp import web

from fleetd.config import Config, parse_hostport
from fleetd.errors import ConfigError
from fleetd.node import memtrace
from fleetd.node.analysis import ROUTES as ANALYSIS_ROUTES
from fleetd.node.api import NodeState, make_app
from fleetd.node.conns import ConnLimits, Gate, GuardedHandler
from fleetd.node.detail import (
    DETAIL_GATE,
    DETAIL_TRACER,
    DetailGate,
    DetailPolicy,
    longest_wait,
    watch_waits,
)
from fleetd.node.detail import ROUTES as DETAIL_ROUTES
from fleetd.node.lake import LakeSettings, lake_ctx
from fleetd.node.metrics import SOURCES, Sources, metrics
from fleetd.node.ranks import RANKBOOK, ObservedWriter, RankBook, local_waits
from fleetd.node.ranks import ROUTES as RANK_ROUTES
from fleetd.node.readers import ReaderPool
from fleetd.runner import run_loop
from fleetd.security import tls
from fleetd.store.db import (
    DAMAGE_CHECK_S,
    DAMAGED_CHOICES,
    damaged_db_error,
    ensure_node,
    find_damage,
    move_aside,
    open_reader,
    open_writer,
    validate_node_name,
)
from fleetd.store.guard import Limits
from fleetd.store.health import StoreStatus, TraceStats
from fleetd.store.losses import CrashReport, describe_crash, session_losses
from fleetd.store.writer import BatchWriter

log = logging.getLogger("fleetd.node.agent")


class TracerHandle(Protocol):
    """What the agent needs of a tracer: started into a writer, stopped, observed."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def stats(self) -> TraceStats: ...
    def ask_detail(self, seconds: float) -> bool: ...  # fleetd.node.detail


TracerFactory = Callable[[BatchWriter], TracerHandle]


@dataclass
class AgentSettings:
    node: str
    db: Path
    listen: str = "127.0.0.1:7600"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    plain_http: bool = False
    token: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_body_bytes: int = 64 * 1024
    max_concurrent_queries: int = 8
    max_queries_per_client: int | None = None  # None: half of max_concurrent_queries
    conns: ConnLimits = field(default_factory=ConnLimits)
    body_timeout_s: float = 30.0
    relay_nodes: frozenset[str] = frozenset()  # node certificates allowed to query
    detail: DetailPolicy = field(default_factory=DetailPolicy)  # who opens windows, how long
    store_max_bytes: int | None = None
    on_damaged_db: str = "refuse"  # store.on_damaged_db: refuse, or move-aside
    tracer: TracerFactory | None = None  # None: serve the database only
    self_signed_dir: Path | None = None
    extra_routes: list[web.RouteDef] = field(default_factory=list)
    extra_middlewares: list[Any] = field(default_factory=list)  # run after the token's
    ready: Callable[[Listening], None] | None = None  # told where it listens
    lake: LakeSettings | None = None  # --parquet-dir: a Parquet segment per interval


class Listening(TypedDict):
    """Where a started agent listens: announced on stderr, and told to ``ready``."""

    node: str
    listen: str  # host:port, the port bound
    scheme: str  # http | https
    fingerprint: str | None  # a self-signed certificate's SHA-256
    pid: int
    db: str


class Hardening(TypedDict):
    """The :class:`AgentSettings` fields that bound what clients may hold."""

    max_queries_per_client: int | None
    conns: ConnLimits
    body_timeout_s: float
    relay_nodes: frozenset[str]
    detail: DetailPolicy


WRITER = web.AppKey("writer", BatchWriter)


STORE_STATUS: web.AppKey[Callable[[], StoreStatus]] = web.AppKey("store_status")


def _report_crashes(s: AgentSettings, seqs: list[int]) -> list[CrashReport]:
    """What the sessions that were killed before this start lost: logged once, and
    kept for the health answer. The gap runs from a session's last commit to now."""
    if not seqs:
        return []
    conn = open_reader(s.db)
    try:
        found = [c for c in session_losses(conn, s.node)["crashes"] if c["session"] in seqs]
    finally:
        conn.close()
    now = time.time_ns()
    for c in found:
        c["gap_s"] = round((now - c["last_commit_ns"]) / 1e9, 3)
        log.warning("%s", describe_crash(c))
    return found


def _store_status(writer: BatchWriter, crashes: list[CrashReport]) -> StoreStatus:
    st = writer.stats
    return StoreStatus(disk_full=st.disk_full, disk_full_dropped=st.disk_full_rows,
                       failed_writes=st.failed_rows, pruned_events=st.pruned_events,
                       crashed_sessions=crashes)


def hardening(cfg: Config) -> Hardening:
    """The :class:`AgentSettings` fields that bound what clients may hold, from the
    config's ``limits`` and ``tls`` (each checked positive)."""
    lim = cfg.limits
    for key in ("max_connections", "max_connections_per_source", "handshake_timeout_s",
                "header_timeout_s", "body_timeout_s", "write_timeout_s"):
        if getattr(lim, key) <= 0:
            raise ConfigError(f"limits.{key} must be positive, got {getattr(lim, key)!r}",
                              "see configs/README.md for the defaults")
    if lim.max_queued_bytes < lim.max_bytes:
        raise ConfigError(f"limits.max_queued_bytes ({lim.max_queued_bytes}) is below "
                          f"limits.max_bytes ({lim.max_bytes}): a full answer could never "
                          "be sent", "raise max_queued_bytes (default 134217728)")
    if lim.max_queries_per_client < 0:
        raise ConfigError("limits.max_queries_per_client must be 0 (half) or positive",
                          "see configs/README.md")
    return {
        "max_queries_per_client": lim.max_queries_per_client or None,
        "conns": ConnLimits(max_total=lim.max_connections,
                            max_per_source=lim.max_connections_per_source,
                            handshake_timeout_s=lim.handshake_timeout_s,
                            header_timeout_s=lim.header_timeout_s,
                            write_timeout_s=lim.write_timeout_s,
                            max_queued_bytes=lim.max_queued_bytes),
        "body_timeout_s": lim.body_timeout_s,
        "relay_nodes": frozenset(cfg.tls.relay_nodes),
        "detail": DetailPolicy(frozenset(cfg.detail.clients),
                               frozenset(cfg.detail.client_ous), cfg.detail.max_s_per_hour),
    }


def build_ssl(s: AgentSettings, host: str) -> tuple[ssl.SSLContext | None, str | None]:
    """The server context by the security policy, and the fingerprint to print if self-signed."""
    tls.check_listen_policy(
        host, have_cert=bool(s.tls_cert and s.tls_key), have_client_ca=s.client_ca is not None,
        plain_http=s.plain_http,
    )
    if s.plain_http:
        return None, None
    if s.tls_cert and s.tls_key:
        return tls.server_context(s.tls_cert, s.tls_key, s.client_ca), None
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together",
                          "pass both, from fleetd certs issue-node NAME")
    cert_dir = s.self_signed_dir or s.db.parent / "fleetd-tls"
    cert, key, fp = tls.self_signed(cert_dir, host)
    return tls.server_context(cert, key, None), fp


def _prepare_db(s: AgentSettings) -> None:
    """Create (or migrate) the database before readers open it; register the node."""
    if s.tracer is None and not s.db.exists():
        raise ConfigError(f"database {str(s.db)!r} does not exist and tracing is off",
                          "pass --db to an existing database, or drop --no-trace")
    _refuse_damaged_db(s)
    if s.tracer is None:
        _check_served_node(s)
        return  # serve as is: a copied database is never modified
    conn = open_writer(s.db)
    try:
        ensure_node(conn, s.node)
    finally:
        conn.close()


def _refuse_damaged_db(s: AgentSettings) -> None:
    """A database with a torn or overwritten page is refused at start, before anything
    writes into it (SQLite would fail later, on whichever write meets the page), or moved
    aside for a new one with ``store.on_damaged_db: move-aside``. A database the agent
    only serves (tracing off) is never moved: it is someone's copy."""
    if s.on_damaged_db not in DAMAGED_CHOICES:
        raise ConfigError(f"store.on_damaged_db is {s.on_damaged_db!r}",
                          f"use one of: {', '.join(DAMAGED_CHOICES)}")
    if not s.db.is_file() or s.db.stat().st_size == 0:
        return
    found, finished = find_damage(s.db)
    if not finished:
        log.warning("integrity check of %s did not finish within %g s; starting anyway",
                    s.db, DAMAGE_CHECK_S)
    if not found:
        return
    if s.on_damaged_db != "move-aside" or s.tracer is None:
        raise damaged_db_error(s.db, found)
    aside = move_aside(s.db)
    log.warning("database %s is damaged (%s): moved aside to %s; starting a new one",
                s.db, "; ".join(found[:2]), aside)


def _check_served_node(s: AgentSettings) -> None:
    conn = open_reader(s.db)
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM nodes ORDER BY name")]
    finally:
        conn.close()
    if s.node not in names:
        raise ConfigError(
            f"database {str(s.db)!r} holds no node named {s.node!r} (it has: "
            f"{', '.join(names) or 'none'})",
            "pass --node with one of those names (or leave --node out to take the only one)",
        )


def served_node(db: Path) -> str | None:
    """The node a copied database belongs to, when it holds exactly one."""
    conn = open_reader(db)
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM nodes")]
    finally:
        conn.close()
    return names[0] if len(names) == 1 else None


def build_app(s: AgentSettings, state: NodeState) -> web.Application:
    readers = ReaderPool(s.db, s.limits, s.max_concurrent_queries,
                         per_client=s.max_queries_per_client)
    app = make_app(state, readers, max_body_bytes=s.max_body_bytes,
                   extra_routes=[web.get("/metrics", metrics), *ANALYSIS_ROUTES,
                                 *RANK_ROUTES, *DETAIL_ROUTES, *s.extra_routes])
    app.middlewares.extend(s.extra_middlewares)  # e.g. the relay rules (fleetd.relay)
    app[DETAIL_GATE] = DetailGate(s.detail)
    sources = Sources(db_bytes=lambda: s.db.stat().st_size)
    app[SOURCES] = sources
    book = app[RANKBOOK] = RankBook()  # fed by the writer the tracer writes into
    sources.nccl_ranks, sources.nccl_waits = book.count, local_waits(book, s.node)

    async def readers_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, readers.close)

    async def writer_ctx(app: web.Application) -> AsyncIterator[None]:
        if s.tracer is None:
            yield
            return
        writer = ObservedWriter(s.db, s.node, book, max_bytes=s.store_max_bytes)
        app[WRITER] = writer
        sources.writer = lambda: writer.stats
        # The writer's connection belongs to its thread: read what it last measured.
        sources.db_bytes = lambda: writer.stats.used_bytes
        crashes = _report_crashes(s, writer.crashed_sessions)
        app[STORE_STATUS] = lambda: _store_status(writer, crashes)
        yield
        stats = await asyncio.get_running_loop().run_in_executor(None, writer.close)
        log.info("writer closed: %d events written, %d lost (%d of them on a full disk), "
                 "%d oldest pruned to keep the size cap, with %d thread and %d process "
                 "rows no kept event named", stats.events_written,
                 stats.queue_dropped + stats.failed_rows, stats.disk_full_rows,
                 stats.pruned_events, stats.pruned_threads, stats.pruned_processes)

    async def tracer_ctx(app: web.Application) -> AsyncIterator[None]:
        if s.tracer is None:
            yield
            return
        tracer = s.tracer(app[WRITER])
        await asyncio.get_running_loop().run_in_executor(None, tracer.start)
        state.tracing = True
        sources.tracer = tracer.stats
        store = app[STORE_STATUS]
        state.status = lambda: {"trace": tracer.stats(), "store": store()}
        app[DETAIL_TRACER] = tracer
        waits = asyncio.get_running_loop().create_task(
            watch_waits(tracer, longest_wait(app, s.node), app[DETAIL_GATE].budget))
        yield
        waits.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waits
        state.tracing = False
        await asyncio.get_running_loop().run_in_executor(None, tracer.stop)

    # Order matters: the writer outlives the tracer that feeds it, and the lake closes
    # its last segment after the writer's last commit.
    lake = [lake_ctx(s.lake, s.db, s.node)] if s.lake is not None else []
    app.cleanup_ctx.extend([readers_ctx, *lake, writer_ctx, tracer_ctx])
    return app


async def serve(s: AgentSettings) -> int:
    validate_node_name(s.node)
    host, port = parse_hostport(s.listen, "listen address")
    ssl_ctx, fp = build_ssl(s, host)
    _prepare_db(s)
    state = NodeState(node=s.node, token=s.token, relay_nodes=s.relay_nodes,
                      body_timeout_s=s.body_timeout_s)
    app = build_app(s, state)
    gate = Gate(s.conns, ssl_ctx)
    app[SOURCES].conns = gate.stats
    app[SOURCES].client_refusals = lambda: state.client_refusals
    loop = asyncio.get_running_loop()

    stop = asyncio.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            # The operator insists: leave now. WAL keeps the file consistent.
            os._exit(128 + signum)
        # An ordinary stop (systemctl stop, a pod deleted): information, not a warning.
        log.info("%s: draining and flushing (send again to exit at once)",
                 signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    runner = web.AppRunner(app, handle_signals=False, **HANDLER_KWARGS)
    await runner.setup()  # enters the cleanup contexts: writer, tracer, readers
    # What start-up made (modules, BCC's compiled tracer, symbol tables) lives as long
    # as the agent: out of the collector's sight, so that a full collection, which
    # stops every thread, scans only what serving and tracing allocate (in one run of
    # bench/agent_load.py the longest went from 28 to 13 ms, all three from 71 to 17 ms:
    # pauses that land in the query latency's tail).
    gc.freeze()
    accepting: asyncio.Task[None] | None = None
    try:
        lsock = _listen(host, port, s.listen)
        bound = int(lsock.getsockname()[1])
        server = runner.server
        assert server is not None  # set up above

        def factory() -> GuardedHandler:
            return GuardedHandler(server, loop=loop, **HANDLER_KWARGS)

        accepting = loop.create_task(gate.accept_forever(lsock, factory))
        info: Listening = {"node": s.node, "listen": f"{host}:{bound}",
                           "scheme": "http" if ssl_ctx is None else "https",
                           "fingerprint": fp, "pid": os.getpid(), "db": str(s.db)}
        _announce(info)
        # After runner.setup() (the tracer's probes are attached) and the listen above.
        notify(f"READY=1\nSTATUS=listening on {info['scheme']}://{info['listen']}")
        if s.ready:
            s.ready(info)
        await stop.wait()
    finally:
        notify("STOPPING=1\nSTATUS=draining and flushing")
        if accepting is not None:
            accepting.cancel()
            await asyncio.gather(accepting, return_exceptions=True)
            lsock.close()
        await gate.close()
        await runner.cleanup()
    return 0


# Given to aiohttp's request handler of every connection. An idle keep-alive connection
# is closed after 15 s (a descriptor is worth more than a saved handshake), and the
# unread rest of a refused body is never read. (aiohttp's keyword arguments: it annotates
# access_log as a Logger, yet None is how it is turned off, so they stay loosely typed.)
HANDLER_KWARGS: dict[str, Any] = {"access_log": None, "keepalive_timeout": 15.0,
                                  "lingering_time": 0.0}
LISTEN_BACKLOG = 128


def _listen(host: str, port: int, listen: str) -> socket.socket:
    """The listening socket; connections are accepted by :class:`Gate`, not aiohttp."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {listen}: {exc.strerror or exc}",
                          "pick a free port with --listen HOST:PORT") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {listen}: {exc.strerror}",
                          "pick a free port with --listen HOST:PORT") from None
    return sock


def _announce(info: Listening) -> None:
    line = f"fleetd agent {info['node']} listening on {info['scheme']}://{info['listen']}"
    if info["fingerprint"]:
        line += f" (self-signed, SHA-256 {info['fingerprint']})"
    print(line, file=sys.stderr, flush=True)


def notify(message: str) -> bool:
    """Send ``message`` to the service manager (sd_notify's protocol: one datagram on the
    unix socket named by $NOTIFY_SOCKET, ``@`` for the abstract namespace). False when
    there is no such socket or sending failed; that never stops the agent."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path or not path.startswith(("/", "@")):
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", path, exc)
        return False
    return True


def run(s: AgentSettings) -> int:
    """Run the agent to completion on uvloop."""
    memtrace.start_from_env()
    memtrace.trim_forever()
    return run_loop(serve(s))


def default_node_name() -> str:
    return socket.gethostname().split(".")[0] or "node"
