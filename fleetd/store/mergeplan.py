"""The plan of an offline merge: everything decided before a row is written.

:func:`fleetd.store.merge.merge` works in two steps, and this module is the first. It
reads each input (schema version, node identities, clocks, how many ids there are to
copy), names the inputs that have no identity (``--force-node``), gives every input node
its key in the output, and refuses the conflicts: one name for two machines, or two
names for one. It only reads, inputs and an existing output alike, so whatever would
make a merge fail is found here, before a temporary output exists; writing the output
is :mod:`fleetd.store.merge`'s part.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from fleetd.errors import StoreError, UsageError
from fleetd.store import schema
from fleetd.store.clockinfo import (
    SESSION_CLOCK_COLUMNS,
    NodeClock,
    clock_warnings,
    session_clock,
)
from fleetd.store.db import check_identity, open_reader, validate_node_name

log = logging.getLogger("fleetd.store.mergeplan")

SEQ_BITS = schema.SEQ_BITS

TABLES: tuple[str, ...] = (
    "meta", "nodes", "sources", "ops", "session_data", "process_data", "task_data",
    "stacks", "event_data", "event_args", "aggregate_data", "chain_data",
    "gpu_names", "gpu_data", "annotation_data",
)

# Where each table of an input is read from: a table of the attached file, or a TEMP
# view that converts an older layout.
Layout = dict[str, str]
Upgrade = Callable[[sqlite3.Connection, str, Layout], Layout]
# upgrades[v] presents a version-v file as version v + 1 (fleetd.store.merge.UPGRADES).
Upgrades = Mapping[int, Upgrade]


# ---- the plan ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    key: int  # the node's key inside its own file
    name: str
    uid: str
    machine_id: str | None = None
    host: str | None = None
    created_ns: int = 0


@dataclass(slots=True)
class Source:
    """One input, checked and planned; nothing copied yet."""

    path: Path
    version: int
    nodes: list[NodeIdentity]
    forced: bool = False  # the node name came from --force-node
    key_map: dict[int, int] = field(default_factory=dict)  # input key -> output key
    clocks: list[NodeClock] = field(default_factory=list)
    span_ids: int = 0  # upper bound on its events, for progress
    orphan_keys: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Existing:
    """What the output already holds: node name -> (uid, key), and their clocks."""

    names: dict[str, tuple[str, int]] = field(default_factory=dict)
    clocks: list[NodeClock] = field(default_factory=list)
    fresh: bool = True  # no output yet (or an empty file): build from scratch


@dataclass(slots=True)
class Plan:
    """A merge that passed every check: what to copy, and what to warn about."""

    existing: Existing
    sources: list[Source]
    clocks: list[NodeClock]  # one per node, the output's nodes included
    warnings: list[str]


def plan(inputs: Sequence[Path], output: Path, force_nodes: Sequence[str],
         upgrades: Upgrades, clock_threshold_ns: int) -> Plan:
    """Read and check ``inputs`` (and ``output`` if it exists); nothing is written."""
    paths = _check_paths(inputs, output)
    existing = _existing_output(output, upgrades)
    sources = [_read_source(p, upgrades) for p in paths]
    _apply_forced_names(sources, force_nodes)
    _assign_keys(sources, existing, output)
    # One entry per node: a node merged again is described by its newest copy.
    by_name = {c.name: c for c in existing.clocks}
    by_name.update((c.name, c) for s in sources for c in s.clocks)
    clocks = list(by_name.values())
    warnings = clock_warnings(clocks, clock_threshold_ns)
    warnings += [f"{s.path}: rows of node key(s) {s.orphan_keys} have no nodes row and are "
                 "left out" for s in sources if s.orphan_keys]
    return Plan(existing, sources, clocks, warnings)


def _check_paths(inputs: Sequence[Path], output: Path) -> list[Path]:
    if not inputs:
        raise UsageError("no input databases", "fleetd merge node-01.db node-02.db -o cluster.db")
    out: list[Path] = []
    seen: set[Path] = set()
    for p in inputs:
        real = p.resolve()
        if output.exists() and real == output.resolve():
            raise UsageError(
                f"input {str(p)!r} is also the output",
                "write the merge to a new file (-o cluster.db); an existing output is "
                "extended, so you can merge more inputs into it later",
            )
        if real in seen:
            log.info("%s given twice; merged once", p)
            continue
        seen.add(real)
        out.append(p)
    if output.exists() and output.is_dir():
        raise UsageError(f"output {str(output)!r} is a directory", "name a file: -o cluster.db")
    return out


# ---- reading inputs ------------------------------------------------------------------


def source_layout(conn: sqlite3.Connection, schema_name: str, version: int,
                  upgrades: Upgrades) -> Layout:
    """Where to read each table of a version-``version`` file attached as ``schema_name``."""
    layout: Layout = {t: f"{schema_name}.{t}" for t in TABLES}
    for v in range(version, schema.SCHEMA_VERSION):
        step = upgrades.get(v)
        if step is None:
            raise StoreError(
                f"schema version {version} cannot be converted: no upgrade from version {v}",
                "merge it with the fleetd release that recorded it, then merge that output",
            )
        layout = step(conn, schema_name, layout)
    return layout


def _read_source(path: Path, upgrades: Upgrades) -> Source:
    conn = open_reader(path)  # refuses missing, corrupt, foreign, newer and empty files
    try:
        version = check_identity(conn, path)
        if version < schema.SCHEMA_VERSION:
            # TEMP views only; the file stays read-only through mode=ro.
            conn.execute("PRAGMA query_only=0")
        layout = source_layout(conn, "main", version, upgrades)
        nodes = [NodeIdentity(int(k), str(n), str(u), m, h, int(c or 0)) for k, n, u, m, h, c in
                 conn.execute(f"SELECT id, name, uid, machine_id, host, created_ns "
                              f"FROM {layout['nodes']} ORDER BY id")]
        src = Source(path, version, nodes)
        data_keys = _data_keys(conn, layout)
        src.orphan_keys = sorted(data_keys - {n.key for n in nodes}) if nodes else []
        if not nodes:
            src.nodes = _anonymous_nodes(conn, layout, path, data_keys)
        alone = len(src.nodes) == 1 and not src.orphan_keys
        src.clocks = [_node_clock(conn, layout, n, str(path), alone) for n in src.nodes]
        src.span_ids = sum(_id_span(conn, layout, n.key) for n in src.nodes)
        return src
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read {path}: {exc}",
                         "if the file was copied off a node, copy it again") from exc
    finally:
        conn.close()


def _data_keys(conn: sqlite3.Connection, layout: Layout) -> set[int]:
    """Node keys that own rows. Events by their id range; the small tables in full."""
    keys: set[int] = set()
    # min and max in separate statements: each is then one b-tree seek, not a scan.
    lo = conn.execute(f"SELECT min(id) FROM {layout['event_data']}").fetchone()[0]
    hi = conn.execute(f"SELECT max(id) FROM {layout['event_data']}").fetchone()[0]
    if lo is not None:
        keys.update(range(int(lo) >> SEQ_BITS, (int(hi) >> SEQ_BITS) + 1))
    for table in ("session_data", "process_data", "task_data", "chain_data", "aggregate_data"):
        keys.update(int(k) for (k,) in conn.execute(f"SELECT DISTINCT node FROM {layout[table]}"))
    return keys


def _anonymous_nodes(conn: sqlite3.Connection, layout: Layout, path: Path,
                     data_keys: set[int]) -> list[NodeIdentity]:
    """An input without node identity: one placeholder node, named by --force-node later."""
    if not data_keys:
        return []
    if len(data_keys) > 1:
        raise StoreError(
            f"{path} has no node identity and holds rows of {len(data_keys)} node keys "
            f"({sorted(data_keys)[:5]}), so its rows cannot be given one node name",
            "merge it with the fleetd release that recorded it, which knows its nodes",
        )
    key = data_keys.pop()
    # A uid derived from content: merging the same file again under the same name is
    # recognised as the same node, a different file under that name is not.
    first = conn.execute(f"SELECT * FROM {layout['event_data']} ORDER BY id LIMIT 1").fetchone()
    sess = conn.execute(f"SELECT seq, started_ns, boot_id FROM {layout['session_data']} "
                        "ORDER BY node, seq LIMIT 1").fetchone()
    digest = hashlib.sha256(repr((first, sess)).encode()).hexdigest()[:32]
    created = int(sess[1]) if sess else int(first[1]) if first else 0
    return [NodeIdentity(key, "", f"content-{digest}", None, None, created)]


def _id_span(conn: sqlite3.Connection, layout: Layout, key: int) -> int:
    bounds = (key << SEQ_BITS, (key + 1) << SEQ_BITS)
    lo, hi = (conn.execute(f"SELECT {f}(id) FROM {layout['event_data']} WHERE id >= ? "
                           "AND id < ?", bounds).fetchone()[0] for f in ("min", "max"))
    return 0 if lo is None else int(hi) - int(lo) + 1


def _node_clock(conn: sqlite3.Connection, layout: Layout, node: NodeIdentity,
                where: str, single: bool) -> NodeClock:
    sessions = [session_clock(r) for r in conn.execute(
        f"SELECT {SESSION_CLOCK_COLUMNS} FROM {layout['session_data']} WHERE node = ? "
        "ORDER BY seq", (node.key,))]
    if single:
        # All events are this node's: the timestamp index answers min and max at once.
        first, last = (conn.execute(f"SELECT {f}(ts_ns) FROM {layout['event_data']}")
                       .fetchone()[0] for f in ("min", "max"))
    else:
        first, last = conn.execute(
            f"SELECT min(ts_ns), max(ts_ns) FROM {layout['event_data']} WHERE id >= ? "
            "AND id < ?", (node.key << SEQ_BITS, (node.key + 1) << SEQ_BITS)).fetchone()
    return NodeClock(node.name, where, sessions, first, last)


# ---- node identity -------------------------------------------------------------------


def _existing_output(output: Path, upgrades: Upgrades) -> Existing:
    if not output.exists() or output.stat().st_size == 0:
        return Existing()
    conn = open_reader(output)
    try:
        ex = Existing(fresh=False)
        version = check_identity(conn, output)
        if version < schema.SCHEMA_VERSION:
            conn.execute("PRAGMA query_only=0")  # TEMP views only; the file is mode=ro
        layout = source_layout(conn, "main", version, upgrades)
        for key, name, uid in conn.execute("SELECT id, name, uid FROM nodes ORDER BY id"):
            ex.names[str(name)] = (str(uid), int(key))
            ident = NodeIdentity(int(key), str(name), str(uid))
            ex.clocks.append(_node_clock(conn, layout, ident, f"{output} (existing)", False))
        return ex
    finally:
        conn.close()


def _apply_forced_names(sources: list[Source], force_nodes: Sequence[str]) -> None:
    """``--force-node NAME`` names inputs without identity, in order; ``IN=NAME`` renames."""
    by_path = {s.path.resolve(): s for s in sources}
    plain: list[str] = []
    for spec in force_nodes:
        left, eq, right = spec.rpartition("=")
        target = by_path.get(Path(left).resolve()) if eq and left else None
        if target is None:
            plain.append(spec)
            continue
        _rename(target, right)
    anonymous = [s for s in sources if s.nodes and not s.nodes[0].name]
    if len(plain) > len(anonymous):
        extra = plain[len(anonymous)]
        raise UsageError(
            f"--force-node {extra!r} has no input to name: only {len(anonymous)} input(s) "
            "lack node identity",
            "to rename the node of a file that has one, write --force-node FILE.db=NAME",
        )
    for src, name in zip(anonymous, plain, strict=False):
        _rename(src, name)
    for src in sources:
        if src.nodes and not src.nodes[0].name:
            raise UsageError(
                f"{src.path} has no node identity (no nodes row), so its events have no node",
                f"name it: --force-node NAME (one per such input, in order) or "
                f"--force-node {src.path}=NAME",
            )
        if not src.nodes:
            log.warning("%s holds no rows; nothing to merge from it", src.path)


def _rename(src: Source, name: str) -> None:
    validate_node_name(name)
    if len(src.nodes) != 1:
        raise UsageError(
            f"--force-node names one node, but {src.path} holds {len(src.nodes)}: "
            f"{', '.join(n.name for n in src.nodes) or '(none)'}",
            "rename nodes in their own single-node files before merging",
        )
    src.nodes = [replace(src.nodes[0], name=name)]
    src.forced = True
    for c in src.clocks:
        c.name = name


def _assign_keys(sources: list[Source], existing: Existing, output: Path) -> None:
    """Give each input node its output key; refuse two machines under one name."""
    names = {n: (uid, key, f"{output} (already merged)") for n, (uid, key)
             in existing.names.items()}
    uids = {uid: n for n, (uid, _, _) in names.items()}
    next_key = max((k for _, k, _ in names.values()), default=0) + 1
    for src in sources:
        for node in src.nodes:
            known = names.get(node.name)
            if known is not None:
                if known[0] != node.uid:
                    raise _name_clash(node.name, known[2], known[0], src.path, node.uid)
                src.key_map[node.key] = known[1]
                continue
            if node.uid in uids:
                raise StoreError(
                    f"node {node.name!r} in {src.path} is the node already merged as "
                    f"{uids[node.uid]!r} (same uid {node.uid[:12]}); under a second name its "
                    "events would be stored twice",
                    f"keep one name: --force-node {src.path}={uids[node.uid]}",
                )
            names[node.name] = (node.uid, next_key, str(src.path))
            uids[node.uid] = node.name
            src.key_map[node.key] = next_key
            next_key += 1
        for c, node in zip(src.clocks, src.nodes, strict=True):
            c.name = node.name


def _name_clash(name: str, where_a: str, uid_a: str, path_b: Path, uid_b: str) -> StoreError:
    return StoreError(
        f"two different nodes are named {name!r}: {where_a} (uid {uid_a[:12]}) and {path_b} "
        f"(uid {uid_b[:12]}); their event ids would collide",
        f"give one another name: --force-node {path_b}={name}-2",
    )
