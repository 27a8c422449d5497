"""fleetd.security.certs, the file/policy/token helpers of fleetd.security.tls, and
`fleetd certs`."""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import os
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID

from fleetd.cli import certs_cmd
from fleetd.errors import ConfigError, FleetdError, UsageError
from fleetd.security import certs, tls

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with node1 (SANs 127.0.0.1, gpu-01.example) and client alice. Read-only use."""
    d = tmp_path_factory.mktemp("pki")
    certs.init_ca(d)
    certs.issue_node(d, "node1", ["127.0.0.1", "gpu-01.example"])
    certs.issue_client(d, "alice")
    return d


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


# --- the CA and issued certificates ---------------------------------------------------


def test_ca_is_p256_sha256_ca_with_key_ids(pki: Path) -> None:
    ca = _cert(pki / "ca.pem")
    key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.curve.name == "secp256r1"
    assert isinstance(ca.signature_hash_algorithm, hashes.SHA256)
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    assert ca.subject == ca.issuer
    assert ca.not_valid_after_utc - ca.not_valid_before_utc >= timedelta(days=3650)


def test_node_cert_chains_to_ca_for_its_sans(pki: Path) -> None:
    ca, node = _cert(pki / "ca.pem"), _cert(pki / "node1.pem")
    store = verification.Store([ca])
    # Real path validation (cryptography's verifier, RFC 5280 + CA/B profile).
    for subject in (
        x509.DNSName("node1"),
        x509.DNSName("gpu-01.example"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ):
        verifier = verification.PolicyBuilder().store(store).build_server_verifier(subject)
        verifier.verify(node, [])
    eku = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not node.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    aki = node.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest


def test_node_sans_do_not_add_loopback_implicitly(pki: Path) -> None:
    sans = _sans(_cert(pki / "node1.pem"))
    assert sans.get_values_for_type(x509.DNSName) == ["node1", "gpu-01.example"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert "localhost" not in sans.get_values_for_type(x509.DNSName)


def test_node_named_by_ip_gets_ip_san_and_bad_dns_name_needs_san(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    issued = certs.issue_node(tmp_path, "10.1.2.3")
    assert issued.sans == ("10.1.2.3",)
    with pytest.raises(UsageError, match="no subject alternative name") as err:
        certs.issue_node(tmp_path, "gpu_01")  # '_' is not valid in a host name
    assert err.value.hint and "--san" in err.value.hint
    assert not (tmp_path / "gpu_01.pem").exists()
    assert certs.issue_node(tmp_path, "gpu_01", ["gpu01.lan"]).sans == ("gpu01.lan",)


def test_client_cert_is_client_auth_only(pki: Path) -> None:
    client = _cert(pki / "alice.pem")
    eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    verifier = (
        verification.PolicyBuilder()
        .store(verification.Store([_cert(pki / "ca.pem")]))
        .build_client_verifier()
    )
    verifier.verify(client, [])


def test_every_file_is_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        certs.init_ca(tmp_path)
        certs.issue_node(tmp_path, "n1", ["10.0.0.1"])
        certs.issue_client(tmp_path, "c1")
    finally:
        os.umask(old)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["c1.key", "c1.pem", "ca.key", "ca.pem", "n1.key", "n1.pem"]  # no temp files
    assert {_mode(tmp_path / f) for f in files} == {0o600}


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    first = certs.init_ca(tmp_path)
    before = (tmp_path / "ca.key").read_bytes()
    with pytest.raises(ConfigError) as err:
        certs.init_ca(tmp_path)
    assert "ca.pem" in err.value.message and err.value.hint and "--force" in err.value.hint
    assert (tmp_path / "ca.key").read_bytes() == before
    certs.issue_client(tmp_path, "bob")
    with pytest.raises(ConfigError, match="bob.pem"):
        certs.issue_client(tmp_path, "bob")
    # A stray key alone also blocks issuing, so a new cert never lands next to an old key.
    (tmp_path / "eve.key").write_bytes(b"old")
    with pytest.raises(ConfigError, match="eve.key"):
        certs.issue_client(tmp_path, "eve")
    assert not (tmp_path / "eve.pem").exists()

    second = certs.init_ca(tmp_path, force=True)
    assert second.fingerprint != first.fingerprint
    assert _mode(tmp_path / "ca.key") == 0o600


def test_issuing_needs_a_ca(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no fleet CA") as err:
        certs.issue_node(tmp_path, "node1", ["10.0.0.1"])
    assert err.value.hint and "init-ca" in err.value.hint
    assert list(tmp_path.iterdir()) == []


def test_ca_key_not_matching_ca_cert_is_refused(tmp_path: Path) -> None:
    certs.init_ca(tmp_path / "a")
    certs.init_ca(tmp_path / "b")
    (tmp_path / "a" / "ca.key").write_bytes((tmp_path / "b" / "ca.key").read_bytes())
    with pytest.raises(ConfigError, match="does not belong"):
        certs.issue_client(tmp_path / "a", "x")


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "-x", "ca", "CA", "x.pem", "a b"])
def test_bad_names_are_refused(tmp_path: Path, name: str) -> None:
    certs.init_ca(tmp_path)
    with pytest.raises(UsageError) as err:
        certs.issue_client(tmp_path, name)
    assert repr(name) in err.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.key", "ca.pem"]


@pytest.mark.parametrize(
    "san", ["*.example.com", "bad_host", "-x.example", "a..b", "1.2.3.256", "10.0.0.1/8"]
)
def test_bad_sans_are_refused(pki: Path, san: str) -> None:
    with pytest.raises(UsageError, match="bad --san"):
        certs.issue_node(pki, "never", [san])


def test_explicit_validity_makes_expired_certs(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    now = datetime.now(UTC)
    issued = certs.issue_client(
        tmp_path, "old", not_before=now - timedelta(days=30), not_after=now - timedelta(days=1)
    )
    assert issued.not_after < now
    with pytest.raises(UsageError, match="before it starts"):
        certs.issue_client(tmp_path, "neg", days=-1)


def test_leaf_validity_is_capped_at_the_ca(tmp_path: Path) -> None:
    certs.init_ca(tmp_path, days=10)
    issued = certs.issue_client(tmp_path, "c", days=825)
    assert issued.not_after == _cert(tmp_path / "ca.pem").not_valid_after_utc


def test_expired_ca_cannot_issue(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    certs.init_ca(tmp_path, not_before=now - timedelta(days=9), not_after=now - timedelta(days=1))
    with pytest.raises(ConfigError, match="expired"):
        certs.issue_client(tmp_path, "c")


# --- fingerprints ---------------------------------------------------------------------


def test_fingerprint_formats_agree(pki: Path) -> None:
    pem = (pki / "node1.pem").read_bytes()
    der = _cert(pki / "node1.pem").public_bytes(serialization.Encoding.DER)
    want = ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())
    assert tls.fingerprint(pem) == tls.fingerprint(pem.decode()) == tls.fingerprint(der) == want
    assert tls.fingerprint(_cert(pki / "node1.pem")) == want
    out = subprocess.run(
        ["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", str(pki / "node1.pem")],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode == 0:  # the openssl CLI is optional; the format must match it
        assert out.stdout.strip().split("=", 1)[1] == want


def test_normalize_fingerprint_and_pin_bytes() -> None:
    fp = ":".join(["AB"] * 32)
    assert tls.normalize_fingerprint(fp.lower()) == fp
    assert tls.normalize_fingerprint("AB" * 32) == fp
    assert tls.normalize_fingerprint(f"sha256:{'ab' * 32}") == fp
    assert tls.pin_bytes(fp) == b"\xab" * 32
    for bad in ("", "AB:CD", "ZZ" * 32, "AB" * 33):
        with pytest.raises(ConfigError, match="fingerprint"):
            tls.normalize_fingerprint(bad)


# --- server_context / client_context refuse bad files -------------------------------


def _server_error(cert: Path, key: Path, ca: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        tls.server_context(cert, key, ca)
    assert err.value.hint  # every refusal says how to fix it
    return err.value


def test_server_context_is_tls13_only_and_requires_client_certs(pki: Path) -> None:
    ctx = tls.server_context(pki / "node1.pem", pki / "node1.key", pki / "ca.pem")
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    plain = tls.server_context(pki / "node1.pem", pki / "node1.key", None)
    assert plain.verify_mode == ssl.CERT_NONE


def test_server_context_names_the_bad_file(pki: Path, tmp_path: Path) -> None:
    cert, key, ca = pki / "node1.pem", pki / "node1.key", pki / "ca.pem"
    missing = tmp_path / "nope.pem"
    assert str(missing) in _server_error(missing, key).message
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    assert "not a PEM certificate" in _server_error(garbage, key).message
    assert "not a readable PEM private key" in _server_error(cert, garbage).message
    assert str(garbage) in _server_error(cert, key, garbage).message
    swapped = _server_error(key, cert)
    assert "private key, not a certificate" in swapped.message and "swapped" in str(swapped.hint)
    assert "does not belong" in _server_error(cert, pki / "alice.key").message
    assert "directory" in _server_error(tmp_path, key).message
    encrypted = tmp_path / "enc.key"
    k = serialization.load_pem_private_key(key.read_bytes(), None)
    encrypted.write_bytes(
        k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    assert "passphrase" in _server_error(cert, encrypted).message
    assert ca.exists()


def test_server_context_refuses_an_expired_server_cert(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    now = datetime.now(UTC)
    certs.issue_node(
        tmp_path,
        "n1",
        ["127.0.0.1"],
        not_before=now - timedelta(days=10),
        not_after=now - timedelta(minutes=1),
    )
    err = _server_error(tmp_path / "n1.pem", tmp_path / "n1.key", tmp_path / "ca.pem")
    assert "expired" in err.message and "refusing to start" in err.message
    assert "issue-node" in str(err.hint)


def test_client_context_rules(pki: Path, tmp_path: Path) -> None:
    ctx = tls.client_context(pki / "ca.pem", pki / "alice.pem", pki / "alice.key")
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    with pytest.raises(ConfigError, match="neither a CA nor a pinned"):
        tls.client_context(None, None, None)
    with pytest.raises(ConfigError, match="needs its key"):
        tls.client_context(pki / "ca.pem", pki / "alice.pem", None)
    pinned = tls.client_context(None, None, None, pinned_sha256="ab" * 32)
    assert isinstance(pinned, tls.PinnedContext)
    assert pinned.pinned_sha256 == ":".join(["AB"] * 32)
    # An expired client certificate is caught before it is ever presented.
    certs.init_ca(tmp_path)
    now = datetime.now(UTC)
    certs.issue_client(
        tmp_path, "old", not_before=now - timedelta(days=9), not_after=now - timedelta(days=1)
    )
    with pytest.raises(ConfigError, match="expired"):
        tls.client_context(tmp_path / "ca.pem", tmp_path / "old.pem", tmp_path / "old.key")


# --- self-signed loopback certificate -------------------------------------------------


def test_self_signed_is_loopback_p256_0600_and_reused(tmp_path: Path) -> None:
    cert_path, key_path, fp = tls.self_signed(tmp_path / "state")
    cert = _cert(cert_path)
    assert fp == tls.fingerprint(cert_path.read_bytes())
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    sans = _sans(cert)
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(sans.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    assert _mode(cert_path) == _mode(key_path) == 0o600
    assert tls.self_signed(tmp_path / "state") == (cert_path, key_path, fp)  # same pin
    # A broken pair is replaced rather than served.
    key_path.write_text("garbage")
    _, _, fp2 = tls.self_signed(tmp_path / "state")
    assert fp2 != fp
    assert tls.server_context(cert_path, key_path, None).minimum_version == ssl.TLSVersion.TLSv1_3


def test_self_signed_refuses_non_loopback(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "10.0.0.1", "gpu-01.example"):
        with pytest.raises(ConfigError, match="only for loopback"):
            tls.self_signed(tmp_path, host)
    assert list(tmp_path.iterdir()) == []


# --- listening policy -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.1", False),
        ("128.0.0.1", False),
        ("localhost.evil.com", False),
        ("gpu-01", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert tls.is_loopback(host) is expected


# (host, have_cert, have_client_ca, plain_http) -> error fragment, or None if allowed
POLICY = [
    ("127.0.0.1", False, False, False, None),  # loopback: self-signed
    ("127.0.0.1", True, False, False, None),
    ("127.0.0.1", True, True, False, None),
    ("localhost", False, False, True, None),  # explicit plain HTTP on loopback
    ("::1", False, False, True, None),
    ("0.0.0.0", True, True, False, None),  # beyond loopback with mTLS
    ("10.0.0.1", True, True, False, None),
    ("0.0.0.0", True, False, False, "requires client certificates"),
    ("10.0.0.1", False, False, False, "needs a server certificate"),
    ("10.0.0.1", False, True, False, "no server certificate"),
    ("127.0.0.1", False, True, False, "no server certificate"),
    ("0.0.0.0", False, False, True, "only allowed on loopback"),
    ("10.0.0.1", True, True, True, "only allowed on loopback"),
    ("127.0.0.1", True, False, True, "together with TLS"),
]


@pytest.mark.parametrize(("host", "cert", "ca", "plain", "error"), POLICY)
def test_check_listen_policy(
    host: str, cert: bool, ca: bool, plain: bool, error: str | None
) -> None:
    if error is None:
        tls.check_listen_policy(host, have_cert=cert, have_client_ca=ca, plain_http=plain)
        return
    with pytest.raises(ConfigError, match=error) as err:
        tls.check_listen_policy(host, have_cert=cert, have_client_ca=ca, plain_http=plain)
    assert err.value.hint


# --- tokens ---------------------------------------------------------------------------


def test_token_ok() -> None:
    assert tls.token_ok("s3cret-token", "s3cret-token")
    assert not tls.token_ok("s3cret-tokeN", "s3cret-token")
    assert not tls.token_ok(None, "s3cret-token")
    assert not tls.token_ok("", "")  # an unset token must never accept anything
    assert not tls.token_ok("x", "")
    assert tls.token_ok("jeton-été", "jeton-été")  # non-ASCII does not raise


def test_load_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  abcdefghijklmnopqrstuvwxyz012345\n")
    path.chmod(0o600)
    assert tls.load_token(path) == "abcdefghijklmnopqrstuvwxyz012345"
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="every user") as err:
        tls.load_token(path)
    assert err.value.hint == f"chmod 600 {path}"
    path.chmod(0o600)
    path.write_text(" \n")
    with pytest.raises(ConfigError, match="empty"):
        tls.load_token(path)
    path.write_text("two words\n")
    with pytest.raises(ConfigError, match="more than one word"):
        tls.load_token(path)
    with pytest.raises(ConfigError, match="does not exist"):
        tls.load_token(tmp_path / "missing")


# --- the CLI --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetd")
    certs_cmd.register(parser.add_subparsers(dest="command"))
    return parser


def _cli(*argv: str) -> int:
    args = _parser().parse_args(list(argv))
    return int(args.func(args))


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def test_cli_flow(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("certs", "init-ca") == 0  # default DIR is certs/
    out = capsys.readouterr().out
    fp = tls.fingerprint((in_tmp / "certs" / "ca.pem").read_bytes())
    assert "wrote certs/ca.pem" in out and "wrote certs/ca.key" in out and fp in out

    assert _cli("certs", "issue-node", "gpu-01", "--san", "10.0.0.5", "--days", "30") == 0
    out = capsys.readouterr().out
    assert "SANs     gpu-01, 10.0.0.5" in out
    assert "--client-ca certs/ca.pem" in out

    assert _cli("certs", "--dir", "certs", "issue-client", "alice") == 0
    capsys.readouterr()

    assert _cli("certs", "show", "gpu-01") == 0
    out = capsys.readouterr().out
    assert "CN=gpu-01" in out and "10.0.0.5" in out and "serverAuth, clientAuth" in out
    assert tls.fingerprint((in_tmp / "certs" / "gpu-01.pem").read_bytes()) in out
    assert "WARNING  expires in" in out  # 30 days is within the warning window

    assert _cli("certs", "show") == 0
    out = capsys.readouterr().out
    assert out.index("certs/ca.pem") < out.index("certs/alice.pem") < out.index("certs/gpu-01.pem")
    assert {_mode(p) for p in (in_tmp / "certs").iterdir()} == {0o600}


def test_cli_show_flags_expired(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    certs.init_ca(in_tmp / "certs")
    now = datetime.now(UTC)
    certs.issue_client(
        in_tmp / "certs", "old", not_before=now - timedelta(days=9), not_after=now - timedelta(1)
    )
    assert _cli("certs", "show", "certs/old.pem") == 1
    assert "EXPIRED" in capsys.readouterr().out


def test_cli_errors(in_tmp: Path) -> None:
    with pytest.raises(ConfigError, match="no fleet CA"):
        _cli("certs", "issue-client", "bob")
    _cli("certs", "init-ca")
    with pytest.raises(UsageError, match="bad --days 0"):
        _cli("certs", "issue-client", "bob", "--days", "0")
    with pytest.raises(FleetdError, match="already exists"):
        _cli("certs", "init-ca")
    assert _cli("certs", "init-ca", "--force") == 0


def test_cli_through_fleetd_main(in_tmp: Path) -> None:
    """The real `fleetd` entry point prints errors with hints and exits 2."""
    code = (
        "import sys; import fleetd.cli.main as m; "
        "m.COMMAND_MODULES = ('fleetd.cli.certs_cmd',); sys.exit(m.main(sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )

    ok = run("certs", "--dir", "pki", "init-ca")
    assert ok.returncode == 0, ok.stderr
    assert "wrote pki/ca.key" in ok.stdout
    again = run("certs", "--dir", "pki", "init-ca")
    assert again.returncode == 2
    assert "fleetd: error: 'pki/ca.pem' already exists" in again.stderr
    assert "hint: pass --force" in again.stderr
    bad = run("certs", "--dir", "pki", "issue-node", "../etc/passwd")
    assert bad.returncode == 2 and "bad certificate name '../etc/passwd'" in bad.stderr
