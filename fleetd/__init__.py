"""fleetd: explain GPU latency from the host side, on one node or a whole fleet."""

__version__ = "0.1.0"
