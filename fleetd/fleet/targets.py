"""Which agents to ask: ``--nodes`` on the command line, or the config's fleet list."""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.config import FleetConfig, parse_hostport
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


def parse_nodes(text: str) -> list[Target]:
    """``HOST:PORT,...``; an entry may carry a name: ``gpu-01=10.0.0.11:7600``."""
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
