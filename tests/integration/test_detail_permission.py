"""Issue 40, point 7, without tracing: who may ask for launch detail, decided on the
real certificate of a real TLS client by a real `fleetd agent` (`--no-trace`, so no
window opens and no budget is spent), and `fleetd watch`'s side of a refusal. The
windows themselves and the budget are in test_detail_window.py (real BPF)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from agents import Agent, Pki, agent, client_ssl, issue_odd, request
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleetd.fleet.client import ClientOptions, FleetClient
from fleetd.fleet.fanout import FleetAnswer, NodeOutcome
from fleetd.fleet.hang import DetailAsks
from fleetd.fleet.targets import parse_nodes
from fleetd.security import certs, tls

from conftest import build_db

CONFIG = "detail:\n  clients: [laptop]\n  client_ous: [gpu-ops]\n"


@pytest.fixture(scope="module")
def pki(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The fleet's, plus client "oncall" whose subject also carries OU gpu-ops."""
    ours = pki.copy_to(tmp_path_factory.mktemp("detail-pki") / "certs")
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fleetd"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME,
                                            certs.ROLE_CLIENT),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "gpu-ops"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "oncall")])
    issue_odd(ours, "oncall", subject, [ExtendedKeyUsageOID.CLIENT_AUTH])
    return ours


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Agent]:
    d = tmp_path_factory.mktemp("detail")
    (d / "fleetd.yaml").write_text(CONFIG)
    with agent(build_db(d / "gpu-01.db", "gpu-01", 10), "gpu-01", pki, "--no-trace",
               "--config", str(d / "fleetd.yaml")) as a:
        yield a


def _ask(node: Agent, pki: Pki, client: str) -> tuple[int, dict[str, object]]:
    status, body, _ = request(node.url, client_ssl(pki, client), "POST",
                              "/api/v1/detail?seconds=10")
    return status, body


@pytest.mark.parametrize("client", ["laptop", "oncall"])
def test_a_named_client_or_one_with_a_granted_ou_may_ask(node: Agent, pki: Pki,
                                                         client: str) -> None:
    status, body = _ask(node, pki, client)
    assert status == 200, body
    # Permitted; no tracer here, so no window and nothing charged.
    assert body["opened"] is False and "does not trace" in str(body["why"]), body
    assert body["budget"] == {"per_hour_s": 360.0, "used_s": 0, "remaining_s": 360.0}, body


def test_any_other_client_gets_a_403_that_says_how_to_grant_it(node: Agent,
                                                               pki: Pki) -> None:
    status, body = _ask(node, pki, "desk")
    assert status == 403, body
    err = body["error"]
    assert isinstance(err, dict) and err["code"] == "forbidden", body
    assert err["message"] == ("refused: cert:desk may not open launch-detail windows on "
                              "this node (not in its detail.clients or detail.client_ous)")
    assert "detail.clients" in err["hint"]
    assert "launch detail refused to cert:desk (10 s asked): not permitted" in \
        node.log.read_text()


def _asks(node: Agent, pki: Pki, client: str, times: int) -> None:
    """fleetd watch's launch-detail asks (hang.DetailAsks) for node gpu-01, as ``client``."""
    cert, key = pki.pair(client)
    opts = ClientOptions(ssl=tls.client_context(pki.ca, cert, key), has_client_cert=True)
    target = parse_nodes(f"gpu-01={node.url.removeprefix('https://')}")[0]

    async def go() -> None:
        asks = DetailAsks()
        answer = FleetAnswer([NodeOutcome(target, "gpu-01", replies=[{}])])
        async with FleetClient(opts) as client_:
            for _ in range(times):
                asks.until.clear()  # due again at once
                await asks.ask(answer, client_, {"gpu-01"})

    asyncio.run(go())


def test_watch_takes_a_refusal_as_one_warning_per_node(node: Agent, pki: Pki,
                                                       caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    with caplog.at_level(logging.INFO, logger="fleetd.fleet.hang"):
        _asks(node, pki, "desk", times=3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("node gpu-01 refused launch detail (watching on without "
                                  "it): http: HTTP 403 forbidden: refused: cert:desk may "
                                  "not open"), warnings
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fleetd.fleet.hang"):
        _asks(node, pki, "laptop", times=1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_example_config_grants_nobody(tmp_path: Path) -> None:
    from fleetd.config import load_config

    from conftest import REPO

    cfg = load_config(REPO / "configs" / "fleetd.yaml")
    assert cfg.detail.clients == [] and cfg.detail.client_ous == []
    assert cfg.detail.max_s_per_hour == 360.0
