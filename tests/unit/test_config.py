"""fleetd.yaml: the shipped example is valid; mistakes are named with their key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetd.config import load_config, parse_hostport
from fleetd.errors import ConfigError

from conftest import REPO


def test_shipped_example_loads_with_paths_resolved() -> None:
    cfg = load_config(REPO / "configs" / "fleetd.yaml")
    assert cfg.node == "gpu-01" and cfg.limits.max_rows == 10000
    assert cfg.tls.client_ca == REPO / "configs" / "tls" / "ca.pem"
    assert [n.name for n in cfg.fleet.nodes] == ["gpu-01", "gpu-02"]
    assert cfg.store.max_bytes == 10 * 1024**3


@pytest.mark.parametrize(("text", "needle"), [
    ("listne: 1.2.3.4:5", "unknown key 'listne'"),
    ("limits:\n  max_rowz: 5", "unknown key 'limits.max_rowz'"),
    ("limits:\n  max_rows: many", "limits.max_rows must be a whole number"),
    ("limits:\n  query_timeout_s: -1", "limits.query_timeout_s must be a number > 0"),
    ("tls:\n  plain_http: yes please", "tls.plain_http must be true or false"),
    ("trace:\n  pids: 5", "trace.pids must be a list"),
    ("trace:\n  pids: [1, x]", "trace.pids[1] must be a whole number"),
    ("fleet:\n  nodes:\n    - {name: a, adress: b}", "unknown key 'fleet.nodes[0].adress'"),
    ("- just\n- a list", "the top level must be a mapping"),
    ("node: [unclosed", "not valid YAML"),
])
def test_mistakes_are_named(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "fleetd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in info.value.message
    assert info.value.hint


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "fleetd.yaml"
    path.write_text("")
    assert load_config(path).listen == "127.0.0.1:7600"


@pytest.mark.parametrize(("text", "want"), [
    ("127.0.0.1:7600", ("127.0.0.1", 7600)), ("[::1]:80", ("::1", 80)),
    ("node-a:0", ("node-a", 0)),
])
def test_hostport(text: str, want: tuple[str, int]) -> None:
    assert parse_hostport(text) == want


@pytest.mark.parametrize("text", ["7600", ":7600", "host:", "host:99999", "host:x"])
def test_bad_hostport(text: str) -> None:
    with pytest.raises(ConfigError, match="invalid address"):
        parse_hostport(text)
