"""``fleetd certs``: make the fleet CA, node and client certificates, and inspect them.

The work is in :mod:`fleetd.security.certs`; this module parses arguments and prints what
was written, with fingerprints, so that an operator can compare them with what a node
or a client reports.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509

from fleetd.errors import UsageError
from fleetd.security import certs

DEFAULT_DIR = Path("certs")
EXPIRY_WARNING = timedelta(days=30)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "certs",
        help="make and inspect the fleet's TLS certificates",
        description="Make the fleet CA and the node and client certificates for mTLS "
        "(ECDSA P-256, files 0600), or show what a certificate holds. Agents need ca.pem "
        "and their NAME.pem/NAME.key; fleet clients need ca.pem and a client NAME.pem/.key.",
    )
    p.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help="certificate directory (default: certs/)"
    )
    p.set_defaults(func=_missing_action, certs_parser=p)
    actions = p.add_subparsers(dest="certs_action", metavar="ACTION")

    # --dir is also accepted after the action; SUPPRESS keeps it from overriding the
    # value given before the action when it is absent here.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--force", action="store_true", help="overwrite existing files")

    ca = _issuer(actions, common, "init-ca", "create ca.pem and ca.key",
                 "Create the fleet CA. Keep ca.key on the machine that issues "
                 "certificates; copy only ca.pem to nodes and clients.")
    ca.add_argument("--name", default="fleetd CA", help="the CA's common name")
    _validity(ca, certs.CA_DAYS, _init_ca)

    node = _issuer(actions, common, "issue-node", "issue NAME.pem/NAME.key for an agent",
                   "Issue a node certificate (serverAuth and clientAuth). NAME is a SAN "
                   "when it is a host name or address; add every name and address clients "
                   "use with --san (127.0.0.1/localhost are not added unless asked for).")
    node.add_argument("name", metavar="NAME", help="node name, e.g. its host name")
    node.add_argument("--san", action="append", default=[], metavar="HOST_OR_IP",
                      help="extra DNS name or IP address (repeatable)")
    _validity(node, certs.LEAF_DAYS, _issue_node)

    client = _issuer(actions, common, "issue-client",
                     "issue NAME.pem/NAME.key for a fleet client",
                     "Issue a client certificate (clientAuth) for the fleet commands "
                     "(`fleetd query --nodes`, `fleetd explain --nodes`, `fleetd watch`...).")
    client.add_argument("name", metavar="NAME", help="client name, e.g. a user or service")
    _validity(client, certs.LEAF_DAYS, _issue_client)

    show = actions.add_parser(
        "show",
        help="print subject, SANs, validity and fingerprint",
        description="Show certificates: FILE, or NAME (DIR/NAME.pem), or every .pem in DIR. "
        "Exits 1 if one of them has expired.",
    )
    show.add_argument("--dir", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    show.add_argument("file", nargs="?", metavar="FILE", help="a .pem file or a NAME in DIR")
    show.set_defaults(func=_show)


def _issuer(actions: argparse._SubParsersAction[argparse.ArgumentParser],
            common: argparse.ArgumentParser, name: str, summary: str, description: str
            ) -> argparse.ArgumentParser:
    return actions.add_parser(name, parents=[common], help=summary, description=description)


def _validity(p: argparse.ArgumentParser, days: int, func: Callable[[argparse.Namespace], int]
              ) -> None:
    """--days (default ``days``) and the action's function, last on the action."""
    p.add_argument("--days", type=int, default=days, help=f"validity (default {days})")
    p.set_defaults(func=func)


def _missing_action(args: argparse.Namespace) -> int:
    args.certs_parser.print_help(sys.stderr)
    return 2


def _days(args: argparse.Namespace) -> int:
    if args.days < 1:
        raise UsageError(f"bad --days {args.days}: must be 1 or more", "e.g. --days 365")
    return int(args.days)


def _print_issued(issued: certs.Issued, what: str) -> None:
    print(f"wrote {issued.cert_path}  ({what} certificate, mode 0600)")
    print(f"wrote {issued.key_path}  ({what} private key, mode 0600)")
    if issued.sans:
        print(f"  SANs     {', '.join(issued.sans)}")
    print(f"  valid    {issued.not_before:%Y-%m-%d} .. {issued.not_after:%Y-%m-%d} (UTC)")
    print(f"  sha256   {issued.fingerprint}")


def _init_ca(args: argparse.Namespace) -> int:
    issued = certs.init_ca(args.dir, name=args.name, days=_days(args), force=args.force)
    _print_issued(issued, "CA")
    d = shlex.quote(str(args.dir))
    print(f"keep {issued.key_path} off the nodes; copy only {issued.cert_path}")
    print(f"next: fleetd certs --dir {d} issue-node NAME --san HOST_OR_IP")
    return 0


def _issue_node(args: argparse.Namespace) -> int:
    issued = certs.issue_node(args.dir, args.name, args.san, days=_days(args), force=args.force)
    _print_issued(issued, "node")
    print(
        f"agent: --tls-cert {issued.cert_path} --tls-key {issued.key_path} "
        f"--client-ca {args.dir / certs.CA_CERT}"
    )
    return 0


def _issue_client(args: argparse.Namespace) -> int:
    issued = certs.issue_client(args.dir, args.name, days=_days(args), force=args.force)
    _print_issued(issued, "client")
    return 0


def _show_targets(directory: Path, file: str | None) -> list[Path]:
    if file is None:
        found = sorted(directory.glob("*.pem"), key=lambda p: (p.name != certs.CA_CERT, p.name))
        if not found:
            raise UsageError(
                f"no .pem files in '{directory}'",
                "pass --dir with your certificate directory, or a FILE",
            )
        return found
    path = Path(file)
    for candidate in (directory / file, directory / f"{file}.pem"):
        if not path.exists() and candidate.exists():
            path = candidate  # `show node1` means DIR/node1.pem, `show ca.key` DIR/ca.key
    _refuse_key(path)
    return [path]


def _refuse_key(path: Path) -> None:
    """`certs show` prints certificates; a key file gets a hint about its certificate
    rather than the certificate-and-key-swapped hint of the options that take both."""
    try:
        head = path.read_bytes()[:1 << 16]
    except OSError:
        return  # the loader reports a missing or unreadable file in its own words
    if b"PRIVATE KEY" in head and b"CERTIFICATE" not in head:
        pem = path.with_suffix(".pem")
        raise UsageError(f"'{path}' is a private key; certs show prints certificates",
                         f"show its certificate instead: fleetd certs show {pem}")


def _usages(cert: x509.Certificate) -> str:
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return "-"
    return ", ".join(getattr(oid, "_name", oid.dotted_string) for oid in eku)


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _show_one(path: Path, now: datetime) -> bool:
    """Print one file's certificates; False if one has expired."""
    ok = True
    for cert in certs.load_certificates(path):
        print(f"{path}")
        print(f"  subject  {cert.subject.rfc4514_string()}")
        print(f"  issuer   {cert.issuer.rfc4514_string()}")
        print(f"  kind     {'CA' if _is_ca(cert) else 'leaf'}; usages: {_usages(cert)}")
        print(f"  SANs     {', '.join(certs.san_strings(cert)) or '-'}")
        before, after = cert.not_valid_before_utc, cert.not_valid_after_utc
        print(f"  valid    {before:%Y-%m-%d %H:%M} .. {after:%Y-%m-%d %H:%M} (UTC)")
        print(f"  sha256   {certs.cert_fingerprint(cert)}")
        left = after - now
        if left <= timedelta(0):
            print(f"  EXPIRED  on {after:%Y-%m-%d}: reissue it with --force")
            ok = False
        elif left <= EXPIRY_WARNING:
            print(f"  WARNING  expires in {left.days} days ({after:%Y-%m-%d}): reissue it soon")
        if before > now:
            print(f"  WARNING  not valid before {before:%Y-%m-%d %H:%M} UTC")
    return ok


def _show(args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    results = [_show_one(p, now) for p in _show_targets(args.dir, args.file)]
    return 0 if all(results) else 1
