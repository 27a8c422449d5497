"""``fleetd check --only certs``: the certificates an agent serves with and a client presents.

Validity, chains, key usage, SANs and the listen policy, read from the files without
a handshake. A finding is a value (a :class:`~fleetd.checks.Check`), never an exception.
"""

from __future__ import annotations

import contextlib
import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from fleetd.checks import FAIL, OK, SKIP, WARN, Check, Finding, Stop, example_file, row, stopped
from fleetd.config import parse_hostport
from fleetd.errors import ConfigError
from fleetd.security import certs, tls

DEFAULT_EXPIRY_WARNING = timedelta(days=14)
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


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
    except Stop as stop:
        return stopped(leaf.name, "certs", subject, stop.finding, {"path": subject})
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
        raise Stop(Finding(FAIL, f"a {given} without its {missing}",
                            "give both files of the pair (NAME.pem and NAME.key)"))
    try:
        cert = certs.load_certificates(leaf.cert, "certificate")[0]
        key = certs.load_private_key(leaf.key, "key")
    except ConfigError as exc:
        raise Stop(Finding(FAIL, exc.message, exc.hint or "")) from None
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
