"""Every SSLContext fleetd uses is built here, and the listening policy is decided here.

Rules (../shared/DESIGN.md, Security model):

* TLS 1.3 only, on both sides.
* Beyond loopback the agent needs a certificate AND a CA for client certificates (mTLS);
  a client without a valid certificate is refused during the handshake.
* On loopback, with no certificate configured, the agent may use a self-signed ECDSA
  P-256 certificate (:func:`self_signed`) whose SHA-256 fingerprint it prints; clients
  pin that fingerprint instead of trusting a CA.
* Plain HTTP only when asked for explicitly, and only on loopback.

Pinning. Python's ssl module cannot pin a certificate natively, so
``client_context(..., pinned_sha256=FP)`` returns a :class:`PinnedContext`: chain
verification is off (a self-signed certificate has no chain), and the context's
SSLObject/SSLSocket classes call :func:`check_pinned` as the last step of the handshake.
A wrong certificate therefore fails the handshake itself, before a single byte of the
request (or its bearer token) is sent, with asyncio streams, ``loop.create_connection``,
aiohttp (``session.get(url, ssl=ctx)``), under uvloop, and with blocking sockets alike.
Code that handles raw ``ssl.SSLObject``s itself can call :func:`check_pinned` directly.
The fleet client does::

    ctx = tls.client_context(None, None, None, pinned_sha256=node.fingerprint)
    async with session.get(f"https://127.0.0.1:{port}/api/v1/health", ssl=ctx) as resp: ...

With a CA and a pin together, both the chain and the pin must match.

Resumption. Every client context is a :class:`ClientContext`: asyncio makes its
connections through ``wrap_bio``, where the context offers the TLS 1.3 session ticket
it holds for the node being dialled (the fleet client names the node in
:data:`DIALING` around each request) and registers the connection so that its ticket is
kept afterwards, in memory and in the per-user cache of :mod:`fleetd.security.sessions`.
A resumed handshake skips the certificates; the pin check still runs on the
certificate the session carries.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import ssl
import stat
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from fleetd.errors import ConfigError
from fleetd.security import certs, sessions
from fleetd.security.sessions import Sessions

log = logging.getLogger("fleetd.security.tls")

TLS13 = ssl.TLSVersion.TLSv1_3
SELF_SIGNED_CERT = "self-signed.pem"
SELF_SIGNED_KEY = "self-signed.key"
SELF_SIGNED_DAYS = 365
# A reused self-signed certificate must stay valid at least this long, so an agent never
# starts with one that expires while it runs.
SELF_SIGNED_MIN_LEFT = timedelta(days=7)
LOOPBACK_SANS = ("127.0.0.1", "::1", "localhost")


# --- fingerprints and pinning ---------------------------------------------------------


def fingerprint(cert: bytes | str | x509.Certificate) -> str:
    """SHA-256 of a certificate (PEM text/bytes, DER bytes or parsed) as ``AB:CD:...``."""
    if isinstance(cert, x509.Certificate):
        return certs.cert_fingerprint(cert)
    data = cert.encode("ascii") if isinstance(cert, str) else cert
    if data.lstrip().startswith(b"-----BEGIN"):
        return certs.cert_fingerprint(x509.load_pem_x509_certificate(data))
    # DER is hashed as is: that is exactly what getpeercert(binary_form=True) returns.
    digest = hashes.Hash(hashes.SHA256())
    digest.update(data)
    return ":".join(f"{b:02X}" for b in digest.finalize())


def normalize_fingerprint(value: str) -> str:
    """Accept ``ab:cd:..``, ``ABCD..`` or ``sha256:ABCD..``; return ``AB:CD:..``."""
    text = value.strip()
    if text.lower().startswith("sha256:") or text.lower().startswith("sha256="):
        text = text[7:]
    hexits = text.replace(":", "").upper()
    if len(hexits) != 64 or any(c not in "0123456789ABCDEF" for c in hexits):
        raise ConfigError(
            f"bad SHA-256 fingerprint {value!r}",
            "copy the 64 hex digits (colons optional) the agent printed at startup",
        )
    return ":".join(hexits[i : i + 2] for i in range(0, 64, 2))


def pin_bytes(value: str) -> bytes:
    """The raw 32-byte digest, e.g. for ``aiohttp.Fingerprint``."""
    return bytes.fromhex(normalize_fingerprint(value).replace(":", ""))


class PinMismatchError(ssl.SSLCertVerificationError):
    """The peer's certificate is not the pinned one. An SSL error, so it fails handshakes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "pinned certificate mismatch"


def check_pinned(ssl_object: ssl.SSLObject | ssl.SSLSocket, pinned_sha256: str) -> None:
    """Raise :class:`PinMismatchError` unless the peer's certificate has this fingerprint.

    Call it after the handshake and before sending anything. :class:`PinnedContext`
    calls it for you at the end of every handshake.
    """
    want = normalize_fingerprint(pinned_sha256)
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        raise PinMismatchError(f"the server sent no certificate (pinned {want})")
    got = fingerprint(der)
    # Fingerprints are public; the constant-time compare is only habit, not a defence.
    if not hmac.compare_digest(got, want):
        raise PinMismatchError(
            f"server certificate fingerprint {got} does not match the pinned {want}"
        )


def _pin_of(context: ssl.SSLContext) -> str:
    pin = getattr(context, "pinned_sha256", None)
    if not isinstance(pin, str):
        # Fail closed: a pinned socket on a context without a pin must never verify nothing.
        raise PinMismatchError("pinned connection without a pinned fingerprint")
    return pin


@dataclass(slots=True)
class Dial:
    """The node a client is about to ask, set in :data:`DIALING` around a request so
    that the context's ``wrap_bio`` (called by asyncio with no such argument) knows
    which node a new connection is for, and offers that node's ticket. The client also
    notes in it when the request went out (a clock sample's t0)."""

    host: str
    port: int
    sent_ns: int = 0  # wall clock when the request was handed to the connection
    connected: bool = False  # a new connection was made (and its handshake done) for it


DIALING: ContextVar[Dial | None] = ContextVar("fleetd_tls_dialing", default=None)


class _PinnedSSLObject(ssl.SSLObject):
    def do_handshake(self) -> None:
        super().do_handshake()  # raises SSLWantRead/WriteError until it is complete
        check_pinned(self, _pin_of(self.context))


class _PinnedSSLSocket(ssl.SSLSocket):
    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        check_pinned(self, _pin_of(self.context))


class ClientContext(ssl.SSLContext):
    """A client context that resumes TLS sessions: in ``wrap_bio`` it offers the ticket
    :attr:`sessions` holds for the node being dialled (:data:`DIALING`) and registers the
    connection so that its own ticket can be kept (:meth:`Sessions.flush`)."""

    sessions: Sessions | None = None

    def wrap_bio(self, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                 server_side: bool = False, server_hostname: str | bytes | None = None,
                 session: ssl.SSLSession | None = None) -> ssl.SSLObject:
        obj = super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)
        dial = DIALING.get()
        if dial is None or server_side:
            return obj
        dial.connected = True
        if self.sessions is not None and session is None:
            try:
                name = (server_hostname.decode("ascii", "replace")
                        if isinstance(server_hostname, bytes) else server_hostname)
                self.sessions.prepare(self, obj, sessions.key(dial.host, dial.port, name,
                                                              self.sessions.identity))
            except Exception as exc:  # never let resumption cost a connection
                sessions.disable(f"offering a session failed: {exc!r}")
        return obj


class PinnedContext(ClientContext):
    """A client context whose handshakes fail unless the peer matches ``pinned_sha256``."""

    sslobject_class = _PinnedSSLObject
    sslsocket_class = _PinnedSSLSocket
    pinned_sha256: str


# --- checking files before OpenSSL sees them ------------------------------------------


def _check_cert_and_key(cert_path: Path, key_path: Path, role: str, fix: str) -> x509.Certificate:
    """Parse both files, make sure they belong together and the cert is in its validity window."""
    cert = certs.load_certificates(cert_path, f"{role} certificate")[0]
    key = certs.load_private_key(key_path, f"{role} key")
    certs.warn_if_readable_by_others(key_path, f"{role} key")
    if not certs.key_matches(cert, key):
        raise ConfigError(
            f"{role} key '{key_path}' does not belong to {role} certificate '{cert_path}'",
            f"use the .key file issued together with that certificate, or {fix}",
        )
    now = datetime.now(UTC)
    if cert.not_valid_after_utc <= now:
        raise ConfigError(
            f"{role} certificate '{cert_path}' expired on "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; refusing to start with it",
            fix,
        )
    if cert.not_valid_before_utc > now:
        log.warning(
            "%s certificate %s is not valid before %s; peers will refuse it until then "
            "(check this machine's clock)",
            role,
            cert_path,
            cert.not_valid_before_utc,
        )
    return cert


def _check_ca_file(path: Path, role: str) -> None:
    cas = certs.load_certificates(
        path, role, "point it at the fleet's ca.pem (made by `fleetd certs init-ca`)"
    )
    now = datetime.now(UTC)
    if all(c.not_valid_after_utc <= now for c in cas):
        raise ConfigError(
            f"{role} '{path}' has expired; no certificate it signed can be verified",
            "make a new CA with `fleetd certs init-ca --force` and reissue the certificates",
        )


def _tls13(context: ssl.SSLContext) -> None:
    context.minimum_version = TLS13
    context.maximum_version = TLS13


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path) -> None:
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"OpenSSL refused certificate '{cert}' with key '{key}': {exc.reason or exc}",
            "reissue them with `fleetd certs`",
        ) from None


def _load_ca(context: ssl.SSLContext, path: Path, role: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"OpenSSL refused {role} '{path}': {exc.reason or exc}",
            "point it at the fleet's ca.pem",
        ) from None


# --- contexts -------------------------------------------------------------------------


def server_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    """The agent's context: TLS 1.3 only; with ``client_ca``, a valid client cert is required."""
    cert, key = Path(cert), Path(key)
    _check_cert_and_key(
        cert,
        key,
        "server",
        "issue a new one: fleetd certs issue-node NAME --san HOST --force",
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _tls13(context)
    _load_chain(context, cert, key)
    if client_ca is not None:
        client_ca = Path(client_ca)
        _check_ca_file(client_ca, "client CA")
        _load_ca(context, client_ca, "client CA")
        # Verified during the handshake: a client without a certificate from this CA
        # never reaches the HTTP layer.
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    *,
    pinned_sha256: str | None = None,
    resume: bool = True,
    session_cache: bool = True,
) -> ssl.SSLContext:
    """The fleet client's context: TLS 1.3, server verified against ``ca`` (with host
    names) and/or ``pinned_sha256``; ``cert``/``key`` presented for mTLS. With
    ``resume``, sessions are resumed within the process and, with ``session_cache``,
    across commands through the per-user cache (:mod:`fleetd.security.sessions`); a
    daemon (an agent relaying to its peers) keeps them in memory only."""
    if ca is None and pinned_sha256 is None:
        raise ConfigError(
            "no way to verify the server: neither a CA nor a pinned fingerprint is set",
            "pass the fleet's ca.pem (--ca), or the fingerprint a loopback agent printed",
        )
    if (cert is None) != (key is None):
        raise ConfigError(
            "a client certificate needs its key and a key needs its certificate "
            f"(got cert={str(cert) if cert else None!r}, key={str(key) if key else None!r})",
            "pass both, e.g. certs/NAME.pem and certs/NAME.key from `fleetd certs issue-client`",
        )
    context: ClientContext
    if pinned_sha256 is not None:
        pinned = PinnedContext(ssl.PROTOCOL_TLS_CLIENT)
        pinned.pinned_sha256 = normalize_fingerprint(pinned_sha256)
        context = pinned
    else:
        context = ClientContext(ssl.PROTOCOL_TLS_CLIENT)
    _tls13(context)
    if ca is not None:
        ca = Path(ca)
        _check_ca_file(ca, "CA")
        _load_ca(context, ca, "CA")
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
    else:
        # Pin only: a self-signed certificate has no chain to verify, so the pin check
        # in PinnedContext's handshake is the whole verification.
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert is not None and key is not None:
        cert, key = Path(cert), Path(key)
        _check_cert_and_key(
            cert, key, "client", "issue a new one: fleetd certs issue-client NAME --force"
        )
        _load_chain(context, cert, key)
    if resume:
        context.sessions = _sessions_for(ca, cert, pinned_sha256, session_cache)
    return context


def _sessions_for(ca: Path | None, cert: Path | None, pin: str | None,
                  on_disk: bool) -> Sessions:
    """Tickets per fleet CA (the cache directory) and per client identity (the key)."""
    ca_fp = fingerprint(Path(ca).read_bytes()) if ca is not None else None
    cert_fp = fingerprint(Path(cert).read_bytes()) if cert is not None else "-"
    identity = f"{cert_fp}/{normalize_fingerprint(pin) if pin else '-'}".replace(":", "")
    base = sessions.default_dir() if on_disk else None
    scope = (ca_fp or f"pin-{normalize_fingerprint(pin or '')}").replace(":", "")
    return Sessions(identity, sessions.SessionCache(base / scope) if base else None)


# --- the loopback self-signed certificate ---------------------------------------------


def _reusable(
    cert_path: Path, key_path: Path, sans: list[x509.GeneralName]
) -> x509.Certificate | None:
    if not (cert_path.exists() and key_path.exists()):
        return None
    try:
        cert = certs.load_certificates(cert_path)[0]
        key = certs.load_private_key(key_path)
    except ConfigError as exc:
        log.warning("replacing unusable self-signed certificate: %s", exc)
        return None
    try:
        have = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        have = set()
    fresh = cert.not_valid_after_utc - datetime.now(UTC) > SELF_SIGNED_MIN_LEFT
    if certs.key_matches(cert, key) and fresh and set(sans) <= have:
        return cert
    log.info("self-signed certificate in %s is stale or mismatched; making a new one", cert_path)
    return None


def self_signed(dir: Path, host: str = "127.0.0.1") -> tuple[Path, Path, str]:
    """A loopback-only ECDSA P-256 certificate in ``dir``: (cert, key, SHA-256 fingerprint).

    An existing valid one is reused so the fingerprint clients pinned stays the same
    across restarts. Both files are 0600.
    """
    if not is_loopback(host):
        raise ConfigError(
            f"a self-signed certificate is only for loopback, not {host!r}",
            "beyond loopback use certificates from `fleetd certs` and --client-ca (mTLS)",
        )
    directory = Path(dir)
    cert_path, key_path = directory / SELF_SIGNED_CERT, directory / SELF_SIGNED_KEY
    wanted = [certs.parse_san(h) for h in (*LOOPBACK_SANS, host)]
    sans = list(dict.fromkeys(wanted))  # dedupe, keep order
    cert = _reusable(cert_path, key_path, sans)
    if cert is None:
        cert, key = certs.make_self_signed(
            sans, common_name="fleetd loopback agent", days=SELF_SIGNED_DAYS
        )
        certs.write_pair(cert_path, key_path, cert, key, force=True)
        log.info("wrote self-signed certificate %s", cert_path)
    return cert_path, key_path, certs.cert_fingerprint(cert)


# --- listening policy -----------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (also bracketed or IPv4-mapped) and ``localhost``; nothing resolved."""
    text = host.strip().strip("[]")
    if text.lower().rstrip(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False  # other names could resolve anywhere: not loopback
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_listen_policy(
    host: str, *, have_cert: bool, have_client_ca: bool, plain_http: bool
) -> None:
    """Raise ConfigError unless this combination is allowed (see the module docstring).

    Returning means: serve plain HTTP if and only if ``plain_http`` was asked for; else
    TLS, with the configured certificate or, on loopback without one, :func:`self_signed`.
    """
    loopback = is_loopback(host)
    if plain_http:
        if not loopback:
            raise ConfigError(
                f"plain HTTP is only allowed on loopback, not on {host!r}",
                "drop the plain-HTTP option and use TLS with client certificates "
                "(fleetd certs), or listen on 127.0.0.1",
            )
        if have_cert or have_client_ca:
            raise ConfigError(
                "plain HTTP was asked for together with TLS certificates",
                "choose one: remove the plain-HTTP option or the certificate options",
            )
        log.warning("serving plain HTTP on %s: explicitly requested, loopback only", host)
        return
    if have_client_ca and not have_cert:
        raise ConfigError(
            "a client CA is set but no server certificate/key",
            "pass --tls-cert and --tls-key (fleetd certs issue-node NAME --san HOST)",
        )
    if loopback:
        return
    if not have_cert:
        raise ConfigError(
            f"listening on {host!r} (beyond loopback) needs a server certificate",
            "make one: fleetd certs init-ca; fleetd certs issue-node NAME --san HOST; "
            "then pass --tls-cert, --tls-key and --client-ca",
        )
    if not have_client_ca:
        raise ConfigError(
            f"listening on {host!r} (beyond loopback) requires client certificates (mTLS)",
            "pass --client-ca certs/ca.pem, or listen on 127.0.0.1",
        )


# --- bearer tokens --------------------------------------------------------------------


def token_ok(presented: str | None, expected: str) -> bool:
    """Constant-time comparison; an empty expected token never matches anything."""
    if presented is None or not expected:
        return False
    # Bytes, because compare_digest only accepts ASCII str. A header may carry bytes
    # that are not UTF-8 (aiohttp keeps them as surrogates): they encode back as they
    # came and simply do not match, instead of raising.
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"),
                               expected.encode("utf-8"))


# --- who may query --------------------------------------------------------------------


def client_refusal(der: bytes, relay_nodes: frozenset[str]) -> str | None:
    """Why an agent must not answer the holder of this (already chain-verified) client
    certificate, or None when it may: a client certificate issued as such (EKU
    clientAuth, role fleetd-client), or a node certificate of a node configured to
    relay. A leaked node key is then no key to every node's data."""
    try:
        peer = certs.peer_role(der)
    except ValueError:
        return "the client certificate cannot be parsed"
    if not peer.client_auth:
        return f"certificate {peer.name!r} is not issued for client use (no clientAuth EKU)"
    if peer.role == certs.ROLE_CLIENT:
        return None
    if peer.role == certs.ROLE_NODE:
        if peer.name in relay_nodes:
            return None
        return (f"certificate {peer.name!r} is a node certificate, and node {peer.name!r} "
                "is not allowed to relay queries here")
    return f"certificate {peer.name!r} carries no fleetd client role"


def load_token(path: Path) -> str:
    """The bearer token in ``path``, stripped. Refuses files others can read or write."""
    path = Path(path)
    hint = "write a random token into it: head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE"
    data = certs.read_file(path, "token file", hint)
    mode = 0
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError(
            f"token file '{path}' is readable or writable by every user (mode {mode:o})",
            f"chmod 600 {path}",
        )
    if mode & stat.S_IRWXG:
        log.warning("token file %s is group-accessible (mode %o); chmod 600 it", path, mode)
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"token file '{path}' is not UTF-8 text", hint) from None
    if not token:
        raise ConfigError(f"token file '{path}' is empty", hint)
    if any(c.isspace() for c in token):
        raise ConfigError(
            f"token file '{path}' holds more than one word",
            "a token is one line without spaces; " + hint,
        )
    if len(token) < 16:
        log.warning("token in %s is only %d characters; use 32 or more", path, len(token))
    return token
