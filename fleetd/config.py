"""``fleetd.yaml``: one file for the agent and for the fleet client, validated strictly.

Unknown keys are errors (a typo must not silently fall back to a default), every
value is type-checked with its dotted key named in the message, and relative paths
are taken relative to the file's own directory.
"""

from __future__ import annotations

import dataclasses
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from fleetd.errors import ConfigError


@dataclass
class TLSConfig:
    cert: Path | None = None  # node certificate (PEM), from `fleetd certs issue-node`
    key: Path | None = None  # its private key
    client_ca: Path | None = None  # CA that client certificates must chain to (mTLS)
    plain_http: bool = False  # serve plain HTTP: loopback only, never chosen silently
    relay_nodes: list[str] = field(default_factory=list)  # node certs allowed to query


@dataclass
class LimitsConfig:
    query_timeout_s: float = 5.0  # ceiling on one query's run time
    max_rows: int = 10_000  # ceiling on rows returned by one query
    max_bytes: int = 16 * 1024 * 1024  # ceiling on bytes returned by one query
    max_body_bytes: int = 64 * 1024  # largest request body accepted
    max_concurrent_queries: int = 8  # queries running at once; more are refused as busy
    max_queries_per_client: int = 0  # one client's share of those; 0: half of them
    max_connections: int = 512  # open connections, handshakes included; keep < LimitNOFILE
    max_connections_per_source: int = 64  # from one address
    handshake_timeout_s: float = 5.0  # a TLS handshake must finish within this
    header_timeout_s: float = 10.0  # request headers, from their first byte
    body_timeout_s: float = 30.0  # a request body, once its headers are in
    write_timeout_s: float = 10.0  # a client must take some of its answer within this
    max_queued_bytes: int = 128 * 1024 * 1024  # answers made and not yet taken, in all


@dataclass
class TraceConfig:
    enabled: bool = True  # false: serve the database only (like --no-trace)
    pids: list[int] = field(default_factory=list)  # processes to trace
    all: bool = False  # trace every process that loads a CUDA library
    cuda_lib: Path | None = None  # override library discovery
    host: bool = True  # host tracepoints (scheduler, memory, block, irq, syscalls)
    sample: int = 100  # keep 1 in N ordinary CUDA calls as events (all in histograms)


@dataclass
class StoreConfig:
    db: Path | None = None  # default: /var/lib/fleetd/fleetd.db for root
    max_bytes: int | None = None  # prune the oldest events beyond this size
    on_damaged_db: str = "refuse"  # a damaged database at start: refuse, or move-aside


@dataclass
class FleetNode:
    name: str = ""  # node name, as the node calls itself
    address: str = ""  # host:port of its agent


@dataclass
class FleetConfig:
    nodes: list[FleetNode] = field(default_factory=list)
    ca: Path | None = None  # fleet CA, to verify the agents
    client_cert: Path | None = None  # this client's certificate (mTLS)
    client_key: Path | None = None
    token_file: Path | None = None  # bearer token, if the agents require one
    timeout_s: float = 10.0  # total time per node
    connect_timeout_s: float = 3.0
    concurrency: int = 64  # requests in flight at once
    clock_skew_threshold_ms: float = 10.0  # warn above this estimated offset


@dataclass
class RelayConfig:
    """This agent relaying a client's fan-out to its peers (docs/fleet.md "Relays")."""

    enabled: bool = False  # serve POST /api/v1/relay; off: a relay request gets 403
    # The only nodes this relay forwards to (NAME=HOST:PORT, or {name, address}): a
    # client names them, the relay dials the address listed here and no other.
    peers: list[FleetNode] = field(default_factory=list)
    max_targets: int = 64  # peers one relayed request may name
    timeout_s: float = 30.0  # ceiling on one relayed fan-out (a client may only lower it)
    concurrency: int = 64  # requests to peers in flight at once, per relayed request
    ca: Path | None = None  # CA the peers' certificates chain to; default tls.client_ca
    token_file: Path | None = None  # bearer token the peers require, if they do
    max_answer_bytes: int = 64 * 1024 * 1024  # the merged answer; nodes beyond it fail


@dataclass
class DetailConfig:
    """Launch-detail windows (POST /api/v1/detail): who may open them, and how much."""

    clients: list[str] = field(default_factory=list)  # client certificate CNs / DNS names
    client_ous: list[str] = field(default_factory=list)  # or a certificate with such an OU
    max_s_per_hour: float = 360.0  # on-time per hour, the agent's own rule included (10%)


@dataclass
class Config:
    node: str | None = None  # node name (default: hostname); ':' is not allowed
    listen: str = "127.0.0.1:7600"  # host:port of the agent's API
    token_file: Path | None = None  # require this bearer token on top of TLS
    tls: TLSConfig = field(default_factory=TLSConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    detail: DetailConfig = field(default_factory=DetailConfig)


def discover_config(env: dict[str, str] | None = None) -> Path | None:
    """The config a command uses without ``--config``, where users look for one:
    ``$FLEETD_CONFIG`` (which must exist), then ``$XDG_CONFIG_HOME/fleetd/fleetd.yaml``
    (``~/.config`` by default), then ``/etc/fleetd/fleetd.yaml``."""
    env = dict(os.environ) if env is None else env
    named = env.get("FLEETD_CONFIG")
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigError(f"$FLEETD_CONFIG names {named!r}, which is not a file",
                              "point FLEETD_CONFIG at a fleetd.yaml, or unset it")
        return path
    home = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME") or "~").expanduser()
                / ".config")
    for path in (home / "fleetd" / "fleetd.yaml", Path("/etc/fleetd/fleetd.yaml")):
        if path.is_file():
            return path
    return None


def load_config(path: Path) -> Config:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc.strerror}",
                          "pass --config PATH to an existing fleetd.yaml") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}",
                          "fix the syntax (see configs/fleetd.yaml)") from None
    if raw is None:
        raw = {}
    cfg: Config = _build(Config, raw, "", path)
    return cfg


def _build(cls: type[Any], raw: Any, prefix: str, path: Path) -> Any:
    if not isinstance(raw, dict):
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(f"{path}: {where} must be a mapping, got {type(raw).__name__}",
                          "see configs/fleetd.yaml for the layout")
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{path}: unknown key {dotted!r}",
                              f"known keys here: {', '.join(sorted(known))}")
        values[key] = _convert(hints[key], value, dotted, path)
    return cls(**values)


def _convert(tp: Any, value: Any, dotted: str, path: Path) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return None if value is None else _convert(args[0], value, dotted, path)
    if tp is FleetNode and isinstance(value, str):
        # A plain "host:port" (or "name=host:port"), as --nodes takes it.
        name, sep, address = value.rpartition("=")
        return FleetNode(name.strip(), address.strip())
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, dotted + ".", path)  # type: ignore[arg-type]
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(dotted, "a list", value, path)
        (item,) = get_args(tp)
        return [_convert(item, v, f"{dotted}[{i}]", path) for i, v in enumerate(value)]
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise _type_error(dotted, "a path", value, path)
        p = Path(value).expanduser()
        return p if p.is_absolute() else (path.parent / p)
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(dotted, "true or false", value, path)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _type_error(dotted, "a whole number >= 0", value, path)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise _type_error(dotted, "a number > 0", value, path)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _type_error(dotted, "a string", value, path)
        return value
    raise ConfigError(f"{path}: cannot read {dotted!r}")  # a new field type: a bug here


def _type_error(dotted: str, want: str, value: Any, path: Path) -> ConfigError:
    return ConfigError(f"{path}: {dotted} must be {want}, got {value!r}",
                       "see configs/fleetd.yaml for every setting and its meaning")


def parse_hostport(text: str, what: str = "address") -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(
            f"invalid {what} {text!r}",
            "use HOST:PORT, e.g. 127.0.0.1:7600 or [::1]:7600 (port 0: any free port)",
        )
    return host, int(port)
