"""Real TLS 1.3 handshakes on 127.0.0.1 with certificates made by fleetd.security.certs.

The server is asyncio.start_server with fleetd's server_context; its connection handler
runs only after a handshake succeeded, so "the handler never ran and the client got no
bytes" is what a refusal looks like from both ends. In TLS 1.3 a client learns that the
server rejected its certificate only after its own side of the handshake is done (the
alert arrives with the first read), so every attempt writes and then reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

import agents
import aiohttp
import pytest
import trustme
from aiohttp import web

from fleetd.security import certs, tls

T = TypeVar("T")
NODE, CLIENT = "gpu-01", "laptop"  # conftest's pki
TIMEOUT = 5.0


@dataclass(frozen=True)
class Bed:
    ca: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path
    expired_cert: Path
    expired_key: Path
    foreign_cert: Path  # a client certificate from a different fleetd CA
    foreign_key: Path
    foreign_ca: Path


@pytest.fixture(scope="module")
def bed(pki: agents.Pki, tmp_path_factory: pytest.TempPathFactory) -> Bed:
    """The fleet's node gpu-01 and client laptop, an expired client of the same CA (in
    a copy of the fleet's directory), and client mallory of some other CA."""
    d = pki.copy_to(tmp_path_factory.mktemp("fleet") / "certs").dir
    other = tmp_path_factory.mktemp("other")
    now = datetime.now(UTC)
    certs.issue_client(
        d, "expired", not_before=now - timedelta(days=30), not_after=now - timedelta(minutes=1)
    )
    certs.init_ca(other, name="some other CA")
    certs.issue_client(other, "mallory")
    return Bed(
        ca=d / "ca.pem",
        node_cert=d / f"{NODE}.pem",
        node_key=d / f"{NODE}.key",
        client_cert=d / f"{CLIENT}.pem",
        client_key=d / f"{CLIENT}.key",
        expired_cert=d / "expired.pem",
        expired_key=d / "expired.key",
        foreign_cert=other / "mallory.pem",
        foreign_key=other / "mallory.key",
        foreign_ca=other / "ca.pem",
    )


@dataclass
class EchoServer:
    port: int
    peers: list[str] = field(default_factory=list)  # client CNs whose handshake succeeded
    received: list[bytes] = field(default_factory=list)


@contextlib.asynccontextmanager
async def echo_server(context: ssl.SSLContext) -> AsyncIterator[EchoServer]:
    state = EchoServer(port=0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cert = writer.get_extra_info("peercert") or {}
        cn = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
        state.peers.append(cn[0] if cn else "-")
        data = await reader.read(100)
        state.received.append(data)
        writer.write(b"echo:" + data)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


async def exchange(port: int, context: ssl.SSLContext, host: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=host
    )
    try:
        writer.write(b"ping")
        await writer.drain()
        return await reader.read(100)
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, TIMEOUT)

    return asyncio.run(bounded())


async def refused(port: int, context: ssl.SSLContext) -> str:
    """What the client saw when the handshake was refused (fails the test if it was not)."""
    try:
        data = await exchange(port, context)
    except (ssl.SSLError, ConnectionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    assert data == b"", f"handshake should have been refused, but got {data!r}"
    return "EOF"


@pytest.fixture(autouse=True)
def _quiet_asyncio(caplog: pytest.LogCaptureFixture) -> None:
    # asyncio logs every refused handshake at ERROR; those are the expected outcome here.
    caplog.set_level(logging.CRITICAL, logger="asyncio")


def _mtls_server(bed: Bed) -> ssl.SSLContext:
    return tls.server_context(bed.node_cert, bed.node_key, client_ca=bed.ca)


def _raw_client(bed: Bed, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    """A plain ssl client context (no fleetd checks), to present what fleetd would refuse."""
    ctx = ssl.create_default_context(cafile=str(bed.ca))
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


# --- mTLS -----------------------------------------------------------------------------


def test_valid_client_cert_completes_handshake_and_exchanges_bytes(bed: Bed) -> None:
    async def scenario() -> tuple[bytes, EchoServer, str | None]:
        async with echo_server(_mtls_server(bed)) as srv:
            client = tls.client_context(bed.ca, bed.client_cert, bed.client_key)
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=client)
            writer.write(b"ping")
            data = await reader.read(100)
            version = writer.get_extra_info("ssl_object").version()
            writer.close()
            return data, srv, version

    data, srv, version = run(scenario())
    assert data == b"echo:ping"
    assert version == "TLSv1.3"
    assert srv.peers == [CLIENT] and srv.received == [b"ping"]


def test_node_cert_also_works_as_client_cert(bed: Bed) -> None:
    async def scenario() -> tuple[bytes, list[str]]:
        async with echo_server(_mtls_server(bed)) as srv:
            client = tls.client_context(bed.ca, bed.node_cert, bed.node_key)
            return await exchange(srv.port, client, "localhost"), srv.peers

    assert run(scenario()) == (b"echo:ping", [NODE])


@pytest.mark.parametrize("case", ["no client cert", "other CA", "expired", "trustme CA"])
def test_handshake_refused_for_bad_client_certs(bed: Bed, case: str, tmp_path: Path) -> None:
    if case == "no client cert":
        client = tls.client_context(bed.ca, None, None)
    elif case == "other CA":
        client = tls.client_context(bed.ca, bed.foreign_cert, bed.foreign_key)
    elif case == "expired":
        # fleetd's client_context refuses expired certs itself; a raw context presents it.
        client = _raw_client(bed, bed.expired_cert, bed.expired_key)
    else:
        other = trustme.CA()
        issued = other.issue_cert("mallory.example")
        issued.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "m.pem"))
        client = _raw_client(bed, tmp_path / "m.pem", tmp_path / "m.pem")

    async def scenario() -> tuple[str, EchoServer]:
        async with echo_server(_mtls_server(bed)) as srv:
            # The control: the same server accepts a good client right before.
            good = tls.client_context(bed.ca, bed.client_cert, bed.client_key)
            assert await exchange(srv.port, good) == b"echo:ping"
            return await refused(srv.port, client), srv

    outcome, srv = run(scenario())
    assert srv.peers == [CLIENT], f"{case}: the refused client reached the handler"
    assert srv.received == [b"ping"]
    print(f"{case}: {outcome}")  # e.g. SSLError: [SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED]


def test_tls12_client_is_refused(bed: Bed) -> None:
    client = _raw_client(bed, bed.client_cert, bed.client_key)
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    client.maximum_version = ssl.TLSVersion.TLSv1_2

    async def scenario() -> tuple[str, EchoServer]:
        async with echo_server(_mtls_server(bed)) as srv:
            return await refused(srv.port, client), srv

    outcome, srv = run(scenario())
    # The server never completed a handshake; the client sees an alert or a reset
    # (asyncio aborts the connection right after its alert, so either can arrive first).
    assert srv.peers == [] and srv.received == []
    assert outcome != "EOF"


def test_client_refuses_server_from_another_ca_or_wrong_host(bed: Bed) -> None:
    async def scenario() -> list[str]:
        outcomes = []
        async with echo_server(_mtls_server(bed)) as srv:
            foreign = tls.client_context(bed.foreign_ca, bed.client_cert, bed.client_key)
            good = tls.client_context(bed.ca, bed.client_cert, bed.client_key)
            for ctx, host in ((foreign, "127.0.0.1"), (good, "gpu-99.example")):
                with pytest.raises(ssl.SSLCertVerificationError) as err:
                    await exchange(srv.port, ctx, host)
                outcomes.append(str(err.value))
            assert srv.received == []
        return outcomes

    other_ca, wrong_host = run(scenario())
    assert "certificate verify failed" in other_ca
    assert "mismatch" in wrong_host.lower() or "match" in wrong_host.lower()


# --- self-signed loopback certificate with a pinned fingerprint -----------------------


def test_self_signed_pinned_accepts_right_pin_and_rejects_wrong(tmp_path: Path) -> None:
    cert, key, fp = tls.self_signed(tmp_path)
    server_ctx = tls.server_context(cert, key, None)
    wrong = ":".join(["00"] * 32)

    async def scenario() -> tuple[bytes, str, EchoServer]:
        async with echo_server(server_ctx) as srv:
            ok = await exchange(srv.port, tls.client_context(None, None, None, pinned_sha256=fp))
            with pytest.raises(tls.PinMismatchError) as err:
                await exchange(srv.port, tls.client_context(None, None, None, pinned_sha256=wrong))
            await asyncio.sleep(0.05)  # let the server notice the aborted connection
            return ok, str(err.value), srv

    ok, error, srv = run(scenario())
    assert ok == b"echo:ping"
    assert fp in error and wrong in error
    # The mismatch aborts the handshake: not one byte of the request reached the server.
    assert b"ping" not in srv.received[1:]
    # Without a pin the self-signed certificate is simply untrusted.
    with pytest.raises(ssl.SSLCertVerificationError):
        run(_one_shot(server_ctx, ssl.create_default_context()))


async def _one_shot(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> bytes:
    async with echo_server(server_ctx) as srv:
        return await exchange(srv.port, client_ctx)


def test_pinning_with_aiohttp_fails_before_the_request_is_sent(tmp_path: Path) -> None:
    """The fleet client's path: aiohttp with ssl=client_context(..., pinned_sha256=FP)."""
    cert, key, fp = tls.self_signed(tmp_path)
    hits: list[str] = []

    async def health(request: web.Request) -> web.Response:
        hits.append(request.headers.get("Authorization", ""))
        return web.json_response({"ok": True})

    async def scenario() -> tuple[dict[str, bool], type[BaseException]]:
        app = web.Application()
        app.router.add_get("/api/v1/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.server_context(cert, key, None))
        await site.start()
        port = runner.addresses[0][1]
        url = f"https://127.0.0.1:{port}/api/v1/health"
        try:
            async with aiohttp.ClientSession() as session:
                good = tls.client_context(None, None, None, pinned_sha256=fp)
                async with session.get(url, ssl=good) as resp:
                    body = await resp.json()
                bad = tls.client_context(None, None, None, pinned_sha256="11" * 32)
                with pytest.raises(aiohttp.ClientError) as err:
                    await session.get(url, ssl=bad, headers={"Authorization": "Bearer secret"})
            return body, type(err.value)
        finally:
            await runner.cleanup()

    body, error_type = run(scenario())
    assert body == {"ok": True}
    assert issubclass(error_type, aiohttp.ClientConnectorError)
    assert hits == [""]  # only the good request arrived; the token never left the client


def test_aiohttp_mtls_end_to_end(bed: Bed) -> None:
    """An aiohttp server with server_context sees the verified client certificate."""

    async def who(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        cn = [v for rdn in (peer or {}).get("subject", ()) for k, v in rdn if k == "commonName"]
        return web.json_response({"cn": cn})

    async def scenario() -> tuple[object, type[BaseException]]:
        app = web.Application()
        app.router.add_get("/who", who)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=_mtls_server(bed))
        await site.start()
        url = f"https://localhost:{runner.addresses[0][1]}/who"
        try:
            async with aiohttp.ClientSession() as session:
                ctx = tls.client_context(bed.ca, bed.client_cert, bed.client_key)
                async with session.get(url, ssl=ctx) as resp:
                    body = await resp.json()
                anon = tls.client_context(bed.ca, None, None)
                with pytest.raises(aiohttp.ClientError) as err:
                    async with session.get(url, ssl=anon) as resp:
                        await resp.read()
            return body, type(err.value)
        finally:
            await runner.cleanup()

    body, error_type = run(scenario())
    assert body == {"cn": [CLIENT]}
    assert issubclass(error_type, aiohttp.ClientError)


def test_pinning_under_uvloop(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    cert, key, fp = tls.self_signed(tmp_path)
    server_ctx = tls.server_context(cert, key, None)

    async def scenario() -> bytes:
        async with echo_server(server_ctx) as srv:
            bad = tls.client_context(None, None, None, pinned_sha256="22" * 32)
            with pytest.raises(tls.PinMismatchError):
                await exchange(srv.port, bad)
            good = tls.client_context(None, None, None, pinned_sha256=fp)
            return await exchange(srv.port, good)

    async def bounded() -> bytes:
        return await asyncio.wait_for(scenario(), TIMEOUT)

    assert uvloop.run(bounded()) == b"echo:ping"


def test_check_pinned_on_a_blocking_socket(tmp_path: Path) -> None:
    """check_pinned also works by hand, on an SSLSocket from a plain context."""
    import socket
    import threading

    cert, key, fp = tls.self_signed(tmp_path)
    server_ctx = tls.server_context(cert, key, None)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with contextlib.suppress(OSError), server_ctx.wrap_socket(conn, server_side=True) as s:
            s.sendall(b"hello")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw,
        client.wrap_socket(raw) as s,
    ):
        tls.check_pinned(s, fp)
        with pytest.raises(tls.PinMismatchError):
            tls.check_pinned(s, "33" * 32)
        assert s.recv(5) == b"hello"
    thread.join(TIMEOUT)
    listener.close()
