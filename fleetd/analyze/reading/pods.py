"""Where each process ran: its cgroup, container and Kubernetes pod, as the tracer
stored them once per process (schema 5, fleetd.trace.host.cgroups.process_placement).

Users think in pods, not pids: every place that names a process (explain's victims and
culprits, the breakdown, straggler reasons, timelines, the MCP tools) adds its pod and
container from here, and ``--pod`` / ``--namespace`` select processes by them. Files of
an older schema, and processes outside any container, have no placement: nothing is
added and nothing is guessed.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TypeVar, cast

from fleetd.analyze.reading.rows import (
    PLACEMENT_KEYS,
    CgroupPlace,
    KernelOpRow,
    OpRow,
    Placement,
    PodGroup,
    PodProcess,
    ProcessRow,
)
from fleetd.errors import UsageError
from fleetd.store.schema import PLACEMENT_COLUMNS

# The rows that name a process and gain its placement.
Row = TypeVar("Row", OpRow, KernelOpRow, ProcessRow)


def columns(conn: sqlite3.Connection) -> list[str]:
    """The placement columns this file's process_data has (none before schema 5)."""
    have = {str(r[1]) for r in conn.execute("PRAGMA table_info(process_data)")}
    return [c for c in PLACEMENT_COLUMNS if c in have]


def _place(cols: Sequence[str], values: Sequence[object]) -> CgroupPlace:
    """The placement columns ``cols`` of a process_data row that are set, as text."""
    # cols are PLACEMENT_COLUMNS (columns() keeps no other), CgroupPlace's keys.
    return cast(CgroupPlace, {c: str(v) for c, v in zip(cols, values, strict=True)
                              if v is not None})


def placements(conn: sqlite3.Connection, node_key: int | None = None
               ) -> dict[tuple[int, int], CgroupPlace]:
    """(node key, pid) -> what is known of where the process ran; processes in no
    container (their cgroup only) are left out."""
    cols = columns(conn)
    if "container" not in cols:
        return {}
    where = "container IS NOT NULL" + ("" if node_key is None else " AND node = ?")
    rows = conn.execute(f"SELECT node, pid, {', '.join(cols)} FROM process_data WHERE "
                        f"{where}", () if node_key is None else (node_key,))
    return {(int(r[0]), int(r[1])): _place(cols, r[2:]) for r in rows}


def fields(place: CgroupPlace | None) -> Placement:
    """What a victim, culprit or process row gains: ``pod`` and ``namespace`` (when
    known), ``container`` (its name, else its short id) and ``pod_uid``."""
    out: Placement = {}
    if not place:
        return out
    if place.get("pod"):
        out["pod"] = place["pod"]
    if place.get("namespace"):
        out["namespace"] = place["namespace"]
    if place.get("pod_uid"):
        out["pod_uid"] = place["pod_uid"]
    container = place.get("container_name") or place.get("container")
    if container:
        out["container"] = container
    return out


def label(obj: Mapping[str, object]) -> str:
    """`` (pod ns/name, container c)`` for a row carrying :func:`fields`, else ``""``."""
    pod, container = obj.get("pod"), obj.get("container")
    if pod:
        ns = f"{obj['namespace']}/" if obj.get("namespace") else ""
        return f" (pod {ns}{pod}" + (f", container {container})" if container else ")")
    if container:
        return f" (container {container})"
    if obj.get("pod_uid"):
        return f" (pod uid {obj['pod_uid']})"
    return ""


def where(place: CgroupPlace) -> str:
    """`` (pod ns/name, container c)`` or `` (<runtime> <container id>)`` for a cgroup's
    placement (its samples' own fields), naming a limit's owner; ``""`` outside any."""
    if place.get("pod"):
        ns = f"{place['namespace']}/" if place.get("namespace") else ""
        container = place.get("container_name") or place.get("container", "?")
        return f" (pod {ns}{place['pod']}, container {container})"
    if place.get("container"):
        return f" ({place.get('runtime', 'container')} {place['container']})"
    return ""


def annotate(rows: Iterable[Row], node_key: int,
             found: dict[tuple[int, int], CgroupPlace]) -> None:
    """Add :func:`fields` to every row with a ``pid`` on this node, in place."""
    if not found:
        return
    for r in rows:
        pid = r["pid"]
        if pid is not None:
            place = fields(found.get((node_key, pid)))
            for k in PLACEMENT_KEYS:  # in fields' order: the JSON's key order
                if k in place:
                    r[k] = place[k]


def placed(rows: list[Row], pids: Collection[int], node_key: int,
           found: dict[tuple[int, int], CgroupPlace]) -> list[Row]:
    """The rows of ``pids`` (a pod's processes, :func:`select`), each with its
    :func:`fields`."""
    mine = [r for r in rows if r["pid"] in pids]
    annotate(mine, node_key, found)
    return mine


def select(conn: sqlite3.Connection, pod: str | None, namespace: str | None
           ) -> set[int]:
    """The pids (on any node of the file) of processes in pod ``pod`` (a name, or
    ``namespace/name``) and/or namespace ``namespace``."""
    if pod and "/" in pod and namespace is None:
        namespace, _, pod = pod.partition("/")
    cols = columns(conn)
    if "pod" not in cols:
        return set()
    where, params = [], []
    if pod:
        where.append("pod = ?")
        params.append(pod)
    if namespace:
        where.append("namespace = ?")
        params.append(namespace)
    return {int(r[0]) for r in conn.execute(
        f"SELECT DISTINCT pid FROM process_data WHERE {' AND '.join(where) or '1'}", params)}


def known_pods(conn: sqlite3.Connection, limit: int = 10) -> list[str]:
    """Some ``namespace/name`` of the pods this file names, for a hint."""
    if "pod" not in columns(conn):
        return []
    return [f"{ns}/{name}" if ns else str(name) for ns, name in conn.execute(
        "SELECT DISTINCT namespace, pod FROM process_data WHERE pod IS NOT NULL "
        f"ORDER BY 1, 2 LIMIT {int(limit)}")]


def selected(conn: sqlite3.Connection, pid: int | None, pod: str | None,
             namespace: str | None, flag: str = "--") -> set[int] | None:
    """The pids ``pod`` / ``namespace`` select in this database (None: neither given);
    a UsageError when ``pid`` is given too, or with the pods the file names when they
    select nothing. ``flag`` prefixes the option names in messages (``--`` for the CLI,
    ``""`` for tool arguments)."""
    if not pod and not namespace:
        return None
    if pid:
        raise UsageError(f"{flag}pid and {flag}pod/{flag}namespace both select processes",
                         "give one of them")
    found = select(conn, pod, namespace)
    if found:
        return found
    what = " and ".join(x for x in (f"pod {pod}" if pod else "",
                                     f"namespace {namespace}" if namespace else "") if x)
    known = known_pods(conn)
    if known:
        hint = f"pods recorded here: {', '.join(known)}"
    elif not columns(conn):
        hint = ("this file was recorded before pods were (schema < 5): record it again "
                f"with this fleetd, or select with {flag}pid")
    else:
        hint = ("no traced process ran in a pod (docs/deploy.md says how pods are read); "
                f"select with {flag}pid")
    raise UsageError(f"no process of {what} in this database", hint)


NOTE_NO_PODS = ("no traced process ran in a container (or the file was recorded before "
                "pods were, schema < 5)")


def processes(conn: sqlite3.Connection, node_key: int, node: str) -> list[PodProcess]:
    """Every process of one node that ran in a container or a pod: node, pid, comm and
    its :func:`fields`, by namespace, pod and pid (fleetd pods)."""
    cols = columns(conn)
    placed = " OR ".join(f"{c} IS NOT NULL" for c in ("container", "pod") if c in cols)
    if not placed:
        return []
    rows = conn.execute(f"SELECT pid, comm, {', '.join(cols)} FROM process_data "
                        f"WHERE node = ? AND ({placed})", (node_key,)).fetchall()
    found: list[PodProcess] = [{"node": node, "pid": int(r[0]), "comm": str(r[1] or ""),
                                **fields(_place(cols, r[2:]))} for r in rows]
    found.sort(key=lambda r: (r.get("namespace", ""), r.get("pod", ""), r["pid"]))
    return found


def by_pod(procs: list[PodProcess]) -> list[PodGroup]:
    """The processes of :func:`processes` grouped per node and pod (a container outside
    any pod is its own group): node, namespace, pod, pids."""
    groups: dict[tuple[str, str, str], PodGroup] = {}
    for r in procs:
        key = (r["node"], r.get("namespace", ""), r.get("pod") or r.get("container", ""))
        g = groups.setdefault(key, {"node": key[0], "namespace": r.get("namespace"),
                                    "pod": r.get("pod") or r.get("container"), "pids": []})
        g["pids"].append(r["pid"])
    return list(groups.values())
