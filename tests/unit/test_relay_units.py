"""Peer relays without a network: routes, time fields moved into a peer's clock, limits
only lowered, and a relay's answer read as the untrusted input it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetd.config import load_config
from fleetd.errors import ConfigError, UsageError
from fleetd.fleet.client import Failure
from fleetd.fleet.fanout import NodeOutcome, Request
from fleetd.fleet.queries import QuerySpec, _query_request
from fleetd.fleet.relayed import (
    RelayRoute,
    _compose,
    _wire,
    plan_routes,
    time_paths,
    unpack,
)
from fleetd.fleet.skew import Skew
from fleetd.fleet.targets import parse_nodes
from fleetd.relay import (
    RelaySettings,
    _Bad,
    _job,
    _lowered,
    _plan,
    _request,
    _told,
    relay_peers,
)
from fleetd.store.guard import Limits

NODES = parse_nodes(",".join(f"n{i}=10.0.0.{i}:7600" for i in range(7)))


def test_routes_split_evenly_or_group_by_degree() -> None:
    routes = plan_routes(NODES, "n0,10.0.0.3:7600", None)
    assert [(r.relay.name, [m.name for m in r.members]) for r in routes] == [
        ("n0", ["n1", "n2", "n4"]), ("n3", ["n5", "n6"])]
    tree = plan_routes(NODES, None, 3)
    assert [(r.relay.name, [m.name for m in r.members]) for r in tree] == [
        ("n0", ["n1", "n2"]), ("n3", ["n4", "n5"])]  # n6 alone: asked directly
    outside = plan_routes(NODES[:2], "10.9.9.9:7600", None)
    assert outside[0].relay.address == "10.9.9.9:7600" and len(outside[0].members) == 2
    assert plan_routes(NODES, None, None) == ()


@pytest.mark.parametrize(("via", "degree", "needle"), [
    ("n0", 3, "two ways"), (None, 1, "at least 2"), ("gpu-9", None, "'gpu-9', which is not"),
    ("n0,n0", None, "twice"),
])
def test_route_mistakes_are_named(via: str | None, degree: int | None, needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        plan_routes(NODES, via, degree)


def test_time_fields_move_into_each_peers_clock() -> None:
    spec = QuerySpec("SELECT * FROM events WHERE ts_ns >= ? AND pid = ? AND ts_ns < ?",
                     [1_000, 42, 9_000_000_000], frozenset({0, 2}), max_rows=5)

    def plan(off: int) -> list[Request]:
        return [_query_request(spec, off), Request("GET", "/api/v1/ops",
                                                   {"since": str(10 + off), "pid": "42"})]

    wired = [_wire(r, plan, 7, i) for i, r in enumerate(plan(7))]
    assert wired[0]["shift"] == [["body", "params", 0], ["body", "params", 2]]
    assert wired[1]["shift"] == [["params", "since"]]
    # The relay adds its offset to each peer to exactly those fields, and to no other.
    relay_plan = _plan([_request(w, Limits()) for w in wired])
    moved = relay_plan(1_000)
    assert moved[0].body is not None and moved[0].body["params"] == [2_007, 42, 9_000_001_007]
    assert moved[1].params == {"since": "1017", "pid": "42"}
    assert relay_plan(0)[0].body["params"] == [1_007, 42, 9_000_000_007]  # type: ignore[index]
    assert time_paths({"a": True}, {"a": 5}, 5) == []  # a bool is no time


def test_a_relay_lowers_limits_and_never_raises_them() -> None:
    ceiling = Limits(timeout_s=5.0, max_rows=100, max_bytes=1000)
    assert _lowered({"sql": "x", "max_rows": 10**9, "timeout_s": 60}, ceiling) == {
        "sql": "x", "max_rows": 100, "timeout_s": 5.0, "max_bytes": 1000}
    assert _lowered({"max_rows": 3}, ceiling)["max_rows"] == 3
    assert _lowered({"max_rows": "lots"}, ceiling)["max_rows"] == "lots"  # the peer refuses


def test_a_relay_job_is_bounded_by_the_relays_own_settings() -> None:
    s = RelaySettings(node="r", limits=Limits(timeout_s=5.0, max_rows=100), max_targets=2,
                      timeout_s=4.0, max_answer_bytes=1000)
    query = {"method": "POST", "path": "/api/v1/query", "body": {"sql": "x", "timeout_s": 9}}
    targets = [{"name": "a", "address": "10.0.0.1:7600"}]
    job = _job({"targets": targets, "requests": [query], "timeout_s": 60,
                "max_answer_bytes": 10**9}, s)
    assert job.timeout_s == 4.0 and job.max_answer_bytes == 1000
    assert (job.requests[0].body or {})["timeout_s"] == 3.6  # under the fan-out's deadline
    assert (job.requests[0].body or {})["max_rows"] == 100
    again = {"method": "POST", "path": "/api/v1/relay", "body": {}}
    for body, needle in (
            ({"targets": targets, "requests": [again]}, "cannot be relayed again"),
            ({"targets": targets * 3, "requests": [query]}, "over this relay's limit of 2"),
            ({"targets": targets, "requests": [query], "skew_samples": 99}, "0..10"),
            ({"targets": [{"address": "nowhere"}], "requests": [query]}, "'nowhere'"),
            ({"targets": targets, "requests": [query], "extra": 1}, "unknown field")):
        with pytest.raises(_Bad, match=needle):
            _job(body, s)


def test_clock_estimates_compose_and_their_errors_add() -> None:
    peer = Skew(offset_ns=2_500_000_000, error_ns=300_000, samples=5, used=3)
    relay = Skew(offset_ns=-1_000_000, error_ns=200_000, samples=5, used=2)
    both = _compose(peer, relay)
    assert both is not None and both.offset_ns == 2_499_000_000 and both.error_ns == 500_000
    assert _compose(peer, None) is None


def _route() -> RelayRoute:
    return RelayRoute(NODES[0], tuple(NODES[1:5]))


def _ok(node: str, rows: list[list[Any]]) -> dict[str, Any]:
    return {"node": node, "columns": ["a"], "rows": rows}


def test_a_lying_relay_costs_only_the_nodes_it_lied_about() -> None:
    route = _route()
    skew = {"offset_ns": 5, "error_ns": 1, "samples": 5, "used": 3}
    reply = {"nodes": [
        {"address": "10.0.0.1:7600", "replies": [_ok("n1", [[1]])], "skew": skew},
        {"address": "10.0.0.1:7600", "replies": [_ok("evil", [[666]])]},  # again: ignored
        {"address": "10.0.0.66:7600", "replies": [_ok("n66", [[2]])]},  # not asked: ignored
        {"address": "10.0.0.2:7600", "replies": [_ok("n2", [[2**70]])], "skew": skew},
        {"address": "10.0.0.3:7600", "failure": {"kind": "\x1b[31mpwned", "message":
                                                 "down\x1b]0;x\x07", "status": 9999}},
        {"address": ["10.0.0.4:7600"], "replies": [_ok("n4", [[4]])]},  # not text: ignored
    ]}
    req = Request("POST", "/api/v1/query", body={}, expect=("columns", "rows"))
    n1, n2, n3, n4 = unpack(reply, route, [req])
    assert n1.ok and n1.replies == [_ok("n1", [[1]])] and n1.skew is not None
    assert n2.failure is not None and n2.failure.kind == "bad_json"
    assert "beyond 64 bits" in n2.failure.message and "via relay n0" in n2.failure.message
    assert n3.failure is not None and n3.failure.kind == "relay"
    assert n3.failure.message == "via relay n0: down?]0;x?" and n3.failure.status is None
    assert n4.failure is not None and "gave no answer for this node" in n4.failure.message


def test_a_relays_clock_figures_must_be_sane_integers() -> None:
    req = Request("GET", "/api/v1/health", expect=("node",))
    for skew in ({"offset_ns": 1e300, "error_ns": 1, "samples": 1, "used": 1},
                 {"offset_ns": 5, "error_ns": -1, "samples": 1, "used": 1}, "soon"):
        reply = {"nodes": [{"address": "10.0.0.1:7600", "replies": [{"node": "n1"}],
                            "skew": skew}]}
        out = unpack(reply, RelayRoute(NODES[0], (NODES[1],)), [req])[0]
        assert out.ok and out.skew is None and out.skew_failure is not None
    bad = unpack({"nodes": "all fine"}, _route(), [req])
    assert all(o.failure is not None and "no list of nodes" in o.failure.message for o in bad)


def test_relay_is_off_by_default_and_configured_strictly(tmp_path: Path) -> None:
    path = tmp_path / "fleetd.yaml"
    path.write_text("")
    assert load_config(path).relay.enabled is False
    path.write_text("relay:\n  enabled: true\n  max_targets: 8\n  ca: ca.pem\n")
    cfg = load_config(path)
    assert cfg.relay.enabled and cfg.relay.max_targets == 8 and cfg.relay.ca == tmp_path / "ca.pem"


# ---- only to the fleet: relay.peers --------------------------------------------------


PEERS = parse_nodes("gpu-02=10.0.0.2:7600,gpu-03=[fd00::3]:7600")
QUERY = {"method": "POST", "path": "/api/v1/query", "body": {"sql": "SELECT 1"}}


def test_a_relay_dials_only_the_addresses_its_config_lists() -> None:
    s = RelaySettings(node="r", peers=tuple(PEERS))
    job = _job({"targets": [
        {"name": "gpu-02", "address": "10.9.9.9:22"},  # a listed name: its listed address
        {"name": "laptop-label", "address": "[fd00::3]:7600"},  # a listed address
        {"name": "x", "address": "127.0.0.1:6379"},  # neither: never contacted
        {"name": "gpu-02"},  # a name alone is enough
    ], "requests": [QUERY]}, s)
    assert [t.address for t in job.targets] == ["10.0.0.2:7600", "[fd00::3]:7600"]
    by_key = {a.address: a.peer for a in job.asked}
    assert by_key["10.9.9.9:22"] == PEERS[0] and by_key["[fd00::3]:7600"] == PEERS[1]
    assert by_key["127.0.0.1:6379"] is None and by_key["10.0.0.2:7600"] == PEERS[0]
    # No peers configured: nothing is ever dialed.
    bare = _job({"targets": [{"address": "10.0.0.2:7600"}], "requests": [QUERY]},
                RelaySettings(node="r"))
    assert bare.targets == () and bare.asked[0].peer is None


def test_relay_peers_come_from_the_config_and_bad_entries_are_named(tmp_path: Path) -> None:
    path = tmp_path / "fleetd.yaml"
    path.write_text("relay:\n  enabled: true\n  peers: [gpu-02=10.0.0.2:7600, "
                    "{name: gpu-03, address: '10.0.0.3:7600'}, 10.0.0.4:7600]\n")
    peers = relay_peers(load_config(path).relay.peers)
    assert [(p.name, p.address) for p in peers] == [
        ("gpu-02", "10.0.0.2:7600"), ("gpu-03", "10.0.0.3:7600"),
        ("10.0.0.4:7600", "10.0.0.4:7600")]
    path.write_text("relay:\n  peers: [gpu-02=nowhere]\n")
    with pytest.raises(ConfigError, match=r"relay.peers\[0\]"):
        relay_peers(load_config(path).relay.peers)


@pytest.mark.parametrize("kind", ["refused", "unreachable", "tls", "timeout", "disconnected"])
def test_a_relay_tells_a_client_nothing_about_ports(kind: str) -> None:
    s = RelaySettings(node="r", peers=tuple(PEERS))
    o = NodeOutcome(PEERS[0], "gpu-02")
    told = _told(Failure(kind, f"10.0.0.2:7600 {kind} detail", "hint"), o, s)
    assert (told.kind, told.message) == (
        "unreachable", "gpu-02 could not be reached from relay r (or did not answer in time)")
    # An answer from the agent itself (an HTTP error) is the node's own, and passes.
    http = Failure("http", "HTTP 403: refused", status=403, code="forbidden")
    assert _told(http, o, s) is http
