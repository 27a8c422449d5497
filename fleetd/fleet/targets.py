"""Which agents to ask: ``--nodes`` on the command line, or the config's fleet list."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from fleetd.config import FleetConfig, load_config, parse_hostport
from fleetd.errors import ConfigError, UsageError


@dataclass(frozen=True, slots=True)
class Target:
    """One agent. ``name`` labels it until it names itself in an answer."""

    name: str
    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def url(self, path: str) -> str:
        return f"https://{self.address}{path}"


@dataclass(frozen=True, slots=True)
class RelayRoute:
    """One relay and the targets it asks for us (fleetd.fleet.relayed)."""

    relay: Target
    members: tuple[Target, ...]


# A node list is a few bytes per node: 16 MiB holds far more than any fleet, and bounds
# what a mistyped path (a disk image, /dev/zero) can cost.
NODES_FILE_MAX = 16 << 20


def parse_nodes(text: str) -> list[Target]:
    """``HOST:PORT,...``; an entry may carry a name: ``gpu-01=10.0.0.11:7600``.
    ``@FILE`` reads the list from a file (a thousand nodes do not fit a command line)."""
    if text.startswith("@"):
        return _from_file(Path(text[1:]), text)
    targets = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, addr = item.partition("=")
        if not sep:
            name, addr = "", item
        host, port = _hostport(addr.strip(), item)
        targets.append(Target(name.strip() or _label(host, port), host, port))
    if not targets:
        raise UsageError(f"--nodes {text!r} names no node",
                         "list agents as HOST:PORT,HOST:PORT (e.g. 10.0.0.11:7600)")
    return _unique(targets)


def from_config(fleet: FleetConfig, source: str) -> list[Target]:
    targets = []
    for i, node in enumerate(fleet.nodes):
        if not node.address:
            raise ConfigError(f"{source}: fleet.nodes[{i}] has no address",
                             "give each node an address: {name: gpu-01, address: HOST:PORT}")
        host, port = _hostport(node.address, f"fleet.nodes[{i}].address")
        targets.append(Target(node.name or _label(host, port), host, port))
    if not targets:
        raise ConfigError(f"{source} lists no fleet nodes",
                         "add fleet.nodes to the config, or pass --nodes HOST:PORT,...")
    return _unique(targets)


def _from_file(path: Path, shown: str) -> list[Target]:
    """A fleetd.yaml with a ``fleet.nodes`` list, or plain text: entries separated by
    commas or newlines, ``#`` starting a comment."""
    fix = "give --nodes @FILE a fleetd.yaml with fleet.nodes, or one NAME=HOST:PORT per line"
    try:
        with path.open("rb") as f:
            raw = f.read(NODES_FILE_MAX + 1)
    except OSError as exc:
        raise UsageError(f"--nodes {shown!r}: cannot read {str(path)!r}: {exc.strerror}",
                         fix) from None
    if len(raw) > NODES_FILE_MAX:
        raise UsageError(f"--nodes {shown!r}: {str(path)!r} is larger than "
                         f"{NODES_FILE_MAX >> 20} MiB", fix)
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise UsageError(f"--nodes {shown!r}: {str(path)!r} is not text", fix) from None
    if _is_fleet_yaml(text):
        return from_config(load_config(path).fleet, str(path))
    entries = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    listed = ",".join(e for e in entries if e)
    if not listed:
        raise UsageError(f"--nodes {shown!r}: {str(path)!r} lists no node", fix)
    return parse_nodes(listed)


def _is_fleet_yaml(text: str) -> bool:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return isinstance(doc, dict) and "fleet" in doc


def _hostport(addr: str, shown: str) -> tuple[str, int]:
    try:
        host, port = parse_hostport(addr, "node address")
    except ConfigError:
        raise UsageError(f"invalid node address {shown!r}",
                         "use HOST:PORT, NAME=HOST:PORT or [v6]:PORT, e.g. 10.0.0.11:7600"
                         ) from None
    if port == 0:
        raise UsageError(f"node address {shown!r} has port 0",
                         "use the port the agent printed when it started (default 7600)")
    return host, port


def _label(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _unique(targets: list[Target]) -> list[Target]:
    seen: dict[str, Target] = {}
    names: set[str] = set()
    for t in targets:
        if t.address in seen:
            raise UsageError(f"node {t.address} is listed twice",
                             "list each agent once; two nodes need two addresses")
        if t.name in names:
            raise UsageError(f"node name {t.name!r} is used twice",
                             "give each node its own name")
        seen[t.address] = t
        names.add(t.name)
    return targets
