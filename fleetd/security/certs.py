"""The fleet certificate authority: one CA, node certificates, client certificates.

Layout of a certificate directory (default ``certs/``)::

    ca.pem   ca.key       the fleet CA (the key stays on the machine that issues)
    NAME.pem NAME.key     a node (serverAuth + clientAuth) or a client (clientAuth)

The two kinds are told apart by their role, written as the subject's OU
(``fleetd-node`` or ``fleetd-client``) next to the EKU: an agent answers queries from
client certificates only, and from a node certificate only when its configuration lets
that node relay (:func:`peer_role` reads it back).

Every key is ECDSA P-256 and every signature SHA-256. Every file is written 0600 through
a temporary file that is created 0600 and then renamed, so no key is ever readable by
others, not even for a moment. Nothing is overwritten without ``force``.

SAN policy for node certificates: the node NAME becomes a DNS SAN when it is a valid DNS
name (or an IP SAN when it is an IP address), plus every ``--san``. Loopback names
(127.0.0.1, ::1, localhost) are NOT added implicitly: a certificate that claims
"localhost" is valid for every machine's localhost, so it has to be asked for.

The file readers here (:func:`load_certificates`, :func:`load_private_key`) turn every
way a PEM file can be wrong into a :class:`ConfigError` that names the file and the fix;
:mod:`fleetd.security.tls` uses them before handing files to OpenSSL, whose own errors do
not say which file was wrong.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    CertificatePublicKeyTypes,
    PrivateKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleetd.errors import ConfigError, UsageError

log = logging.getLogger("fleetd.security.certs")

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
# Names whose files would collide with files this module or the agent writes itself.
RESERVED_NAMES = frozenset({"ca", "self-signed"})
CA_DAYS = 3650
LEAF_DAYS = 825  # the longest validity browsers ever accepted; rotation is cheap anyway
# Certificates start a few minutes in the past so that a node whose clock is slightly
# behind the issuing machine's does not reject a certificate that was just issued.
CLOCK_SKEW = timedelta(minutes=5)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_DNS_LABEL_RE = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class Issued:
    """What was written: for the CLI to print, and for tests to use."""

    cert_path: Path
    key_path: Path
    fingerprint: str
    not_before: datetime
    not_after: datetime
    sans: tuple[str, ...] = ()


# --- names and SANs -------------------------------------------------------------------


def validate_name(name: str) -> str:
    """A NAME becomes a file name: no separators, no dot-files, no reserved names."""
    if not _NAME_RE.match(name) or name.endswith((".pem", ".key")):
        raise UsageError(
            f"bad certificate name {name!r}",
            "use letters, digits, '.', '_' and '-' (at most 63, starting with a letter or "
            "digit, without .pem/.key), e.g. the node's host name",
        )
    if name.lower() in RESERVED_NAMES:
        raise UsageError(
            f"certificate name {name!r} is reserved",
            f"{name}.pem/{name}.key are fleetd's own files; pick another name",
        )
    return name


def is_dns_name(value: str) -> bool:
    """A host name that may go into a dNSName SAN (no wildcards, no IP literals)."""
    value = value.lower().rstrip(".")
    if not value or len(value) > 253:
        return False
    labels = value.split(".")
    # An all-numeric last label is a mistyped IP address (1.2.3.256), not a host name.
    return all(_DNS_LABEL_RE.match(label) for label in labels) and not labels[-1].isdigit()


def parse_san(value: str) -> x509.GeneralName:
    """``10.0.0.5`` or ``::1`` becomes an IP SAN, ``gpu-01.example`` a DNS SAN."""
    try:
        return x509.IPAddress(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        pass
    if is_dns_name(value):
        return x509.DNSName(value.lower().rstrip("."))
    raise UsageError(
        f"bad --san {value!r}: neither an IP address nor a DNS name",
        "pass a host name like gpu-01.example.com or an address like 10.0.0.5 "
        "(wildcards are not supported)",
    )


def node_sans(name: str, sans: Sequence[str]) -> list[x509.GeneralName]:
    """The node's own name (if it is a usable host name or address) plus ``sans``, deduplicated."""
    wanted: list[str] = list(sans)
    try:
        parse_san(name)
        wanted.insert(0, name)
    except UsageError:
        log.info("node name %r is not a DNS name or address; not added as a SAN", name)
    out: list[x509.GeneralName] = []
    for value in wanted:
        san = parse_san(value)
        if san not in out:
            out.append(san)
    if not out:
        raise UsageError(
            f"the certificate for {name!r} would have no subject alternative name, "
            "so no client could verify it",
            "pass the address clients connect to: --san HOST_OR_IP (repeatable)",
        )
    return out


def san_strings(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(str(v) for v in ext.get_values_for_type(x509.DNSName)) + tuple(
        str(v) for v in ext.get_values_for_type(x509.IPAddress)
    )


# --- files ----------------------------------------------------------------------------


def read_file(path: Path, what: str, hint: str) -> bytes:
    """Read a file; every failure becomes a ConfigError naming the file."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' does not exist", hint) from None
    except IsADirectoryError:
        raise ConfigError(f"{what} '{path}' is a directory, not a file", hint) from None
    except PermissionError:
        raise ConfigError(
            f"cannot read {what} '{path}': permission denied",
            "run fleetd as the user that owns the file, or fix its owner",
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} '{path}': {exc.strerror}", hint) from None


def load_certificates(
    path: Path, what: str = "certificate", hint: str = ""
) -> list[x509.Certificate]:
    """All certificates in a PEM file (a chain or a CA bundle), at least one."""
    hint = hint or "point it at a PEM certificate made by `fleetd certs`"
    data = read_file(path, what, hint)
    if b"PRIVATE KEY" in data and b"CERTIFICATE" not in data:
        raise ConfigError(
            f"{what} '{path}' holds a private key, not a certificate",
            "the certificate and key options look swapped",
        )
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ConfigError(
            f"{what} '{path}' is not a PEM certificate (no readable "
            "'-----BEGIN CERTIFICATE-----' block)",
            hint,
        ) from None


def load_private_key(path: Path, what: str = "private key") -> PrivateKeyTypes:
    data = read_file(path, what, "point it at the .key file written next to the certificate")
    if b"PRIVATE KEY" not in data and b"CERTIFICATE" in data:
        raise ConfigError(
            f"{what} '{path}' holds a certificate, not a private key",
            "the certificate and key options look swapped",
        )
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise ConfigError(
            f"{what} '{path}' is encrypted with a passphrase",
            "fleetd starts unattended and needs an unencrypted key, protected by mode 0600 "
            "instead: openssl pkey -in KEY -out KEY.plain",
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(
            f"{what} '{path}' is not a readable PEM private key",
            "point it at the .key file written next to the certificate by `fleetd certs`",
        ) from None


def warn_if_readable_by_others(path: Path, what: str) -> None:
    with contextlib.suppress(OSError):
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("%s %s is mode %o; it should be 0600: chmod 600 %s", what, path, mode, path)


def _spki(public_key: CertificatePublicKeyTypes) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def key_matches(cert: x509.Certificate, key: PrivateKeyTypes) -> bool:
    return _spki(cert.public_key()) == _spki(key.public_key())  # type: ignore[arg-type]


def write_private(path: Path, data: bytes, *, force: bool) -> None:
    """Write ``data`` to ``path`` with mode 0600, atomically.

    The temporary file is created 0600 by ``mkstemp`` (umask can only narrow it), filled,
    fsynced and then moved into place. Without ``force`` the move is a hard link, which
    fails if ``path`` appeared meanwhile, so a concurrent writer is never clobbered.
    """
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if force:
            os.replace(tmp, path)
        else:
            _move_no_clobber(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _move_no_clobber(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise _exists_error(path) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        # A file system without hard links: check, then rename (a small race, no leak).
        if path.exists():
            raise _exists_error(path) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def _exists_error(path: Path) -> ConfigError:
    return ConfigError(
        f"'{path}' already exists; not overwriting it",
        "pass --force to replace it (clients and nodes using the old file must be updated)",
    )


def _refuse_existing(paths: Sequence[Path], force: bool) -> None:
    # Checked for every file before anything is written, so a refusal never leaves a
    # new key next to an old certificate.
    if force:
        return
    for path in paths:
        if path.exists():
            raise _exists_error(path)


def _ensure_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create certificate directory '{directory}': {exc.strerror}",
            "pass --dir with a directory you can write",
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"certificate directory '{directory}' is not writable",
            "pass --dir with a directory you can write",
        )


# --- building certificates ------------------------------------------------------------


def generate_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the DER certificate as ``AB:CD:...``, as ``openssl x509 -fingerprint`` prints."""
    return ":".join(f"{b:02X}" for b in cert.fingerprint(hashes.SHA256()))


def validity(
    days: int, not_before: datetime | None = None, not_after: datetime | None = None
) -> tuple[datetime, datetime]:
    """The validity window. ``not_before``/``not_after`` exist so tests can make expired certs."""
    start = not_before or datetime.now(UTC) - CLOCK_SKEW
    end = not_after or start + CLOCK_SKEW + timedelta(days=days)
    if end <= start:
        raise UsageError(
            f"validity would end ({end:%Y-%m-%d}) before it starts ({start:%Y-%m-%d})",
            "pass --days 1 or more",
        )
    return start, end


def _ski(public_key: ec.EllipticCurvePublicKey) -> x509.SubjectKeyIdentifier:
    return x509.SubjectKeyIdentifier.from_public_key(public_key)


def build_certificate(
    *,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    issuer_key: CertificateIssuerPrivateKeyTypes,
    issuer_public: ec.EllipticCurvePublicKey,
    window: tuple[datetime, datetime],
    is_ca: bool,
    usages: Sequence[x509.ObjectIdentifier] = (),
    sans: Sequence[x509.GeneralName] = (),
) -> x509.Certificate:
    """One certificate with the extensions a strict verifier (OpenSSL 3, Go) expects."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(window[0])
        .not_valid_after(window[1])
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            True,
        )
        .add_extension(_ski(public_key), False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_public), False)
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), False)
    return builder.sign(issuer_key, hashes.SHA256())


ROLE_NODE = "fleetd-node"
ROLE_CLIENT = "fleetd-client"


def _name(common_name: str, role: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fleetd")]
    if role is not None:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


@dataclass(frozen=True, slots=True)
class PeerRole:
    """What a presented certificate says about its holder."""

    name: str  # the subject's CN ("" without one)
    role: str | None  # ROLE_NODE, ROLE_CLIENT, or None for a certificate without one
    client_auth: bool  # its EKU names clientAuth


def peer_role(der: bytes) -> PeerRole:
    """The name, role and clientAuth usage of a DER certificate a peer presented."""
    cert = x509.load_der_x509_certificate(der)
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ous = [str(a.value) for a in
           cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    role = next((r for r in (ROLE_CLIENT, ROLE_NODE) if r in ous), None)
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        client_auth = ExtendedKeyUsageOID.CLIENT_AUTH in eku
    except x509.ExtensionNotFound:
        client_auth = False  # no EKU at all is not a client certificate "issued as such"
    return PeerRole(str(cns[0].value) if cns else "", role, client_auth)


def _issued(
    cert_path: Path, key_path: Path, cert: x509.Certificate, sans: Sequence[str] = ()
) -> Issued:
    return Issued(
        cert_path=cert_path,
        key_path=key_path,
        fingerprint=cert_fingerprint(cert),
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        sans=tuple(sans),
    )


# --- the CA and what it issues --------------------------------------------------------


def init_ca(
    directory: Path,
    *,
    name: str = "fleetd CA",
    days: int = CA_DAYS,
    force: bool = False,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
) -> Issued:
    """Create ``ca.pem``/``ca.key`` in ``directory``.

    Replacing a CA (``force``) invalidates every certificate the old one issued.
    """
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    _refuse_existing([cert_path, key_path], force)
    cert, key = _self_signed(name, validity(days, not_before, not_after), is_ca=True)
    write_pair(cert_path, key_path, cert, key, force=force)
    log.info("wrote CA %s (%s)", cert_path, cert_fingerprint(cert))
    return _issued(cert_path, key_path, cert)


def load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not cert_path.exists() or not key_path.exists():
        raise ConfigError(
            f"no fleet CA in '{directory}' ({CA_CERT} and {CA_KEY} are needed to issue)",
            f"create one first: fleetd certs --dir {directory} init-ca",
        )
    warn_if_readable_by_others(key_path, "CA key")
    cert = load_certificates(cert_path, "CA certificate")[0]
    key = load_private_key(key_path, "CA key")
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not key_matches(cert, key):
        raise ConfigError(
            f"CA key '{key_path}' does not belong to CA certificate '{cert_path}'",
            "restore the matching pair, or start over with init-ca --force "
            "(which invalidates every certificate issued so far)",
        )
    if cert.not_valid_after_utc <= datetime.now(UTC):
        raise ConfigError(
            f"CA certificate '{cert_path}' expired on {cert.not_valid_after_utc:%Y-%m-%d}",
            "make a new CA with init-ca --force and reissue every node and client certificate",
        )
    return cert, key


def _issue_leaf(
    directory: Path,
    name: str,
    *,
    role: str,
    usages: Sequence[x509.ObjectIdentifier],
    sans: Sequence[x509.GeneralName],
    days: int,
    force: bool,
    not_before: datetime | None,
    not_after: datetime | None,
) -> Issued:
    directory = Path(directory)
    validate_name(name)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    ca_cert, ca_key = load_ca(directory)
    _refuse_existing([cert_path, key_path], force)
    start, end = validity(days, not_before, not_after)
    if end > ca_cert.not_valid_after_utc:
        # A leaf that outlives its CA would be rejected after the CA expires anyway;
        # saying so now beats a surprise later.
        log.warning("%s: validity cut to the CA's end, %s", name, ca_cert.not_valid_after_utc)
        end = ca_cert.not_valid_after_utc
    key = generate_key()
    cert = build_certificate(
        subject=_name(name, role),
        public_key=key.public_key(),
        issuer=ca_cert.subject,
        issuer_key=ca_key,
        issuer_public=ca_key.public_key(),
        window=(start, end),
        is_ca=False,
        usages=usages,
        sans=sans,
    )
    write_pair(cert_path, key_path, cert, key, force=force)
    log.info("wrote %s (%s)", cert_path, cert_fingerprint(cert))
    return _issued(cert_path, key_path, cert, san_strings(cert))


def issue_node(
    directory: Path,
    name: str,
    sans: Sequence[str] = (),
    *,
    days: int = LEAF_DAYS,
    force: bool = False,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
) -> Issued:
    """A node (agent) certificate: serverAuth for its API, clientAuth for node-to-node
    calls, role ``fleetd-node`` (agents refuse it as a client unless told it relays)."""
    validate_name(name)
    return _issue_leaf(
        directory,
        name,
        role=ROLE_NODE,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=node_sans(name, sans),
        days=days,
        force=force,
        not_before=not_before,
        not_after=not_after,
    )


def issue_client(
    directory: Path,
    name: str,
    *,
    days: int = LEAF_DAYS,
    force: bool = False,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
) -> Issued:
    """A client certificate (clientAuth only, role ``fleetd-client``): what the fleet
    client presents to agents.

    The name is also a DNS SAN when it is a valid one: OpenSSL does not need it, but
    stricter verifiers (RFC 5280 profiles that ignore the CN) do.
    """
    validate_name(name)
    return _issue_leaf(
        directory,
        name,
        role=ROLE_CLIENT,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=[x509.DNSName(name.lower())] if is_dns_name(name) else [],
        days=days,
        force=force,
        not_before=not_before,
        not_after=not_after,
    )


def make_self_signed(
    sans: Sequence[x509.GeneralName], *, common_name: str, days: int
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed serverAuth leaf (no CA bit): trusted only by its pinned fingerprint."""
    return _self_signed(common_name, validity(days), is_ca=False,
                        usages=[ExtendedKeyUsageOID.SERVER_AUTH], sans=sans)


def _self_signed(
    common_name: str,
    window: tuple[datetime, datetime],
    *,
    is_ca: bool,
    usages: Sequence[x509.ObjectIdentifier] = (),
    sans: Sequence[x509.GeneralName] = (),
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate signed by its own new key: a CA root, or a pinned leaf."""
    key = generate_key()
    subject = _name(common_name)
    cert = build_certificate(subject=subject, public_key=key.public_key(), issuer=subject,
                             issuer_key=key, issuer_public=key.public_key(), window=window,
                             is_ca=is_ca, usages=usages, sans=sans)
    return cert, key


def write_pair(
    cert_path: Path,
    key_path: Path,
    cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    *,
    force: bool,
) -> None:
    """Write a key and its certificate, both 0600 and atomically (see :func:`write_private`)."""
    _ensure_dir(cert_path.parent)
    try:
        write_private(key_path, key_pem(key), force=force)
        write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM), force=force)
    except PermissionError as exc:
        raise ConfigError(
            f"cannot write '{exc.filename or cert_path.parent}': permission denied",
            "pass --dir with a directory you can write",
        ) from None
