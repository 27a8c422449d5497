"""TLS session resumption across "commands" (fresh client contexts) through the per-user
ticket cache: real TLS 1.3 with mTLS on loopback, the server saying whether it resumed.

Each "command" builds a new client context with ``tls.client_context`` (as the CLI does),
connects, and flushes its tickets to the cache directory, as ``FleetClient`` does on exit.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fleetd.security import sessions, tls

if TYPE_CHECKING:
    from agents import Pki

NODE, CLIENT, OTHER = "gpu-01", "laptop", "desk"  # conftest's pki


@pytest.fixture(scope="module")
def certdir(pki: Pki) -> Path:
    """The fleet CA's directory (conftest's pki)."""
    return pki.dir


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "cache"
    monkeypatch.setenv(sessions.CACHE_ENV, str(d))
    yield d


class Server:
    """An mTLS TLS 1.3 server on loopback that answers each connection with whether its
    handshake resumed a session."""

    def __init__(self, pki: Path) -> None:
        self.ctx = tls.server_context(pki / f"{NODE}.pem", pki / f"{NODE}.key",
                                      pki / "ca.pem")
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readexactly(4)
            so = w.get_extra_info("ssl_object")
            w.write(b"R" if so.session_reused else b"F")
            await w.drain()
            w.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=self.ctx)
        self.port = self.server.sockets[0].getsockname()[1]


async def _command(pki: Path, server: Server, client: str = CLIENT, *,
                   port: int | None = None) -> str:
    """One 'command': a new context, one connection, tickets flushed. 'R' or 'F'."""
    ctx = tls.client_context(pki / "ca.pem", pki / f"{client}.pem", pki / f"{client}.key")
    assert isinstance(ctx, tls.ClientContext) and ctx.sessions is not None
    token = tls.DIALING.set(tls.Dial("127.0.0.1", port or server.port))
    try:
        r, w = await asyncio.open_connection("127.0.0.1", server.port, ssl=ctx,
                                             server_hostname="127.0.0.1")
    finally:
        tls.DIALING.reset(token)
    w.write(b"ping")
    got = await r.read(1)
    ctx.sessions.flush()  # while the connection (and its ticket) lives
    w.close()
    return got.decode()


def _run(pki: Path, *steps: tuple[str, int | None]) -> list[str]:
    async def go() -> list[str]:
        server = Server(pki)
        await server.start()
        try:
            return [await _command(pki, server, who, port=port) for who, port in steps]
        finally:
            assert server.server is not None
            server.server.close()
    return asyncio.run(go())


def test_a_second_command_resumes_and_the_cache_is_private(certdir: Path, cache: Path) -> None:
    assert sessions.openssl() is not None, "resumption is off on this Python/OpenSSL"
    assert _run(certdir, (CLIENT, None), (CLIENT, None), (CLIENT, None)) == ["F", "R", "R"]
    files = list(cache.glob(f"*/{sessions.FILE_NAME}"))
    assert len(files) == 1  # one directory per fleet CA
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700


def test_a_ticket_is_offered_only_to_its_node_and_identity(certdir: Path, cache: Path) -> None:
    # bob has no ticket of alice's; the same server under another address (port) is
    # another node as far as the cache knows.
    assert _run(certdir, (CLIENT, None), (OTHER, None), (CLIENT, 1)) == ["F", "F", "F"]
    assert _run(certdir, (CLIENT, None), (CLIENT, None)) == ["F", "R"]


def test_a_corrupt_cache_costs_a_full_handshake_and_is_removed(certdir: Path, cache: Path
                                                               ) -> None:
    _run(certdir, (CLIENT, None))
    [file] = cache.glob(f"*/{sessions.FILE_NAME}")
    file.write_bytes(b'{"x": {"der": "!!not base64", "expires": 1, "saved": 1}}')
    # (A new server has new ticket keys: resuming needs a ticket from this one.)
    assert _run(certdir, (CLIENT, None), (CLIENT, None)) == ["F", "R"]
    file.write_bytes(b"\x00garbage")
    assert _run(certdir, (CLIENT, None)) == ["F"]
    assert not file.exists() or file.read_bytes() != b"\x00garbage"


def test_a_cache_others_can_write_is_not_used(certdir: Path, cache: Path) -> None:
    _run(certdir, (CLIENT, None))
    [file] = cache.glob(f"*/{sessions.FILE_NAME}")
    file.chmod(0o666)
    assert sessions.SessionCache(file.parent).load() == {}
    file.chmod(0o600)
    file.parent.chmod(0o777)
    assert sessions.SessionCache(file.parent).load() == {}


def test_the_cache_is_bounded_and_drops_expired_entries(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions, "MAX_ENTRIES", 5)
    c = sessions.SessionCache(tmp_path / "ca")
    now = 2_000_000_000
    c.store({f"k{i}": sessions.Entry(b"x" * 100, now + 3600, float(i)) for i in range(8)})
    kept = c.load()
    assert sorted(kept) == ["k3", "k4", "k5", "k6", "k7"]  # the newest five
    c.store({"old": sessions.Entry(b"y", 1, 99.0)})  # expired long ago
    assert "old" not in c.load()
    assert os.stat(c.file).st_size < 5 * 1024


def test_turned_off_by_the_environment(certdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sessions.CACHE_ENV, "off")
    ctx = tls.client_context(certdir / "ca.pem", certdir / f"{CLIENT}.pem",
                             certdir / f"{CLIENT}.key")
    assert isinstance(ctx, tls.ClientContext)
    assert ctx.sessions is not None and ctx.sessions.cache is None  # in-process only
    plain = tls.client_context(certdir / "ca.pem", None, None, resume=False)
    assert isinstance(plain, ssl.SSLContext) and getattr(plain, "sessions", None) is None


def test_a_cache_directory_someone_else_made_is_neither_used_nor_written_through(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Issue 29, item 5: the ticket cache follows the private-directory rule
    # (fleetd/security/private_dir.py): a symlink, another owner, group/other access.
    entry = {"k": sessions.Entry(b"x" * 10, 2**40, 1.0)}
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "linked").symlink_to(target)
    linked = sessions.SessionCache(tmp_path / "linked")
    linked.store(entry)
    assert list(target.iterdir()) == [] and linked.load() == {}
    assert "is a symbolic link" in caplog.text
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o750)  # group may read: a ticket is a secret
    sessions.SessionCache(shared).store(entry)
    assert list(shared.iterdir()) == [] and "group or others may read or write" in caplog.text
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 54321, 54321)
        sessions.SessionCache(foreign).store(entry)
        assert list(foreign.iterdir()) == [] and "owned by uid 54321" in caplog.text
    ok = sessions.SessionCache(tmp_path / "fresh" / "ca")  # made here: 0700, and used
    ok.store(entry)
    assert stat.S_IMODE((tmp_path / "fresh" / "ca").stat().st_mode) == 0o700
    assert list(ok.load()) == ["k"]
