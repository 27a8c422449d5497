"""The HTTP side of the fleet client: one aiohttp session, a cap on requests in flight,
a deadline for the whole fan-out, retries for idempotent reads, and every way a node
can fail turned into a :class:`Failure` with a reason and a fix.

One TLS connection per node, kept alive: every request to a node (its query, a clock
sample) rides on it, so a command pays at most one handshake per node, and none with a
session ticket from an earlier command (``fleetd.security.sessions``). Every answer is
also a clock sample: the agent stamps its receive and send times in headers
(``X-Fleetd-Recv-Ns``, ``X-Fleetd-Send-Ns``), and a request made under :func:`clock_samples`
records (t0, t1, t2, t3) for the skew estimate. t0 is taken when the request is handed
to its connection (:class:`_StampedRequest`), so neither the handshake nor a wait for the
node's one connection counts as time on the wire.

Failures are values, not exceptions, because a failed node is an expected outcome of a
fan-out: the answer is still made of the nodes that did answer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from fleetd.fleet import stream
from fleetd.fleet.targets import Target
from fleetd.security.tls import DIALING, Dial
from fleetd.wire import paths
from fleetd.wire.failure import BadReply, Failure, NodeFailed
from fleetd.wire.headers import RECV_NS, SEND_NS
from fleetd.wire.limits import ERROR_BODY_BYTES, INT64_MAX, MAX_ANSWER_BYTES, TIME_BODY_BYTES
from fleetd.wire.query import error_detail
from fleetd.wire.shapes import QueryBody, RelayBody
from fleetd.wire.values import printable

log = logging.getLogger("fleetd.fleet.client")

# Backoff before each retry of an idempotent GET; a retry is only made when the
# deadline leaves room for it, so retries never delay the answer past the timeout.
RETRY_BACKOFF_S = (0.1, 0.3)
READ_PIECE = 64 * 1024
# An idle connection is kept this long, so a long-running client (MCP server, watch)
# asks again without a handshake; under the agent's own keep-alive (75 s, aiohttp's).
KEEPALIVE_S = 60.0

# (t0, t1, t2, t3) of a stamped answer.
Stamp = tuple[int, int, int, int]


@dataclass(slots=True)
class ClockLog:
    """The stamped answers of one node's exchanges (see :func:`clock_samples`)."""

    stamps: list[Stamp]
    # One of them went over a connection made for it: its request waited at the node
    # for the end of the handshake (certificate checks, tickets), after t0.
    new_connection: bool = False


_CLOCK: ContextVar[ClockLog | None] = ContextVar("fleetd_clock_samples", default=None)


@contextmanager
def clock_samples(log_to: ClockLog | None = None) -> Iterator[ClockLog]:
    """Requests made in this context (and tasks it starts) log their stamps in
    ``log_to`` (a new log without one)."""
    got = log_to if log_to is not None else ClockLog([])
    token = _CLOCK.set(got)
    try:
        yield got
    finally:
        _CLOCK.reset(token)


def current_clock() -> ClockLog | None:
    """The log that requests made here record their stamps in, if any."""
    return _CLOCK.get()


def stamp_of(stamps: Mapping[str, str], t0: int, t3: int) -> Stamp | None:
    """The exchange as a clock sample, when the node stamped it with two ordered
    integer nanosecond times (anything else is no clock reading)."""
    t1 = _ns(stamps.get(RECV_NS))
    t2 = _ns(stamps.get(SEND_NS))
    if t1 is None or t2 is None or t2 < t1:
        return None
    return t0, t1, t2, t3


def _ns(text: str | None) -> int | None:
    # Digits only (no sign, no exponent, no '_'), and few enough to parse cheaply.
    if text is None or not 0 < len(text) <= 19 or not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if value <= INT64_MAX else None


@dataclass(frozen=True, slots=True)
class ClientOptions:
    ssl: ssl.SSLContext
    token: str | None = None
    timeout_s: float = 10.0  # the whole fan-out, for every node
    connect_timeout_s: float = 3.0  # TCP connect plus the TLS handshake
    concurrency: int = 64  # requests in flight at once, over all nodes
    retries: int = len(RETRY_BACKOFF_S)
    has_client_cert: bool = False  # for hints: is an mTLS rejection about a missing cert?
    max_answer_bytes: int = MAX_ANSWER_BYTES  # per request, counted as the body streams in
    headers: tuple[tuple[str, str], ...] = ()  # on every request (a relay's marker)


class _StampedRequest(aiohttp.ClientRequest):
    """Notes when the request goes out on its (ready) connection: a sample's t0. A body
    is written by a task of its own, with the headers held back to go out with it, so
    a request with a body is re-stamped when that task starts (until then the loop may
    be busy with other nodes' handshakes, which is no time on the wire)."""

    async def send(self, conn: Any) -> aiohttp.ClientResponse:
        _stamp_sent()
        return await super().send(conn)

    async def write_bytes(self, *args: Any, **kwargs: Any) -> None:
        _stamp_sent()
        await super().write_bytes(*args, **kwargs)


def _stamp_sent() -> None:
    dial = DIALING.get()
    if dial is not None:
        dial.sent_ns = time.time_ns()


class FleetClient:
    """``async with FleetClient(opts) as c:`` then :meth:`get` / :meth:`post` per node."""

    def __init__(self, opts: ClientOptions) -> None:
        self.opts = opts
        self._session: aiohttp.ClientSession | None = None
        self._sem = asyncio.Semaphore(max(1, opts.concurrency))
        self.deadline = 0.0  # loop time; set on entry

    async def __aenter__(self) -> FleetClient:
        headers = {"Accept": "application/json", "User-Agent": "fleetd-fleet-client"}
        if self.opts.token:
            headers["Authorization"] = f"Bearer {self.opts.token}"
        headers.update(self.opts.headers)
        # limit=0: the semaphore is the only overall cap. limit_per_host=1: one
        # connection per node, so its requests (query, clock sample) share one handshake;
        # a second request waits for it in the pool, which is charged to the deadline,
        # not to the connect timeout (see _timeout: sock_connect, not connect).
        connector = aiohttp.TCPConnector(ssl=self.opts.ssl, limit=0, limit_per_host=1,
                                         keepalive_timeout=KEEPALIVE_S,
                                         enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(connector=connector, headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=None),
                                              request_class=_StampedRequest)
        self.restart_deadline()
        return self

    def restart_deadline(self) -> None:
        """Give the next fan-out the whole timeout (a reused client makes several)."""
        self.deadline = asyncio.get_running_loop().time() + self.opts.timeout_s

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            self.keep_tickets(save=True)  # while the connections (and tickets) live
            await self._session.close()

    def keep_tickets(self, *, save: bool = False) -> None:
        """Remember the session tickets of the connections made so far (in memory, for
        reconnecting later in this process); with ``save``, also in the per-user cache
        for the next command. Never fails: a lost ticket costs one full handshake."""
        sessions = getattr(self.opts.ssl, "sessions", None)
        if sessions is None:
            return
        try:
            sessions.flush() if save else sessions.collect()
        except Exception as exc:
            log.debug("keeping TLS session tickets failed: %r", exc)

    def remaining(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()

    # A node's answer comes back as parsed (parse_json): untrusted, each value ``object``
    # until a reader of fleetd.wire checks it (fleet/fanout.py: the request's check).
    async def get(self, target: Target, path: str, params: dict[str, str] | None = None
                  ) -> dict[str, object]:
        return await self._request("GET", target, path, params=params, retry=True)

    async def post(self, target: Target, path: str,
                   body: QueryBody | RelayBody | dict[str, object]) -> dict[str, object]:
        # body: ours, or (a relay's) a client's passed on as it came, for its peer to check
        # Never retried: a POST is not idempotent by contract, even when it only reads.
        return await self._request("POST", target, path, body=orjson.dumps(body), retry=False)

    async def get_raw(self, target: Target, path: str) -> tuple[int, int, bytes]:
        """One GET without retries: (t0_ns, t3_ns, body), for clock samples."""
        async with self._sem:
            timeout = self._timeout()
            with _dialing(target) as dial, self._as_failure(target):
                t0 = time.time_ns()
                async with self._exchange("GET", target, path, timeout=timeout) as resp:
                    t3 = time.time_ns()
                    _record(resp, dial, t0, t3)
                    t0 = dial.sent_ns or t0
                    body = await _read_capped(resp, TIME_BODY_BYTES)
        if resp.status != 200:
            raise NodeFailed(http_failure(resp.status, body))
        return t0, t3, body

    async def stream_to(self, target: Target, path: str, params: dict[str, str],
                        sink: Callable[[bytes], object], idle_s: float) -> int:
        """One GET whose body goes to ``sink`` piece by piece as it arrives, never held
        whole; returns its size. No deadline (a large body takes as long as it takes),
        but a pause longer than ``idle_s`` fails it, and so does a body cut short."""
        timeout = aiohttp.ClientTimeout(total=None, sock_read=idle_s,
                                        connect=min(self.opts.connect_timeout_s, idle_s))
        got = 0
        async with self._sem:
            with _dialing(target) as dial:
                t0 = time.time_ns()
                try:
                    async with self._exchange("GET", target, path, params=params,
                                              timeout=timeout) as resp:
                        _record(resp, dial, t0, time.time_ns())
                        if resp.status >= 400:
                            raw = await resp.content.read(ERROR_BODY_BYTES)
                            raise NodeFailed(http_failure(resp.status, raw))
                        async for piece in resp.content.iter_any():
                            sink(piece)
                            got += len(piece)
                except NodeFailed:
                    raise
                except aiohttp.SocketTimeoutError:
                    raise NodeFailed(Failure(
                        "timeout", f"{target.address} sent nothing for {idle_s:g} s, "
                        f"{got} bytes into its answer",
                        "is the agent hung or overloaded? raise --timeout if it is just slow"
                    )) from None
                except Exception as exc:
                    failure = classify(exc, target, self.opts)
                    if got:  # not a refused handshake: the answer broke off half-way
                        failure = Failure(failure.kind, f"{target.address} broke off its "
                                          f"answer after {got} bytes ({failure.message})",
                                          "did the agent restart or crash? see its log")
                    raise NodeFailed(failure) from None
        return got

    @contextmanager
    def _as_failure(self, target: Target) -> Iterator[None]:
        """Any exception of a request to ``target`` as its NodeFailed, with a reason."""
        try:
            yield
        except NodeFailed:
            raise
        except Exception as exc:
            raise NodeFailed(classify(exc, target, self.opts)) from None

    @asynccontextmanager
    async def _exchange(self, method: str, target: Target, path: str, **kwargs: Any
                        ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Every request of the client goes out here, to the configured address only:
        a redirect is never followed (the request's body and headers, the bearer token
        among them, would go to wherever a node points), it is that node's failure."""
        session = self._need_session()
        async with session.request(method, target.url(path), allow_redirects=False,
                                   **kwargs) as resp:
            if 300 <= resp.status < 400:
                raise NodeFailed(redirect_failure(target, resp.status,
                                                  resp.headers.get("Location")))
            yield resp

    def _need_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("FleetClient used outside 'async with'")
        return self._session

    def _timeout(self) -> aiohttp.ClientTimeout:
        left = max(0.001, self.remaining())
        # sock_connect: TCP plus the TLS handshake, without the wait for the node's one
        # pooled connection (which only the deadline bounds).
        return aiohttp.ClientTimeout(total=left,
                                     sock_connect=min(self.opts.connect_timeout_s, left))

    async def _request(self, method: str, target: Target, path: str, *,
                       params: dict[str, str] | None = None, body: bytes | None = None,
                       retry: bool) -> dict[str, object]:
        attempt = 0
        while True:
            try:
                return await self._once(method, target, path, params, body)
            except NodeFailed as exc:
                if not (retry and exc.failure.retryable and attempt < self.opts.retries):
                    raise
                backoff = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                # Only if a retry could still finish in time; else report what we have.
                if self.remaining() < backoff + self.opts.connect_timeout_s / 10:
                    raise
                log.debug("retrying %s %s on %s after %s", method, path, target.name,
                          exc.failure.text())
                attempt += 1
                await asyncio.sleep(backoff)

    async def _once(self, method: str, target: Target, path: str,
                    params: dict[str, str] | None, body: bytes | None) -> dict[str, object]:
        headers = {"Content-Type": "application/json"} if body is not None else None
        if path == paths.QUERY:  # rows line by line, never the whole body at once
            headers = {**(headers or {}), "Accept": paths.NDJSON}
        async with self._sem:
            with _dialing(target) as dial, self._as_failure(target):
                t0 = time.time_ns()
                async with self._exchange(method, target, path, params=params, data=body,
                                          headers=headers, timeout=self._timeout()) as resp:
                    _record(resp, dial, t0, time.time_ns())
                    cap = ERROR_BODY_BYTES if resp.status >= 400 else self.opts.max_answer_bytes
                    if resp.status < 400 and stream.is_ndjson(resp):
                        answer: Mapping[str, Any] = await stream.read_answer(resp, cap)
                        return dict(answer)
                    raw = await _read_capped(resp, cap)
                    status = resp.status
        if status >= 400:
            raise NodeFailed(http_failure(status, raw))
        reply = parse_json(raw)
        if self.remaining() <= 0:
            # Parsing runs on the loop, where no timer can stop it: check afterwards.
            raise NodeFailed(Failure("timeout", f"{target.address}'s answer took past the "
                                     f"{self.opts.timeout_s:g} s timeout to read",
                                     "lower --limit or narrow the query"))
        return reply


@contextmanager
def _dialing(target: Target) -> Iterator[Dial]:
    """The request to ``target`` made here, known to the stamping request class (its
    t0) and to the TLS layer (a new connection, a resumed session)."""
    dial = Dial(target.host, target.port)
    token = DIALING.set(dial)
    try:
        yield dial
    finally:
        DIALING.reset(token)


def _record(resp: aiohttp.ClientResponse, dial: Dial, t0: int, t3: int) -> None:
    """Add this answer's clock sample to the collecting context's log, if any."""
    got = _CLOCK.get()
    if got is not None:
        stamp = stamp_of(resp.headers, dial.sent_ns or t0, t3)
        if stamp is not None:
            got.stamps.append(stamp)
            got.new_connection = got.new_connection or dial.connected


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body, refused as soon as it passes ``cap`` bytes, whatever Content-Length
    claims (a chunked answer has none)."""
    if resp.content_length is not None and resp.content_length > cap:
        raise NodeFailed(_too_big(resp.content_length, cap))
    buf = bytearray()
    async for piece in resp.content.iter_chunked(READ_PIECE):
        buf += piece
        if len(buf) > cap:
            raise NodeFailed(_too_big(len(buf), cap, more=True))
    return bytes(buf)


def _too_big(size: int, cap: int, *, more: bool = False) -> Failure:
    return Failure("too_large", f"answer of {size}{'+' if more else ''} bytes is over the "
                   f"client's {cap} byte limit for one answer",
                   "lower --limit or narrow the query")


def parse_json(raw: bytes) -> dict[str, object]:
    """An answer's body as a JSON object, its values unread (the untrusted boundary: the
    wire's readers check them)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        snippet = raw[:60].decode("utf-8", "replace")
        raise BadReply(f"answer is not JSON ({exc}): {snippet!r}",
                       "is this address a fleetd agent? check HOST:PORT") from None
    if not isinstance(obj, dict):
        raise BadReply(f"answer is a JSON {type(obj).__name__}, not an object",
                       "is this address a fleetd agent?")
    return obj


def http_failure(status: int, raw: bytes) -> Failure:
    """A 4xx/5xx: the agent's own error message when it sent one."""
    try:
        got = orjson.loads(raw)
    except orjson.JSONDecodeError:
        got = None
    err = error_detail(got.get("error") if isinstance(got, dict) else None)
    code, hint = err["code"], err.get("hint")
    message = err["message"] or printable(raw[:120].decode("utf-8", "replace").strip()
                                          or "no error message", 500)
    if status == 401 and not hint:
        hint = "pass the fleet's bearer token with --token-file"
    return Failure("http", f"HTTP {status}{f' {code}' if code else ''}: {message}",
                   hint or None, status=status, code=code or None)


def redirect_failure(target: Target, status: int, location: str | None) -> Failure:
    """A 3xx: not followed, whatever it points at."""
    where = printable(location, 200) if location else "nowhere (no Location header)"
    return Failure("http", f"{target.address}: node answered a redirect to {where}; not "
                   "followed", "a fleetd agent never redirects: check that the node's "
                   "address is its agent's, not a proxy or another service", status=status,
                   code="redirect")


# ---- classifying transport failures ---------------------------------------------------

def _rejected_cert_hint(opts: ClientOptions) -> str:
    """A TLS 1.3 server checks the client certificate after the client considers the
    handshake done, and refuses it by closing: the client sees EOF or a reset on its
    first read, not a handshake error."""
    if not opts.has_client_cert:
        return ("the agent probably requires a client certificate (mTLS), and refuses a "
                "connection without one by closing it: pass --client-cert and --client-key "
                "(fleetd certs issue-client NAME)")
    return ("the agent probably refused this client's certificate (a TLS 1.3 agent does so "
            "by closing the connection): use one issued by the CA the agent trusts (its "
            "--client-ca); otherwise see the agent's log")


def classify(exc: BaseException, target: Target, opts: ClientOptions) -> Failure:
    """Turn an aiohttp/asyncio/ssl exception into a Failure that says what to do."""
    addr = target.address
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return Failure("timeout", f"no TCP/TLS connection to {addr} within "
                       f"{opts.connect_timeout_s:g} s",
                       "the host is down or unreachable, or its agent is hung (a stopped "
                       "agent accepts TCP but never finishes the TLS handshake)")
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return Failure("timeout", f"no answer from {addr} within the {opts.timeout_s:g} s "
                       "timeout", "raise --timeout, or narrow the query/window")
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return _server_cert_failure(exc, target)
    if isinstance(exc, aiohttp.ClientConnectorSSLError | aiohttp.ClientSSLError | ssl.SSLError):
        return _tls_failure(exc, addr, opts)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return _connect_failure(exc, target, opts)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | ConnectionResetError | BrokenPipeError):
        return _disconnected(exc, addr, opts)
    if isinstance(exc, aiohttp.ClientOSError):
        if exc.errno in (errno.ECONNRESET, errno.EPIPE) or "SSL" in str(exc):
            return _disconnected(exc, addr, opts)
        return Failure("unreachable", f"{addr}: {exc.strerror or exc}")
    if isinstance(exc, aiohttp.ClientResponseError):
        return Failure("http", f"{addr}: bad HTTP answer: {exc.message}",
                       "is this address a fleetd agent?", status=exc.status)
    if isinstance(exc, aiohttp.ClientError):
        return Failure("http", f"{addr}: {type(exc).__name__}: {exc}")
    if isinstance(exc, NodeFailed):
        return exc.failure
    raise exc  # a bug here, not a node failure: keep its traceback


def _server_cert_failure(exc: aiohttp.ClientConnectorCertificateError, target: Target
                         ) -> Failure:
    err = exc.certificate_error
    reason = str(getattr(err, "verify_message", None) or getattr(err, "reason", None) or err)
    if "mismatch" in reason.lower():
        hint = (f"the agent's certificate does not name {target.host}: reissue it with "
                f"fleetd certs issue-node NAME --san {target.host} --force, or use the "
                "name/address it was issued for")
    else:
        hint = ("the agent's certificate is not from the CA in --ca-cert: pass the fleet's "
                "ca.pem, or reissue the agent's certificate with fleetd certs issue-node")
    return Failure("tls", f"{target.address}'s certificate was not accepted: {reason}", hint)


def _tls_failure(exc: BaseException, addr: str, opts: ClientOptions) -> Failure:
    text = str(exc)
    upper = text.upper()
    if "CERTIFICATE_REQUIRED" in upper:
        return Failure("tls", f"{addr} requires a client certificate (mTLS)",
                       "pass --client-cert and --client-key (fleetd certs issue-client NAME)")
    if "UNKNOWN_CA" in upper or "BAD_CERTIFICATE" in upper or "CERTIFICATE_UNKNOWN" in upper:
        return Failure("tls", f"{addr} refused this client's certificate ({_short(text)})",
                       "use a client certificate issued by the CA the agent trusts "
                       "(its --client-ca)")
    if "WRONG_VERSION_NUMBER" in upper or "PACKET_LENGTH_TOO_LONG" in upper:
        return Failure("tls", f"{addr} does not speak TLS ({_short(text)})",
                       "is it a plain-HTTP agent or another service? agents serve TLS 1.3")
    if "PROTOCOL_VERSION" in upper or "UNSUPPORTED_PROTOCOL" in upper:
        return Failure("tls", f"{addr} does not accept TLS 1.3 ({_short(text)})",
                       "fleetd speaks TLS 1.3 only; is this a fleetd agent?")
    if "EOF" in upper or "RESET" in upper:
        return Failure("tls", f"{addr} closed the connection during the TLS handshake",
                       _rejected_cert_hint(opts))
    return Failure("tls", f"TLS with {addr} failed: {_short(text)}",
                   "check --ca-cert, --client-cert and --client-key against the agent's")


def _short(text: str) -> str:
    return text if len(text) <= 160 else text[:157] + "..."


def _connect_failure(exc: aiohttp.ClientConnectorError, target: Target,
                     opts: ClientOptions) -> Failure:
    addr = target.address
    os_err = exc.os_error
    code = getattr(os_err, "errno", None)
    if isinstance(os_err, socket.gaierror):
        return Failure("unreachable", f"cannot resolve {target.host!r}: {os_err.strerror}",
                       "check the host name, or use its address")
    if code == errno.ECONNREFUSED or isinstance(os_err, ConnectionRefusedError):
        return Failure("refused", f"connection to {addr} refused",
                       "is the agent running and listening on that address and port?")
    if code in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EADDRNOTAVAIL):
        return Failure("unreachable", f"{addr} is unreachable ({os.strerror(code or 0)})",
                       "check the address and the network path to the node")
    if "SSL" in str(exc) or isinstance(os_err, ssl.SSLError):
        return _tls_failure(exc, addr, opts)
    if code in (errno.ECONNRESET, errno.EPIPE):
        return _disconnected(exc, addr, opts)
    return Failure("unreachable", f"cannot connect to {addr}: {os_err}")


def _disconnected(exc: BaseException, addr: str, opts: ClientOptions) -> Failure:
    text = str(exc)
    if "ALERT" in text.upper():
        return _tls_failure(exc, addr, opts)
    return Failure("disconnected", f"{addr} closed the connection without an answer",
                   _rejected_cert_hint(opts))
