"""Offline merge: node databases copied off air-gapped machines, into one file.

The merged file has the current schema and one node key per node; every row keeps its
node-namespaced id (``node:seq``), so the analyzers and ``fleetd query`` work on it node
by node. What is carried: events and their args, stacks (once per content hash across
all inputs), trace sessions with their clock mappings and drop counters, processes,
threads, in-kernel histograms, causal chains with their whole history, and the ops
catalogue of each input.

Safety rules, each with a reason:

- Inputs are attached read-only (``mode=ro``); nothing is ever written to them.
- Node identity is the pair (name, uid). The same pair twice is the same node: its rows
  are inserted "or ignore" by id, so merging a file again adds nothing. The same name
  with another uid is another machine, refused, because its ids would collide.
- The output is built in a temporary file beside it and renamed over it only when
  every input is in. Ctrl-C, a full disk or a corrupt input leave the old output (or
  none) exactly as it was.
- Each input is copied inside one transaction, in batches of rows so that progress can
  be reported and an interrupt lands between two short statements.

Older inputs are converted on the fly: :data:`UPGRADES` maps a schema version to a step
that presents a version-``v`` file as version ``v + 1`` through TEMP views, so the file
itself stays untouched.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson

from fleetd.errors import StoreError, UsageError
from fleetd.store import schema
from fleetd.store.clockinfo import (
    SESSION_CLOCK_COLUMNS,
    NodeClock,
    clock_warnings,
    session_clock,
)
from fleetd.store.db import check_identity, open_reader, open_writer, validate_node_name

log = logging.getLogger("fleetd.store.merge")

SEQ_BITS = schema.SEQ_BITS
BATCH_IDS = 100_000  # id span copied per statement: short enough for a prompt Ctrl-C
BATCH_ROWS = 50_000  # rows per statement for tables batched by rowid or key
DEFAULT_CLOCK_THRESHOLD_NS = 10_000_000
MERGE_LOG_KEY = "merge_log"
# The merged file is temporary until renamed: no journal, no fsync per commit. A failed
# input discards the whole temporary file, so nothing ever needs rolling back.
_TEMP_PRAGMAS = ("PRAGMA journal_mode=OFF", "PRAGMA synchronous=OFF",
                 "PRAGMA cache_size=-32768", "PRAGMA temp_store=MEMORY")

TABLES: tuple[str, ...] = (
    "meta", "nodes", "sources", "ops", "session_data", "process_data", "task_data",
    "stacks", "event_data", "event_args", "aggregate_data", "chain_data",
)

# Where each table of an input is read from: a table of the attached file, or a TEMP
# view that converts an older layout.
Layout = dict[str, str]
Upgrade = Callable[[sqlite3.Connection, str, Layout], Layout]
# UPGRADES[v] presents a version-v file as version v + 1. Version 1 is the first
# released schema, so there is nothing to convert yet; the next migration in
# schema.MIGRATIONS adds its step here.
UPGRADES: dict[int, Upgrade] = {}


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
class InputReport:
    path: Path
    version: int
    nodes: list[str]
    forced: bool
    added: dict[str, int] = field(default_factory=dict)  # table -> rows new to the output


@dataclass(slots=True)
class MergeReport:
    output: Path
    inputs: list[InputReport]
    nodes: list[NodeClock]
    warnings: list[str]
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Progress:
    index: int  # 1-based input number
    inputs: int
    path: Path
    stage: str  # "events" while copying, "done" once the input is committed
    done: int
    total: int


ProgressFn = Callable[[Progress], None]


# ---- entry point ---------------------------------------------------------------------


def merge(
    inputs: Sequence[Path],
    output: Path,
    force_nodes: Sequence[str] = (),
    *,
    progress: ProgressFn | None = None,
    clock_threshold_ns: int = DEFAULT_CLOCK_THRESHOLD_NS,
) -> MergeReport:
    """Merge ``inputs`` into ``output`` (created, or extended if it exists)."""
    started = time.monotonic()
    paths = _check_paths(inputs, output)
    existing = _existing_output(output)
    sources = [_read_source(p) for p in paths]
    _apply_forced_names(sources, force_nodes)
    _assign_keys(sources, existing, output)
    # One entry per node: a node merged again is described by its newest copy.
    by_name = {c.name: c for c in existing.clocks}
    by_name.update((c.name, c) for s in sources for c in s.clocks)
    clocks = list(by_name.values())
    warnings = clock_warnings(clocks, clock_threshold_ns)
    warnings += [f"{s.path}: rows of node key(s) {s.orphan_keys} have no nodes row and are "
                 "left out" for s in sources if s.orphan_keys]
    reports = _build(output, existing, sources, progress)
    return MergeReport(output, reports, clocks, warnings, time.monotonic() - started)


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


def source_layout(conn: sqlite3.Connection, schema_name: str, version: int) -> Layout:
    """Where to read each table of a version-``version`` file attached as ``schema_name``."""
    layout: Layout = {t: f"{schema_name}.{t}" for t in TABLES}
    for v in range(version, schema.SCHEMA_VERSION):
        step = UPGRADES.get(v)
        if step is None:
            raise StoreError(
                f"schema version {version} cannot be converted: no upgrade from version {v}",
                "merge it with the fleetd release that recorded it, then merge that output",
            )
        layout = step(conn, schema_name, layout)
    return layout


def _read_source(path: Path) -> Source:
    conn = open_reader(path)  # refuses missing, corrupt, foreign, newer and empty files
    try:
        version = check_identity(conn, path)
        if version < schema.SCHEMA_VERSION:
            # TEMP views only; the file stays read-only through mode=ro.
            conn.execute("PRAGMA query_only=0")
        layout = source_layout(conn, "main", version)
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


@dataclass(slots=True)
class _Existing:
    """What the output already holds: node name -> (uid, key), and their clocks."""

    names: dict[str, tuple[str, int]] = field(default_factory=dict)
    clocks: list[NodeClock] = field(default_factory=list)
    fresh: bool = True  # no output yet (or an empty file): build from scratch


def _existing_output(output: Path) -> _Existing:
    if not output.exists() or output.stat().st_size == 0:
        return _Existing()
    conn = open_reader(output)
    try:
        ex = _Existing(fresh=False)
        version = check_identity(conn, output)
        if version < schema.SCHEMA_VERSION:
            conn.execute("PRAGMA query_only=0")  # TEMP views only; the file is mode=ro
        layout = source_layout(conn, "main", version)
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


def _assign_keys(sources: list[Source], existing: _Existing, output: Path) -> None:
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


# ---- building the output -------------------------------------------------------------


def _temp_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.{os.getpid()}.merging")


def _build(output: Path, existing: _Existing, sources: list[Source],
           progress: ProgressFn | None) -> list[InputReport]:
    tmp = _temp_path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    conn: sqlite3.Connection | None = None
    try:
        if not existing.fresh:
            _copy_existing(output, tmp)
        open_writer(tmp).close()  # creates the schema, or migrates an older output
        conn = _connect_temp(tmp)
        seen = {key for _, key in existing.names.values()}
        reports = []
        for i, src in enumerate(sources, 1):
            step = _Stepper(progress, i, len(sources), src)
            reports.append(_copy_source(conn, src, seen, step))
            seen.update(src.key_map.values())
        conn.close()
        conn = None
        _publish(tmp, output)
        return reports
    finally:
        if conn is not None:
            conn.close()
        for p in (tmp, Path(f"{tmp}-journal"), Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            with suppress(FileNotFoundError):
                p.unlink()


def _copy_existing(output: Path, tmp: Path) -> None:
    """Start from a consistent copy of the existing output (its WAL included)."""
    src = sqlite3.connect(f"file:{_uri_path(output)}?mode=ro", uri=True)
    dst = sqlite3.connect(tmp)
    try:
        src.backup(dst)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot copy the existing output {output}: {exc}",
                         "is a tracer or agent still writing it? merge into a new file") from exc
    finally:
        dst.close()
        src.close()


def _connect_temp(tmp: Path) -> sqlite3.Connection:
    # A URI connection, so that inputs can be attached with mode=ro.
    conn = sqlite3.connect(f"file:{_uri_path(tmp)}", uri=True, isolation_level=None)
    for pragma in _TEMP_PRAGMAS:
        conn.execute(pragma)
    return conn


def _publish(tmp: Path, output: Path) -> None:
    """Make the finished file durable, then swap it in atomically."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, output)
    # Sidecars of the old output belong to the old file; SQLite would apply a stale WAL
    # to the new one. Their content is already in the copy we started from.
    for side in ("-wal", "-shm"):
        with suppress(FileNotFoundError):
            Path(f"{output}{side}").unlink()
    dfd = os.open(output.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _uri_path(path: Path) -> str:
    # '?' and '#' would end the path part of a URI; '%' starts an escape.
    s = str(path.absolute())
    return s.replace("%", "%25").replace("?", "%3f").replace("#", "%23")


class _Stepper:
    """Progress of one input, throttled by the caller's callback."""

    def __init__(self, fn: ProgressFn | None, index: int, inputs: int, src: Source) -> None:
        self.fn, self.index, self.inputs, self.src = fn, index, inputs, src
        self.done = 0

    def __call__(self, stage: str, rows: int, total: int | None = None) -> None:
        self.done += rows
        if self.fn is not None:
            self.fn(Progress(self.index, self.inputs, self.src.path, stage, self.done,
                             max(self.done, total if total is not None else self.src.span_ids)))


@contextmanager
def _attached(conn: sqlite3.Connection, path: Path) -> Iterator[None]:
    uri = f"file:{_uri_path(path)}?mode=ro"
    try:
        conn.execute("ATTACH DATABASE ? AS src", (uri,))
    except sqlite3.Error:
        if os.access(path.parent, os.W_OK):
            raise
        # A WAL file on read-only media cannot get its -shm; nobody writes such a copy.
        conn.execute("ATTACH DATABASE ? AS src", (uri + "&immutable=1",))
    try:
        yield
    finally:
        if not conn.in_transaction:
            for (name,) in conn.execute(
                    "SELECT name FROM sqlite_temp_master WHERE type = 'view'").fetchall():
                conn.execute(f'DROP VIEW temp."{name}"')
            conn.execute("DETACH DATABASE src")


def _copy_source(conn: sqlite3.Connection, src: Source, seen: set[int],
                 step: _Stepper) -> InputReport:
    report = InputReport(src.path, src.version, [n.name for n in src.nodes], src.forced)
    try:
        with _attached(conn, src.path):
            layout = source_layout(conn, "src", src.version)
            conn.execute("BEGIN")
            add = report.added
            _copy_catalog(conn, layout)
            _copy_meta(conn, layout)
            add["nodes"] = _copy_nodes(conn, src, seen)
            add["stacks"] = _copy_stacks(conn, layout)
            for node in src.nodes:
                s, d = node.key, src.key_map[node.key]
                for table, n in _copy_node(conn, layout, s, d, d in seen, step).items():
                    add[table] = add.get(table, 0) + n
            _log_merge(conn, src, report)
            conn.execute("COMMIT")
        step("done", 0)
    except sqlite3.Error as exc:
        raise StoreError(
            f"merging {src.path} failed: {exc}",
            "if the input was copied off a node, copy it again (with its -wal file, or after "
            "the agent stopped); check the free space beside the output",
        ) from exc
    log.info("merged %s: %s", src.path, report.added)
    return report


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [str(r[1]) for r in conn.execute(f"PRAGMA main.table_info({table})")]


def _copy_catalog(conn: sqlite3.Connection, layout: Layout) -> None:
    # Op codes are stable forever: an op a newer writer added keeps its meaning here.
    for table in ("sources", "ops"):
        cols = ", ".join(_columns(conn, table))
        conn.execute(f"INSERT OR IGNORE INTO main.{table}({cols}) SELECT {cols} "
                     f"FROM {layout[table]}")


def _copy_meta(conn: sqlite3.Connection, layout: Layout) -> None:
    conn.execute(f"INSERT OR IGNORE INTO main.meta(key, value) SELECT key, value "
                 f"FROM {layout['meta']} WHERE key != ?", (MERGE_LOG_KEY,))


def _copy_nodes(conn: sqlite3.Connection, src: Source, seen: set[int]) -> int:
    """Register the input's nodes; a node merged before keeps its row (host filled in)."""
    for node in src.nodes:
        conn.execute(
            "INSERT INTO main.nodes(id, name, uid, machine_id, host, created_ns) "
            "VALUES (?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET "
            "machine_id = coalesce(machine_id, excluded.machine_id), "
            "host = coalesce(host, excluded.host)",
            (src.key_map[node.key], node.name, node.uid, node.machine_id, node.host,
             node.created_ns),
        )
    return sum(1 for n in src.nodes if src.key_map[n.key] not in seen)


def _copy_stacks(conn: sqlite3.Connection, layout: Layout) -> int:
    """Stacks are keyed by content hash: one copy, shared by every node that has it."""
    src = layout["stacks"]
    added, last = 0, None
    while True:
        bound = "" if last is None else "WHERE hash > ?"
        params: tuple[int, ...] = () if last is None else (last,)
        top = conn.execute(f"SELECT max(hash), count(*) FROM (SELECT hash FROM {src} {bound} "
                           f"ORDER BY hash LIMIT {BATCH_ROWS})", params).fetchone()
        if top[0] is None:
            return added
        where = "hash <= ?" if last is None else "hash > ? AND hash <= ?"
        cur = conn.execute(f"INSERT OR IGNORE INTO main.stacks(hash, frames) SELECT hash, frames "
                           f"FROM {src} WHERE {where}", (*params, top[0]))
        added += cur.rowcount
        last = int(top[0])


def _copy_node(conn: sqlite3.Connection, layout: Layout, s: int, d: int, existed: bool,
               step: _Stepper) -> dict[str, int]:
    """Every row of node key ``s`` of the input, as node key ``d`` of the output."""
    delta = (d - s) << SEQ_BITS
    return {
        "events": _copy_id_range(conn, layout, "event_data", s, delta, step),
        "event_args": _copy_id_range(conn, layout, "event_args", s, delta, None),
        "sessions": _upsert(conn, layout, "session_data", ("node", "seq"), s, d, _SESSION_SET),
        "processes": _upsert(conn, layout, "process_data", ("node", "pid"), s, d, None),
        "threads": _upsert(conn, layout, "task_data", ("node", "tid"), s, d, None),
        "chains": _copy_chains(conn, layout, s, d),
        "aggregates": _copy_aggregates(conn, layout, s, d, existed),
    }


def _copy_id_range(conn: sqlite3.Connection, layout: Layout, table: str, s: int, delta: int,
                   step: _Stepper | None) -> int:
    """Rows of one node key, in id order, ``BATCH_IDS`` ids per statement."""
    src = layout[table]
    cols = _columns(conn, table)
    select = ", ".join("id + ?" if c == "id" else c for c in cols)
    insert = (f"INSERT OR IGNORE INTO main.{table}({', '.join(cols)}) SELECT {select} "
              f"FROM {src} WHERE id >= ? AND id < ?")
    seek = f"SELECT min(id) FROM {src} WHERE id >= ? AND id < ?"
    end = (s + 1) << SEQ_BITS
    top = conn.execute(f"SELECT max(id) FROM {src} WHERE id < ?", (end,)).fetchone()[0]
    added = 0
    lo = conn.execute(seek, (s << SEQ_BITS, end)).fetchone()[0]
    while lo is not None:
        hi = min(int(lo) + BATCH_IDS, end)
        cur = conn.execute(insert, (delta, lo, hi))
        added += cur.rowcount
        if step is not None:
            step("events", min(hi, int(top) + 1) - int(lo))
        # Jump over gaps in the ids (pruned ranges) instead of walking them.
        lo = conn.execute(seek, (hi, end)).fetchone()[0]
    return added


# Sessions: the copy that got further (a later copy of a live node) wins; equal is a no-op.
_SESSION_SET = (
    "WHERE coalesce(excluded.ended_ns, excluded.started_ns) >= "
    "coalesce(session_data.ended_ns, session_data.started_ns)"
)


def _upsert(conn: sqlite3.Connection, layout: Layout, table: str, key: tuple[str, str],
            s: int, d: int, where: str | None) -> int:
    """Insert the node's rows; a row already there is updated (``where``) or filled in."""
    cols = [c for c in _columns(conn, table) if c not in key]
    if where is None:
        # Later facts fill in what earlier ones lacked, never blank out what is known.
        sets = ", ".join(f"{c} = coalesce({table}.{c}, excluded.{c})" for c in cols)
        where = ""
    else:
        sets = ", ".join(f"{c} = excluded.{c}" for c in cols)
    count = f"SELECT count(*) FROM main.{table} WHERE node = ?"
    before = conn.execute(count, (d,)).fetchone()[0]
    conn.execute(
        f"INSERT INTO main.{table}({', '.join(key)}, {', '.join(cols)}) "
        f"SELECT ?, {key[1]}, {', '.join(cols)} FROM {layout[table]} WHERE node = ? "
        f"ON CONFLICT({', '.join(key)}) DO UPDATE SET {sets} {where}",
        (d, s),
    )
    # Rows new to the output; updates of rows already there are not counted.
    return int(conn.execute(count, (d,)).fetchone()[0] - before)


def _copy_chains(conn: sqlite3.Connection, layout: Layout, s: int, d: int) -> int:
    # Every version of every chain: a chain version never changes once written.
    cols = [c for c in _columns(conn, "chain_data") if c != "node"]
    cur = conn.execute(
        f"INSERT OR IGNORE INTO main.chain_data(node, {', '.join(cols)}) "
        f"SELECT ?, {', '.join(cols)} FROM {layout['chain_data']} WHERE node = ?", (d, s))
    return cur.rowcount


_AGG_SAME = (
    "NOT EXISTS (SELECT 1 FROM main.aggregate_data b WHERE b.node = ? AND b.op = a.op "
    "AND b.ts_ns = a.ts_ns AND b.dur_ns = a.dur_ns AND b.bucket = a.bucket "
    "AND b.pid IS a.pid AND b.session IS a.session)"
)


def _copy_aggregates(conn: sqlite3.Connection, layout: Layout, s: int, d: int,
                     existed: bool) -> int:
    """Histogram rows have no id: for a node the output already has, a row whose window,
    process, op and bucket are there is the same row merged before, and is skipped."""
    src = layout["aggregate_data"]
    cols = [c for c in _columns(conn, "aggregate_data") if c != "node"]
    select = ", ".join(f"a.{c}" for c in cols)
    dedupe = f" AND {_AGG_SAME}" if existed else ""
    insert = (f"INSERT INTO main.aggregate_data(node, {', '.join(cols)}) SELECT ?, {select} "
              f"FROM {src} a WHERE a.node = ? AND a.rowid >= ? AND a.rowid < ?{dedupe}")
    seek = f"SELECT min(rowid) FROM {src} WHERE rowid >= ?"
    added = 0
    lo = conn.execute(seek, (-(2**63),)).fetchone()[0]
    while lo is not None:
        hi = int(lo) + BATCH_ROWS
        params = (d, s, lo, hi, d) if existed else (d, s, lo, hi)
        added += conn.execute(insert, params).rowcount
        lo = conn.execute(seek, (hi,)).fetchone()[0]
    return added


def _log_merge(conn: sqlite3.Connection, src: Source, report: InputReport) -> None:
    """Keep where each part of the merged file came from (appended, never rewritten)."""
    row = conn.execute("SELECT value FROM main.meta WHERE key = ?", (MERGE_LOG_KEY,)).fetchone()
    entries = orjson.loads(row[0]) if row else []
    entries.append({
        "merged_ns": time.time_ns(), "input": str(src.path.absolute()),
        "schema_version": src.version, "nodes": report.nodes, "forced_name": src.forced,
        "added": report.added,
    })
    conn.execute("INSERT OR REPLACE INTO main.meta(key, value) VALUES (?, ?)",
                 (MERGE_LOG_KEY, orjson.dumps(entries).decode()))
