"""``fleetd check`` for what an agent needs besides BPF: its database and certificates.

Neither needs root or BPF, so they run anywhere and fast. A finding is a value (a
:class:`~fleetd.checks.Check`), never an exception: the point of a check is to report
every problem at once, each with its fix.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from fleetd.checks import FAIL, OK, SKIP, WARN, Check, Finding, example_file, row
from fleetd.errors import ConfigError, StoreError
from fleetd.node import certs, tls
from fleetd.node.config import parse_hostport
from fleetd.store.db import check_identity
from fleetd.store.schema import SCHEMA_VERSION

DISK_FAIL_BYTES = 100 * 2**20  # below this the writer fails within minutes of tracing
DISK_WARN_BYTES = 2**30
DEFAULT_EXPIRY_WARNING = timedelta(days=14)
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


class _Stop(Exception):
    """A finding that ends a check: nothing after it can be looked at."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.text)
        self.finding = finding


def _stopped(name: str, group: str, subject: str, finding: Finding,
             data: dict[str, Any]) -> Check:
    # Messages from fleetd's file readers already name the file; say it once.
    text = finding.text if subject in finding.text else f"{subject}: {finding.text}"
    return Check(name, finding.status, text, finding.fix, group=group, data=data)


# ---- the database ---------------------------------------------------------------------


def db_check(path: Path, max_bytes: int | None = None) -> Check:
    """Can an agent create or open ``path`` and keep writing to it?"""
    data: dict[str, Any] = {"path": str(path)}
    try:
        directory = _db_directory(path)
        if path.exists():
            findings = _db_file(path, data)
        else:
            also = f" and {path.parent}" if directory != path.parent else ""
            findings = [Finding(OK, f"does not exist yet; the agent creates it{also}")]
        findings.append(_disk_space(directory, path, max_bytes, data))
    except _Stop as stop:
        return _stopped("db", "db", str(path), stop.finding, data)
    summary = "; ".join(f.text for f in findings)
    return row("db", "db", str(path), findings, summary, data)


def _db_directory(path: Path) -> Path:
    """The nearest existing directory on the way to ``path``, proven writable by
    writing into it (as root, permission bits say nothing: a read-only mount does)."""
    if path.is_dir():
        raise _Stop(Finding(FAIL, "is a directory, not a database file",
                            f"pass --db {path / 'fleetd.db'} (a file path)"))
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise _Stop(Finding(FAIL, f"cannot create its directory: {existing} is a file, "
                            "not a directory",
                            "pass --db (or store.db) with a path in a writable directory"))
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".fleetd-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise _Stop(Finding(FAIL, f"directory {existing} is not writable ({exc.strerror})",
                            "pass --db with a path in a directory this user can write (the "
                            "agent also writes the -wal and -shm files next to it)")) from None
    return existing


def _db_file(path: Path, data: dict[str, Any]) -> list[Finding]:
    try:
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise _Stop(Finding(FAIL, f"cannot open: {exc}", "check the file's permissions")
                    ) from None
    try:
        version = check_identity(conn, path)
    except StoreError as exc:
        raise _Stop(Finding(FAIL, exc.message, exc.hint or "")) from None
    finally:
        conn.close()
    data["schema_version"] = version
    size = path.stat().st_size
    out = [_schema_finding(version, size)]
    if not os.access(path, os.W_OK):
        out.append(Finding(FAIL, "the file is read-only for this user",
                           f"chmod u+w {path}, or run the agent as its owner"))
    return out


def _schema_finding(version: int, size: int) -> Finding:
    if version == 0:
        return Finding(OK, "an empty SQLite file; the agent initialises it")
    if version < SCHEMA_VERSION:
        return Finding(OK, f"fleetd database, schema v{version} ({_size(size)}); the agent "
                       f"migrates it to v{SCHEMA_VERSION}")
    return Finding(OK, f"fleetd database, schema v{version} ({_size(size)})")


def _disk_space(directory: Path, path: Path, max_bytes: int | None,
                data: dict[str, Any]) -> Finding:
    free = shutil.disk_usage(directory).free
    data["free_bytes"] = free
    where = f"{_size(free)} free on {directory.absolute()}'s file system"
    fix = "free space there, or pass --db (store.db) on a larger file system"
    if free < DISK_FAIL_BYTES:
        return Finding(FAIL, f"only {where}", fix)
    used = path.stat().st_size if path.exists() else 0
    if max_bytes is not None and free + used < max_bytes:
        return Finding(WARN, f"store.max_bytes is {_size(max_bytes)} but only {where}",
                       "lower store.max_bytes (--max-db-bytes) below the free space, or " + fix)
    if free < DISK_WARN_BYTES:
        return Finding(WARN, f"only {where}", fix)
    return Finding(OK, where)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


# ---- certificates ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """What the agent would serve with and what the fleet client would present: the
    flags, else the config's ``tls:`` and ``fleet:`` sections."""

    listen: str = "127.0.0.1:7600"
    node_cert: Path | None = None
    node_key: Path | None = None
    client_ca: Path | None = None
    plain_http: bool = False
    fleet_ca: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None


def cert_checks(files: TlsFiles, warn_within: timedelta = DEFAULT_EXPIRY_WARNING,
                now: datetime | None = None) -> list[Check]:
    """The listening policy, each CA file, the node's and the client's certificate."""
    when = now or datetime.now(UTC)
    out = [_listen_policy(files)]
    cas = [("cert client-ca", files.client_ca)]
    if files.fleet_ca is not None and files.fleet_ca != files.client_ca:
        cas.append(("cert fleet-ca", files.fleet_ca))
    out += [_ca_check(name, path, warn_within, when) for name, path in cas if path]
    host = _listen_host(files.listen)
    if files.node_cert or files.node_key:
        out.append(_leaf_check(_Leaf("cert node", files.node_cert, files.node_key,
                                     files.client_ca, ExtendedKeyUsageOID.SERVER_AUTH, host),
                               warn_within, when))
    if files.client_cert or files.client_key:
        out.append(_leaf_check(_Leaf("cert client", files.client_cert, files.client_key,
                                     files.fleet_ca, ExtendedKeyUsageOID.CLIENT_AUTH, None),
                               warn_within, when))
    if len(out) == 1:
        out.append(Check("certs", SKIP, "no certificate or CA file given", _no_certs_fix(),
                         group="certs"))
    return out


def _no_certs_fix() -> str:
    return ("pass --config fleetd.yaml (tls: and fleet: sections; example: "
            f"{example_file('fleetd.yaml')}), or --tls-cert/--tls-key/--client-ca for the "
            "agent and --ca-cert/--client-cert/--client-key for the fleet client")


def _listen_host(listen: str) -> str | None:
    try:
        return parse_hostport(listen, "listen address")[0]
    except ConfigError:
        return None


def _listen_policy(files: TlsFiles) -> Check:
    """Would ``fleetd agent`` agree to listen with these files? (its own rule)"""
    host = _listen_host(files.listen)
    if host is None:
        return Check("tls-listen", FAIL, f"invalid listen address {files.listen!r}",
                     "use HOST:PORT, e.g. 10.0.0.11:7600 or 127.0.0.1:7600", group="certs")
    try:
        tls.check_listen_policy(host, have_cert=files.node_cert is not None,
                                have_client_ca=files.client_ca is not None,
                                plain_http=files.plain_http)
    except ConfigError as exc:
        return Check("tls-listen", FAIL, f"{files.listen}: {exc.message}", exc.hint or "",
                     group="certs")
    if files.plain_http:
        how = "plain HTTP (loopback only, explicitly asked for)"
    elif files.node_cert is None:
        how = "TLS 1.3 with a self-signed certificate (loopback; clients pin its fingerprint)"
    elif files.client_ca is None:
        how = "TLS 1.3, no client certificates required (loopback)"
    else:
        how = "TLS 1.3 with mTLS (clients need a certificate from the client CA)"
    return Check("tls-listen", OK, f"{files.listen}: {how}", group="certs")


def _validity(cert: x509.Certificate, warn_within: timedelta, now: datetime,
              fix: str) -> Finding:
    after, before = cert.not_valid_after_utc, cert.not_valid_before_utc
    if after <= now:
        return Finding(FAIL, f"expired on {after:%Y-%m-%d %H:%M} UTC", fix)
    if before > now:
        return Finding(WARN, f"not valid before {before:%Y-%m-%d %H:%M} UTC",
                       "check this machine's clock (peers refuse it until then)")
    left = after - now
    if left <= warn_within:
        return Finding(WARN, f"expires in {_left(left)} ({after:%Y-%m-%d %H:%M} UTC)",
                       f"before then, {fix}")
    return Finding(OK, f"valid until {after:%Y-%m-%d} ({left.days} days)")


def _left(delta: timedelta) -> str:
    if delta >= timedelta(days=2):
        return f"{delta.days} days"
    return f"{delta.total_seconds() / 3600:.0f} hours"


def _ca_check(name: str, path: Path, warn_within: timedelta, now: datetime) -> Check:
    try:
        cas = certs.load_certificates(path, "CA file", "point it at the fleet's ca.pem "
                                      "(fleetd certs init-ca)")
    except ConfigError as exc:
        return Check(name, FAIL, exc.message, exc.hint or "", group="certs")
    fix = "make a new CA (fleetd certs init-ca --force) and reissue every certificate"
    # A bundle during CA rotation holds the old CA too: only all of them expired is fatal.
    others_valid = sum(c.not_valid_after_utc > now for c in cas) > 0
    findings = [f for cert in cas
                for f in _one_ca(cert, warn_within, now, fix, others_valid)]
    ok = [f.text for f in findings if f.status == OK]
    subjects = ", ".join(c.subject.rfc4514_string() for c in cas)
    data = {"path": str(path), "not_after": [c.not_valid_after_utc.isoformat() for c in cas]}
    return row(name, "certs", str(path), findings, f"CA {subjects}, {'; '.join(ok)}", data)


def _one_ca(cert: x509.Certificate, warn_within: timedelta, now: datetime,
            fix: str, others_valid: bool) -> list[Finding]:
    validity = _validity(cert, warn_within, now, fix)
    if validity.status == FAIL and others_valid:
        validity = Finding(WARN, f"{validity.text} (one CA of the bundle)",
                           "drop it from the bundle once nothing it issued is in use")
    out = [validity]
    if not _basic_ca(cert):
        out.append(Finding(FAIL, f"{cert.subject.rfc4514_string()} is not a CA certificate "
                           "(no basicConstraints CA:TRUE)",
                           "point it at the fleet's ca.pem, not at a node or client certificate"))
    return out


def _basic_ca(cert: x509.Certificate) -> bool:
    with contextlib.suppress(x509.ExtensionNotFound):
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    return False


@dataclass(frozen=True, slots=True)
class _Leaf:
    name: str
    cert: Path | None
    key: Path | None
    ca: Path | None
    usage: x509.ObjectIdentifier
    host: str | None  # the address clients connect to, when known

    @property
    def server(self) -> bool:
        return self.usage == ExtendedKeyUsageOID.SERVER_AUTH

    @property
    def command(self) -> str:
        if self.server:
            return "fleetd certs issue-node NAME --san HOST --force"
        return "fleetd certs issue-client NAME --force"

    @property
    def reissue(self) -> str:
        return f"reissue it: {self.command}"

    @property
    def ca_option(self) -> str:
        return "--client-ca (tls.client_ca)" if self.server else "--ca-cert (fleet.ca)"


def _leaf_check(leaf: _Leaf, warn_within: timedelta, now: datetime) -> Check:
    subject = str(leaf.cert or leaf.key)
    try:
        cert, key = _leaf_pair(leaf)
    except _Stop as stop:
        return _stopped(leaf.name, "certs", subject, stop.finding, {"path": subject})
    findings = [key, _validity(cert, warn_within, now, leaf.reissue), _chain(cert, leaf),
                _usage(cert, leaf)]
    if leaf.host is not None:
        findings.append(_san(cert, leaf.host))
    sans = ", ".join(certs.san_strings(cert)) or "none"
    left = (cert.not_valid_after_utc - now).total_seconds() / 86400
    data = {"path": subject, "not_after": cert.not_valid_after_utc.isoformat(),
            "days_left": round(left, 2), "sans": list(certs.san_strings(cert))}
    summary = (f"{cert.subject.rfc4514_string()}, SANs {sans}, "
               + ", ".join(f.text for f in findings))
    return row(leaf.name, "certs", subject, findings, summary, data)


def _leaf_pair(leaf: _Leaf) -> tuple[x509.Certificate, Finding]:
    """Both files readable (else stop), and whether they belong together."""
    if leaf.cert is None or leaf.key is None:
        given, missing = ("certificate", "key") if leaf.key is None else ("key", "certificate")
        raise _Stop(Finding(FAIL, f"a {given} without its {missing}",
                            "give both files of the pair (NAME.pem and NAME.key)"))
    try:
        cert = certs.load_certificates(leaf.cert, "certificate")[0]
        key = certs.load_private_key(leaf.key, "key")
    except ConfigError as exc:
        raise _Stop(Finding(FAIL, exc.message, exc.hint or "")) from None
    if not certs.key_matches(cert, key):
        return cert, Finding(FAIL, f"key {leaf.key} does not belong to this certificate",
                             "use the .key file issued together with it, or reissue both: "
                             + leaf.command)
    return cert, Finding(OK, "key matches")


def _chain(cert: x509.Certificate, leaf: _Leaf) -> Finding:
    if leaf.ca is None:
        return Finding(OK, "chain not checked (no CA given)")
    try:
        cas = certs.load_certificates(leaf.ca, "CA file")
    except ConfigError:
        return Finding(FAIL, f"chain not checked: CA file {leaf.ca} is unusable",
                       "see the CA's own check")
    if any(_issued_by(cert, ca) for ca in cas):
        return Finding(OK, f"issued by the CA in {leaf.ca.name}")
    return Finding(FAIL, f"not issued by the CA in {leaf.ca} (its issuer is "
                   f"{cert.issuer.rfc4514_string()})",
                   f"point {leaf.ca_option} at the CA that issued it, or reissue it from "
                   f"the fleet CA: {leaf.command}")


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _usage(cert: x509.Certificate, leaf: _Leaf) -> Finding:
    try:
        ekus = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return Finding(OK, "any usage")
    name = "serverAuth" if leaf.server else "clientAuth"
    if leaf.usage in ekus:
        return Finding(OK, name)
    kind = "node" if leaf.server else "client"
    return Finding(FAIL, f"not for {name} (its extended key usage)",
                   f"use a {kind} certificate here, or issue one: {leaf.command}")


def _san(cert: x509.Certificate, host: str) -> Finding:
    """Does the certificate name the address the agent listens on? Clients that connect
    by another name may still match, so a miss is a warning."""
    if host in _WILDCARD_HOSTS:
        return Finding(OK, "listening on every address: make sure the SANs cover the ones "
                       "clients use")
    names = certs.san_strings(cert)
    if _san_matches(host, names):
        return Finding(OK, f"names the listen host {host}")
    return Finding(WARN, f"does not name the listen host {host} (SANs: "
                   f"{', '.join(names) or 'none'}); clients connecting to {host} will refuse it",
                   f"fleetd certs issue-node NAME --san {host} --force, or have clients use a "
                   "name in the SANs")


def _san_matches(host: str, names: tuple[str, ...]) -> bool:
    try:
        wanted = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower().rstrip(".") in {n.lower() for n in names}
    for n in names:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(n) == wanted:
                return True
    return False
