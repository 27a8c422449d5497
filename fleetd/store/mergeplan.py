"""The plan of an offline merge: everything decided before a row is written.

:func:`fleetd.store.merge.merge` works in two steps, and this module is the first. It
reads each input (schema version, node identities, clocks, how many ids there are to
copy), names the inputs that have no identity (``--force-node``), gives every input node
its key in the output, and refuses the conflicts: one name for two machines, or two
names for one. It only reads, inputs and an existing output alike, so whatever would
make a merge fail is found here, before a temporary output exists; writing the output
is :mod:`fleetd.store.merge`'s part.

An input is a file copied off a machine nobody here controls, read through
:mod:`fleetd.store.foreign`'s rules (plain tables only, a deadline on every statement,
Ctrl-C that ends one at once, SQLite's heap capped), and every id, node key, name and
timestamp it hands to Python is checked for type and range before it is used: a node
name must follow the node-name rule (``evil:node`` would read as node ``evil``), an id
must carry a node key fleetd can have written, a time must be an integer.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from fleetd.errors import StoreError, UsageError
from fleetd.store import files, foreign, schema
from fleetd.store.clockinfo import (
    SESSION_CLOCK_COLUMNS,
    BadClockRecord,
    NodeClock,
    clock_warnings,
    session_clock,
)
from fleetd.store.db import (
    NODE_NAME_RULE,
    check_identity,
    check_own_schema,
    node_name_ok,
    open_reader,
    validate_node_name,
)

log = logging.getLogger("fleetd.store.mergeplan")

SEQ_BITS = schema.SEQ_BITS
# Node keys an id can carry: ``key << SEQ_BITS`` and ``(key + 1) << SEQ_BITS`` must both
# fit in a signed 64-bit integer (an id at 2**63 - 1 has key 2**23 - 1, one too many).
MAX_NODE_KEY = (1 << (63 - SEQ_BITS)) - 2
MAX_NODES = 65_536  # node keys one input may hold
_INT64 = (-(2**63), 2**63 - 1)

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
    files.refuse_link(output, "merge output")
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
    conn = open_reader(path)  # refuses missing, corrupt, foreign, newer and empty files,
    # and those whose tables are views, virtual tables or computed, or that hold triggers
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, foreign.MAX_VALUE_BYTES)
    try:
        with foreign.Watch(path).guard(conn):
            return _plan_source(conn, path, upgrades)
    finally:
        conn.close()


def _plan_source(conn: sqlite3.Connection, path: Path, upgrades: Upgrades) -> Source:
    version = check_identity(conn, path)
    if version < schema.SCHEMA_VERSION:
        # TEMP views only; the file stays read-only through mode=ro.
        conn.execute("PRAGMA query_only=0")
    layout = source_layout(conn, "main", version, upgrades)
    nodes = _identities(conn, layout, path)
    src = Source(path, version, nodes)
    data_keys = _data_keys(conn, layout, path)
    src.orphan_keys = sorted(data_keys - {n.key for n in nodes}) if nodes else []
    if not nodes:
        src.nodes = _anonymous_nodes(conn, layout, path, data_keys)
    alone = len(src.nodes) == 1 and not src.orphan_keys
    for n in src.nodes:
        _check_sessions(conn, layout, n, path)
    src.clocks = [_node_clock(conn, layout, n, str(path), alone) for n in src.nodes]
    src.span_ids = sum(_id_span(conn, layout, n.key) for n in src.nodes)
    return src


# ---- values from the file, checked before use -----------------------------------------


def _bad(path: Path, what: str, value: object, want: str) -> StoreError:
    shown = repr(value) if not isinstance(value, str | bytes) else repr(value[:60])
    return StoreError(f"{path}: {what} holds {shown} ({type(value).__name__}), {want}",
                      "the file was damaged or not written by fleetd: copy it off the node "
                      "again")


def _int(value: object, path: Path, what: str, lo: int = _INT64[0],
         hi: int = _INT64[1]) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
        return value
    want = "not an integer" if not isinstance(value, int) else f"outside {lo}..{hi}"
    raise _bad(path, what, value, want)


def _key(value: object, path: Path, what: str) -> int:
    return _int(value, path, what, 0, MAX_NODE_KEY)


def _id_key(value: object, path: Path, what: str) -> int:
    """The node key of an id (``key << SEQ_BITS | seq``), refused when the id is not an
    integer or carries a key no node can have."""
    ident = _int(value, path, what)
    if 0 <= ident >> SEQ_BITS <= MAX_NODE_KEY:
        return ident >> SEQ_BITS
    raise _bad(path, what, value, f"an id whose node key {ident >> SEQ_BITS} is outside "
               f"0..{MAX_NODE_KEY} (ids are node_key << {SEQ_BITS} | seq)")


def _text(value: object, path: Path, what: str, *, optional: bool = True,
          limit: int = 253) -> str | None:
    """A short text of the file, stored again: control characters become '?'."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _bad(path, what, value, "not text")
    text = value[:limit]
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)


def _identities(conn: sqlite3.Connection, layout: Layout, path: Path) -> list[NodeIdentity]:
    out: list[NodeIdentity] = []
    for k, n, u, m, h, c in conn.execute(
            f"SELECT id, name, uid, machine_id, host, created_ns FROM {layout['nodes']} "
            f"ORDER BY id LIMIT {MAX_NODES + 1}"):
        if len(out) == MAX_NODES:
            raise StoreError(f"{path}: more than {MAX_NODES} nodes",
                             "merge files of fewer nodes, one merge at a time")
        if not isinstance(n, str):
            raise _bad(path, "nodes.name", n, "not text")
        uid = _text(u, path, f"nodes.uid of node {n!r}", optional=False, limit=128)
        if not uid or uid != u:
            raise _bad(path, f"nodes.uid of node {n!r}", u, "not a printable identity")
        out.append(NodeIdentity(_key(k, path, "nodes.id"), n, uid,
                                _text(m, path, "nodes.machine_id"), _text(h, path, "nodes.host"),
                                _int(c or 0, path, "nodes.created_ns")))
    return out


def _data_keys(conn: sqlite3.Connection, layout: Layout, path: Path) -> set[int]:
    """Node keys that own rows. Events by the keys their ids carry, found by seeking from
    one key's range to the next (one b-tree seek per key present, whatever the ids); the
    small tables in full. Every key is checked, and their number bounded."""
    keys: set[int] = set()
    events = layout["event_data"]
    seek = f"SELECT min(id) FROM {events} WHERE id >= ?"
    first = conn.execute(f"SELECT min(id) FROM {events}").fetchone()[0]
    while first is not None:
        key = _id_key(first, path, "event_data.id")
        keys.add(key)
        _check_key_count(keys, path)
        first = conn.execute(seek, ((key + 1) << SEQ_BITS,)).fetchone()[0]
    top = conn.execute(f"SELECT max(id) FROM {events}").fetchone()[0]
    if top is not None:
        _id_key(top, path, "event_data.id")
    for table in ("session_data", "process_data", "task_data", "chain_data", "aggregate_data"):
        for (k,) in conn.execute(f"SELECT DISTINCT node FROM {layout[table]} "
                                 f"LIMIT {MAX_NODES + 1}"):
            keys.add(_key(k, path, f"{table}.node"))
            _check_key_count(keys, path)
    return keys


MAX_SESSIONS = 1_000_000  # trace sessions of one node (each is read into memory)


def _check_sessions(conn: sqlite3.Connection, layout: Layout, node: NodeIdentity,
                    path: Path) -> None:
    n = conn.execute(f"SELECT count(*) FROM (SELECT 1 FROM {layout['session_data']} "
                     f"WHERE node = ? LIMIT {MAX_SESSIONS + 1})", (node.key,)).fetchone()[0]
    if n > MAX_SESSIONS:
        raise StoreError(f"{path}: node {node.name!r} has more than {MAX_SESSIONS} trace "
                         "sessions", "the file was damaged or not written by fleetd: copy "
                         "it off the node again")


def _check_key_count(keys: set[int], path: Path) -> None:
    if len(keys) > MAX_NODES:
        raise StoreError(f"{path}: rows of more than {MAX_NODES} node keys",
                         "the file was damaged or not written by fleetd: copy it off the "
                         "node again")


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
    key = min(data_keys)
    # A uid derived from content: merging the same file again under the same name is
    # recognised as the same node, a different file under that name is not.
    first = conn.execute(f"SELECT * FROM {layout['event_data']} ORDER BY id LIMIT 1").fetchone()
    sess = conn.execute(f"SELECT seq, started_ns, boot_id FROM {layout['session_data']} "
                        "ORDER BY node, seq LIMIT 1").fetchone()
    digest = hashlib.sha256(repr((first, sess)).encode()).hexdigest()[:32]
    created = sess[1] if sess else first[1] if first else 0
    return [NodeIdentity(key, "", f"content-{digest}", None, None,
                         _int(created, path, "the first session's started_ns"))]


def _id_span(conn: sqlite3.Connection, layout: Layout, key: int) -> int:
    bounds = (key << SEQ_BITS, (key + 1) << SEQ_BITS)
    lo, hi = (conn.execute(f"SELECT {f}(id) FROM {layout['event_data']} WHERE id >= ? "
                           "AND id < ?", bounds).fetchone()[0] for f in ("min", "max"))
    return 0 if lo is None else int(hi) - int(lo) + 1


def _node_clock(conn: sqlite3.Connection, layout: Layout, node: NodeIdentity,
                where: str, single: bool) -> NodeClock:
    try:
        sessions = [session_clock(r) for r in conn.execute(
            f"SELECT {SESSION_CLOCK_COLUMNS} FROM {layout['session_data']} WHERE node = ? "
            "ORDER BY seq", (node.key,))]
    except BadClockRecord as exc:
        raise BadClockRecord(f"{where}: node {node.name or '(unnamed)'!r}: {exc}",
                             exc.hint) from exc
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
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, foreign.MAX_VALUE_BYTES)
    try:
        with foreign.Watch(output).guard(conn):
            ex = Existing(fresh=False)
            version = check_identity(conn, output)
            # Refused here, naming the output: what it holds would run inside the copy
            # of every input, and a slow copy used to be blamed on the input.
            check_own_schema(conn, output, version)
            if version < schema.SCHEMA_VERSION:
                conn.execute("PRAGMA query_only=0")  # TEMP views only; the file is mode=ro
            layout = source_layout(conn, "main", version, upgrades)
            for ident in _identities(conn, layout, output):
                _check_name(ident.name, output, "the output")
                ex.names[ident.name] = (ident.uid, ident.key)
                _check_sessions(conn, layout, ident, output)
                ex.clocks.append(_node_clock(conn, layout, ident, f"{output} (existing)",
                                             False))
            return ex
    finally:
        conn.close()


def _check_name(name: str, path: Path, what: str) -> None:
    """The node-name rule, for a name read from a file (``evil:node`` would be read back
    as node ``evil``, seq ``node:1``; a control character would reach every terminal)."""
    if not node_name_ok(name):
        raise StoreError(
            f"{what} {path} names a node {name[:80]!r}, which breaks the node-name rule: "
            f"{NODE_NAME_RULE}",
            f"rename it while merging: --force-node {path}=NEW-NAME" if what == "input"
            else "merge into a new output file")


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
        for node in src.nodes:
            if node.name:
                _check_name(node.name, src.path, "input")
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
