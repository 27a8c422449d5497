"""Selecting processes by their Kubernetes pod across the wire (``--pod``,
``--namespace`` with ``--nodes``): the query parameters the client sends and the node
reads, and the placement fields of a node's process rows, read as untrusted text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetd.analyze.reading.rows import Placement, PlacementKey
from fleetd.wire.limits import POD_CHARS
from fleetd.wire.paths import NAMESPACE_PARAM, POD_PARAM
from fleetd.wire.values import printable

# What a row gains from fleetd.analyze.reading.pods.fields; each a short name or uid.
PLACEMENT_FIELDS: tuple[PlacementKey, ...] = ("pod", "namespace", "container", "pod_uid")


def params(pod: str | None, namespace: str | None) -> dict[str, str]:
    """The query parameters that select ``pod`` and/or ``namespace`` (none: neither)."""
    return {k: v for k, v in ((POD_PARAM, pod), (NAMESPACE_PARAM, namespace)) if v}


def read_params(query: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(pod, namespace) a request asks for; a ValueError when one is longer than a
    Kubernetes name may be or not printable."""
    out: list[str | None] = []
    for name in (POD_PARAM, NAMESPACE_PARAM):
        text = query.get(name) or None
        # NAMESPACE/NAME: two names and the slash.
        limit = 2 * POD_CHARS + 1 if name == POD_PARAM else POD_CHARS
        if text is not None and (len(text) > limit or not text.isprintable()):
            raise ValueError(f"{name}={text[:40]!r} is not a Kubernetes name of at most "
                             f"{limit} printable characters")
        out.append(text)
    return out[0], out[1]


def read_placement(row: Mapping[str, Any]) -> Placement:
    """The placement fields of a node's row that are text, printable and cut; anything
    else is dropped (a process with no pod shows none)."""
    out: Placement = {}
    for k in PLACEMENT_FIELDS:
        v = row.get(k)
        if isinstance(v, str) and v:
            out[k] = printable(v, POD_CHARS)
    return out


def label(row: Mapping[str, Any]) -> str:
    """``namespace/pod`` of a row (or its container), ``-`` outside any."""
    if row.get("pod"):
        return f"{row['namespace']}/{row['pod']}" if row.get("namespace") else str(row["pod"])
    return str(row.get("container") or "-")
