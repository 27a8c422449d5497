"""The node store's SQLite schema, its versions and forward migrations.

Raw tables (``*_data``) are shaped for fast inserts: integer op codes, integer node
keys, one 64-bit row id per event. Users query the views (``events``, ``sessions``,
``chains``...) that join names in, so ``WHERE op = 'cudaLaunchKernel' AND node =
'gpu-01'`` works without knowing any code.

Event ids are ``node_key << 40 | seq``: unique inside one file, stable across
restarts (seq continues from the largest stored one), and merge-safe, because a
merged file gives every node its own key. The views print them as ``node:seq``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from fleetd.store.catalog import OPS, SOURCES
from fleetd.store.sparse import SPARSE_INDEX_SQL

APPLICATION_ID = 0x666C7464  # "fltd": tells our files from any other SQLite file
SCHEMA_VERSION = 9
SEQ_BITS = 40
SEQ_MASK = (1 << SEQ_BITS) - 1

# The order of values in an event row handed to the writer (the writer adds id, node).
EVENT_FIELDS: tuple[str, ...] = (
    "ts_ns", "dur_ns", "pid", "tid", "op", "ret", "bytes", "peer", "a0", "a1", "stack",
)
EventRow = tuple[int, int, int, int, int, int, int, int, int, int, int]
# An event's args: a mapping, or its JSON text already made (repeated kernel launches).
EventArgs = Mapping[str, Any] | str


class FdHolder(TypedDict):
    """A process holding the other end of the pipe, FIFO or socket a thread slept on."""

    pid: int
    comm: str | None
    mode: str  # "r", "w" or "rw": how that process opened it


class FdInfo(TypedDict, total=False):
    """``args.fd`` of an off-CPU record that slept in a read or a write
    (:mod:`fleetd.trace.enrich.fdpeers`)."""

    path: str  # the fd's link text: pipe:[N], socket:[N], /dev/pts/3, a file's path
    kind: str  # pipe, fifo, socket, tty, file
    peers: list[FdHolder]  # other processes holding the same pipe, FIFO or socket
    remote: str  # a TCP/UDP socket's peer address, host:port
    local: str  # and its own


class RecordArgs(TypedDict, total=False):
    """A traced record's ``event_args.args`` (docs/schema.md): what the decoder
    unpacks from the record (:mod:`fleetd.trace.bpf.decoder`) and the enrichers add in
    user space. Handles are hex text; a key is there only when it has something to say."""

    # kernel launches (and the kernel's name, added once it is resolved)
    grid: list[int]
    block: list[int]
    shared_mem: int
    stream: str
    kernel: str
    # other CUDA calls' handles, and a capture's mode
    event: str
    ptr: str
    graph: str
    exec: str
    mode: int
    # NCCL calls: a datatype or reduction op past the known ones stays its number
    dtype: str | int
    comm: str
    redop: str | int
    seq: int
    comm_hash: str
    rank: int
    nranks: int
    parent: str
    color: int
    key: int
    # block I/O
    rw: str
    queued_ns: int
    # a call that was slow for its kind: the kind's median
    median_ns: int
    # off-CPU: the lock (futex), the kernel wait (D state), the fd slept on
    lock: str
    wchan: str
    kstack: list[str]
    fd: FdInfo

_V1 = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE nodes (
    id         INTEGER PRIMARY KEY,          -- the node key inside this file
    name       TEXT NOT NULL UNIQUE,
    uid        TEXT NOT NULL,                -- random, made with the node's first database
    machine_id TEXT,
    host       TEXT,
    created_ns INTEGER NOT NULL
);
CREATE TABLE sources (
    name        TEXT PRIMARY KEY,
    description TEXT NOT NULL
);
CREATE TABLE ops (
    code   INTEGER PRIMARY KEY,
    name   TEXT NOT NULL UNIQUE,
    source TEXT NOT NULL REFERENCES sources(name),
    kind   TEXT NOT NULL,
    a0     TEXT,                             -- meaning of event a0 for this op
    a1     TEXT
);
CREATE TABLE session_data (
    node            INTEGER NOT NULL REFERENCES nodes(id),
    seq             INTEGER NOT NULL,
    host            TEXT,
    kernel          TEXT,
    boot_id         TEXT,
    started_ns      INTEGER NOT NULL,        -- wall clock, UTC
    ended_ns        INTEGER,
    mono_offset_ns  INTEGER NOT NULL,        -- wall = monotonic + offset
    clock_error_ns  INTEGER,                 -- sampling window + adjtimex max error
    clock_samples   TEXT,                    -- JSON [[mono_ns, offset_ns, error_ns], ...]
    rank            INTEGER,
    local_rank      INTEGER,
    world_size      INTEGER,
    tool_version    TEXT NOT NULL,
    schema_version  INTEGER NOT NULL,
    lost_events     INTEGER NOT NULL DEFAULT 0,
    dropped_stacks  INTEGER NOT NULL DEFAULT 0,
    sampled_out     INTEGER NOT NULL DEFAULT 0,  -- events kept only in histograms, by design
    drops           TEXT,                    -- JSON {layer: lost}
    targets         TEXT,                    -- JSON: pids, cgroups, libraries attached
    headers_route   TEXT,
    command         TEXT,
    PRIMARY KEY (node, seq)
) WITHOUT ROWID;
CREATE TABLE process_data (
    node       INTEGER NOT NULL REFERENCES nodes(id),
    pid        INTEGER NOT NULL,
    ppid       INTEGER,
    comm       TEXT,
    exe        TEXT,
    cmdline    TEXT,
    rank       INTEGER,
    local_rank INTEGER,
    world_size INTEGER,
    start_ns   INTEGER,
    exit_ns    INTEGER,
    exit_code  INTEGER,
    PRIMARY KEY (node, pid)
) WITHOUT ROWID;
CREATE TABLE task_data (
    node INTEGER NOT NULL REFERENCES nodes(id),
    tid  INTEGER NOT NULL,
    pid  INTEGER,
    comm TEXT,
    PRIMARY KEY (node, tid)
) WITHOUT ROWID;
CREATE TABLE stacks (
    hash   INTEGER PRIMARY KEY,              -- 64-bit content hash, shared across nodes
    frames TEXT NOT NULL                     -- JSON list of symbolized frames, innermost first
);
-- Only integers, no NULLs: binding None costs Python's sqlite3 an adaptation lookup per
-- value, which halves insert speed. 0 means "none" in every column but ts_ns/dur_ns.
CREATE TABLE event_data (
    id     INTEGER PRIMARY KEY,              -- node_key << 40 | seq
    ts_ns  INTEGER NOT NULL,                 -- wall clock UTC of the start
    dur_ns INTEGER NOT NULL,                 -- 0 for instants
    pid    INTEGER NOT NULL,
    tid    INTEGER NOT NULL,
    op     INTEGER NOT NULL,
    ret    INTEGER NOT NULL,                 -- return code (0 = success)
    bytes  INTEGER NOT NULL,
    peer   INTEGER NOT NULL,                 -- the other task (tid): who ran instead, who woke us
    a0     INTEGER NOT NULL,                 -- op-specific, see ops.a0 / ops.a1
    a1     INTEGER NOT NULL,
    stack  INTEGER NOT NULL                  -- stacks.hash, 0 = none
);
-- The few events with extras (grid/block dims, stream, ...) keep them here.
CREATE TABLE event_args (
    id   INTEGER PRIMARY KEY,                -- event_data.id
    args TEXT NOT NULL                       -- JSON object
);
CREATE INDEX event_ts ON event_data(ts_ns);
CREATE TABLE aggregate_data (
    node    INTEGER NOT NULL,
    session INTEGER,
    ts_ns   INTEGER NOT NULL,                -- window start
    dur_ns  INTEGER NOT NULL,                -- window length
    pid     INTEGER,
    op      INTEGER NOT NULL,
    bucket  INTEGER NOT NULL,                -- log2(latency ns) bucket, or -1 for totals
    count   INTEGER NOT NULL,
    sum     INTEGER NOT NULL                 -- ns for latencies, pages for page_alloc
);
CREATE INDEX aggregate_op ON aggregate_data(node, op, ts_ns);
CREATE TABLE chain_data (
    node         INTEGER NOT NULL,
    seq          INTEGER NOT NULL,
    key          TEXT NOT NULL,              -- the same problem keeps its key across versions
    version      INTEGER NOT NULL,
    created_ns   INTEGER NOT NULL,
    ts_ns        INTEGER NOT NULL,
    dur_ns       INTEGER NOT NULL,
    severity     TEXT NOT NULL CHECK (severity IN ('HIGH', 'MEDIUM', 'LOW')),
    root_cause   TEXT NOT NULL,
    summary      TEXT NOT NULL,
    op           TEXT,
    victim_pid   INTEGER,
    victim_tid   INTEGER,
    victim_comm  TEXT,
    culprit_pid  INTEGER,
    culprit_comm TEXT,
    explained    REAL,                       -- share of the spike the evidence covers
    impact       REAL,                       -- share of total time affected
    evidence     TEXT NOT NULL,              -- JSON list
    fixes        TEXT NOT NULL,              -- JSON list of strings
    PRIMARY KEY (node, seq),
    UNIQUE (node, key, version)
) WITHOUT ROWID;

CREATE VIEW events AS
SELECT n.name || ':' || (e.id & 1099511627775) AS id,
       n.name AS node, e.ts_ns, e.dur_ns, e.pid, e.tid,
       p.comm AS comm, t.comm AS thread, o.source AS source, o.name AS op,
       e.ret, e.bytes, e.peer, pt.pid AS peer_pid, pt.comm AS peer_comm, e.a0, e.a1,
       e.stack, x.args, p.rank AS rank, e.op AS op_code, e.id AS rowkey
FROM event_data e
JOIN nodes n ON n.id = (e.id >> 40)
JOIN ops o ON o.code = e.op
LEFT JOIN process_data p ON p.node = n.id AND p.pid = e.pid
LEFT JOIN task_data t ON t.node = n.id AND t.tid = e.tid
LEFT JOIN task_data pt ON pt.node = n.id AND pt.tid = e.peer AND e.peer != 0
LEFT JOIN event_args x ON x.id = e.id;

CREATE VIEW sessions AS
SELECT n.name || ':' || s.seq AS id, n.name AS node, s.seq, s.host, s.kernel, s.boot_id,
       s.started_ns, s.ended_ns, s.mono_offset_ns, s.clock_error_ns, s.clock_samples, s.rank,
       s.local_rank, s.world_size, s.tool_version, s.schema_version, s.lost_events,
       s.dropped_stacks, s.sampled_out, s.drops, s.targets, s.headers_route, s.command
FROM session_data s JOIN nodes n ON n.id = s.node;

CREATE VIEW processes AS
SELECT n.name AS node, p.pid, p.ppid, p.comm, p.exe, p.cmdline, p.rank, p.local_rank,
       p.world_size, p.start_ns, p.exit_ns, p.exit_code
FROM process_data p JOIN nodes n ON n.id = p.node;

CREATE VIEW threads AS
SELECT n.name AS node, t.tid, t.pid, t.comm
FROM task_data t JOIN nodes n ON n.id = t.node;

CREATE VIEW aggregates AS
SELECT n.name AS node, a.session, a.ts_ns, a.dur_ns, a.pid, o.source, o.name AS op,
       a.bucket, a.count, a.sum
FROM aggregate_data a JOIN nodes n ON n.id = a.node JOIN ops o ON o.code = a.op;

CREATE VIEW chain_history AS
SELECT n.name || ':' || c.seq AS id, n.name AS node, c.key, c.version, c.created_ns,
       c.ts_ns, c.dur_ns, c.severity, c.root_cause, c.summary, c.op, c.victim_pid,
       c.victim_tid, c.victim_comm, c.culprit_pid, c.culprit_comm, c.explained, c.impact,
       c.evidence, c.fixes
FROM chain_data c JOIN nodes n ON n.id = c.node;

CREATE VIEW chains AS
SELECT h.* FROM chain_history h
WHERE h.version = (SELECT max(c2.version) FROM chain_data c2
                   JOIN nodes n2 ON n2.id = c2.node
                   WHERE n2.name = h.node AND c2.key = h.key);
"""

# Version 2: the GPU side, read from imported profiler files (``fleetd import``): what
# ran on each device and stream, the annotations (NVTX, profiler steps, operators) of the
# host threads, and the names they share. Ids are node-namespaced like events' (each
# table counts its own seq), so merge copies them the same way.
_V2 = """
CREATE TABLE gpu_names (
    hash INTEGER PRIMARY KEY,                -- 63-bit content hash of the name
    name TEXT NOT NULL
);
-- One row per kernel, copy, set or synchronization the device ran. Integers only, for
-- the writer's speed; 0 means "none" except in device and stream.
CREATE TABLE gpu_data (
    id          INTEGER PRIMARY KEY,         -- node_key << 40 | seq
    session     INTEGER NOT NULL,            -- session_data.seq of the import
    ts_ns       INTEGER NOT NULL,            -- wall clock UTC of the start on the GPU
    dur_ns      INTEGER NOT NULL,
    pid         INTEGER NOT NULL,            -- the host process that launched it
    device      INTEGER NOT NULL,
    stream      INTEGER NOT NULL,
    kind        INTEGER NOT NULL,            -- 1 kernel, 2 memcpy, 3 memset, 4 sync
    name        INTEGER NOT NULL,            -- gpu_names.hash
    correlation INTEGER NOT NULL,            -- the launch call's correlation id
    launch      INTEGER NOT NULL,            -- seq of the launch call in event_data, 0 none
    bytes       INTEGER NOT NULL,
    collective  INTEGER NOT NULL,            -- gpu_names.hash of the NCCL collective, 0 none
    grid_x INTEGER NOT NULL, grid_y INTEGER NOT NULL, grid_z INTEGER NOT NULL,
    block_x INTEGER NOT NULL, block_y INTEGER NOT NULL, block_z INTEGER NOT NULL
);
CREATE INDEX gpu_ts ON gpu_data(ts_ns);
-- Ranges the host marked: NVTX ranges, profiler steps, user annotations, operators.
CREATE TABLE annotation_data (
    id      INTEGER PRIMARY KEY,             -- node_key << 40 | seq
    session INTEGER NOT NULL,
    ts_ns   INTEGER NOT NULL,
    dur_ns  INTEGER NOT NULL,
    pid     INTEGER NOT NULL,
    tid     INTEGER NOT NULL,
    kind    INTEGER NOT NULL,                -- 1 step, 2 nvtx, 3 user_annotation, 4 cpu_op
    name    INTEGER NOT NULL                 -- gpu_names.hash
);
CREATE INDEX annotation_ts ON annotation_data(ts_ns);

CREATE VIEW gpu_activity AS
SELECT n.name || ':' || (g.id & 1099511627775) AS id, n.name AS node, g.session,
       g.ts_ns, g.dur_ns, g.pid, p.rank AS rank, g.device, g.stream,
       CASE g.kind WHEN 1 THEN 'kernel' WHEN 2 THEN 'memcpy' WHEN 3 THEN 'memset'
                   WHEN 4 THEN 'sync' END AS kind,
       s.name AS name, g.correlation,
       CASE WHEN g.launch != 0 THEN n.name || ':' || g.launch END AS launch_id,
       g.bytes, c.name AS collective, g.grid_x, g.grid_y, g.grid_z, g.block_x, g.block_y,
       g.block_z, g.id AS rowkey
FROM gpu_data g
JOIN nodes n ON n.id = (g.id >> 40)
LEFT JOIN gpu_names s ON s.hash = g.name
LEFT JOIN gpu_names c ON c.hash = g.collective AND g.collective != 0
LEFT JOIN process_data p ON p.node = n.id AND p.pid = g.pid;

CREATE VIEW gpu_kernels AS
SELECT id, node, session, ts_ns, dur_ns, pid, rank, device, stream, name AS kernel,
       collective, correlation, launch_id, grid_x, grid_y, grid_z, block_x, block_y,
       block_z, rowkey
FROM gpu_activity WHERE kind = 'kernel';

CREATE VIEW gpu_copies AS
SELECT id, node, session, ts_ns, dur_ns, pid, rank, device, stream, kind, name, bytes,
       correlation, launch_id, rowkey
FROM gpu_activity WHERE kind IN ('memcpy', 'memset');

-- Each kernel or copy beside the host call that launched it.
CREATE VIEW gpu_launches AS
SELECT g.id, g.node, g.pid, g.rank, g.device, g.stream, g.kind, g.name, g.correlation,
       g.launch_id, e.tid, o.name AS launch_op, e.ts_ns AS launch_ts_ns,
       e.dur_ns AS launch_dur_ns, g.ts_ns, g.dur_ns,
       g.ts_ns - e.ts_ns AS launch_delay_ns,
       max(0, g.ts_ns - e.ts_ns - e.dur_ns) AS queue_delay_ns
FROM gpu_activity g
JOIN gpu_data r ON r.id = g.rowkey AND r.launch != 0
JOIN event_data e ON e.id = ((r.id >> 40) << 40) | r.launch
JOIN ops o ON o.code = e.op;

CREATE VIEW annotations AS
SELECT n.name || ':' || (a.id & 1099511627775) AS id, n.name AS node, a.session, a.ts_ns,
       a.dur_ns, a.pid, a.tid, p.rank AS rank,
       CASE a.kind WHEN 1 THEN 'step' WHEN 2 THEN 'nvtx' WHEN 3 THEN 'user_annotation'
                   WHEN 4 THEN 'cpu_op' END AS kind,
       s.name AS name, a.id AS rowkey
FROM annotation_data a
JOIN nodes n ON n.id = (a.id >> 40)
LEFT JOIN gpu_names s ON s.hash = a.name
LEFT JOIN process_data p ON p.node = n.id AND p.pid = a.pid;

-- Where each session came from: a recording, or an imported file (the targets JSON of
-- an import holds {"import": {"format", "path", "sha256", ...}}).
CREATE VIEW imports AS
SELECT n.name AS node, s.seq AS session, json_extract(s.targets, '$.import.format') AS format,
       json_extract(s.targets, '$.import.path') AS path,
       json_extract(s.targets, '$.import.sha256') AS sha256,
       s.started_ns, s.ended_ns, s.mono_offset_ns, s.clock_error_ns, s.rank, s.world_size
FROM session_data s JOIN nodes n ON n.id = s.node
WHERE json_extract(s.targets, '$.import') IS NOT NULL;
"""

# Version 3: the job a process belongs to (torchrun's TORCHELASTIC_RUN_ID, else
# MASTER_ADDR:MASTER_PORT), so that ranks of one job match across nodes when no NCCL
# communicator exists. Older files read as before; their processes have no job.
# Sessions gain what a crash leaves behind: at each commit the writer records the
# kernel's emitted count and the events it accounted for (stored, or counted as lost),
# so the next session can close a killed one as crashed with what it lost.
_V3 = """
ALTER TABLE process_data ADD COLUMN job TEXT;
ALTER TABLE session_data ADD COLUMN updated_ns INTEGER;
ALTER TABLE session_data ADD COLUMN emitted_events INTEGER;
ALTER TABLE session_data ADD COLUMN accounted_events INTEGER;
ALTER TABLE session_data ADD COLUMN end_reason TEXT;
DROP VIEW sessions;
CREATE VIEW sessions AS
SELECT n.name || ':' || s.seq AS id, n.name AS node, s.seq, s.host, s.kernel, s.boot_id,
       s.started_ns, s.ended_ns, s.mono_offset_ns, s.clock_error_ns, s.clock_samples, s.rank,
       s.local_rank, s.world_size, s.tool_version, s.schema_version, s.lost_events,
       s.dropped_stacks, s.sampled_out, s.drops, s.targets, s.headers_route, s.command,
       s.end_reason, s.updated_ns, s.emitted_events, s.accounted_events
FROM session_data s JOIN nodes n ON n.id = s.node;
DROP VIEW processes;
CREATE VIEW processes AS
SELECT n.name AS node, p.pid, p.ppid, p.comm, p.exe, p.cmdline, p.rank, p.local_rank,
       p.world_size, p.start_ns, p.exit_ns, p.exit_code, p.job
FROM process_data p JOIN nodes n ON n.id = p.node;
"""

# Version 4: the events view looks names up with scalar subqueries instead of LEFT
# JOINs. SQLite drops an unused LEFT JOIN only from a plain SELECT, never under GROUP
# BY, so ``SELECT op, count(*) FROM events GROUP BY op`` paid four index lookups per
# row for columns it never read (1.6 ms against 0.9 ms on 2,000 events); a subquery runs
# only for a column the query reads. The rows are the same: each lookup is on a key.
_V4 = """
DROP VIEW events;
CREATE VIEW events AS
SELECT n.name || ':' || (e.id & 1099511627775) AS id,
       n.name AS node, e.ts_ns, e.dur_ns, e.pid, e.tid,
       (SELECT p.comm FROM process_data p WHERE p.node = n.id AND p.pid = e.pid) AS comm,
       (SELECT t.comm FROM task_data t WHERE t.node = n.id AND t.tid = e.tid) AS thread,
       o.source AS source, o.name AS op, e.ret, e.bytes, e.peer,
       (SELECT t.pid FROM task_data t WHERE e.peer != 0 AND t.node = n.id AND t.tid = e.peer)
           AS peer_pid,
       (SELECT t.comm FROM task_data t WHERE e.peer != 0 AND t.node = n.id AND t.tid = e.peer)
           AS peer_comm,
       e.a0, e.a1, e.stack, (SELECT x.args FROM event_args x WHERE x.id = e.id) AS args,
       (SELECT p.rank FROM process_data p WHERE p.node = n.id AND p.pid = e.pid) AS rank,
       e.op AS op_code, e.id AS rowkey
FROM event_data e
JOIN nodes n ON n.id = (e.id >> 40)
JOIN ops o ON o.code = e.op;
"""

# Version 5: where each process runs, stored once per process: the cgroup that carries
# its CPU controller, and the container and Kubernetes pod its cgroup path and the
# container runtime's files name (fleetd.trace.host.cgroups). Older files read as before;
# their processes have no placement (NULL).
PlacementColumn = Literal["cgroup", "runtime", "container", "container_name", "pod",
                          "namespace", "pod_uid"]
PLACEMENT_COLUMNS: tuple[PlacementColumn, ...] = (
    "cgroup", "runtime", "container", "container_name", "pod", "namespace", "pod_uid")


class ProcessPlacement(TypedDict):
    """A process's placement columns, each None when unknown
    (:func:`fleetd.trace.host.cgroups.process_placement`)."""

    cgroup: str | None  # the cgroup carrying its CPU controller
    runtime: str | None
    container: str | None  # the container id, 12 hex
    container_name: str | None
    pod: str | None
    namespace: str | None
    pod_uid: str | None


class ProcessFields(TypedDict, total=False):
    """A processes row as a writer takes it (process_data's columns by name): what is
    known of the process; a fact left out (or None) keeps the one stored before."""

    pid: int
    ppid: int | None
    comm: str | None
    exe: str | None
    cmdline: str | None
    rank: int | None
    local_rank: int | None
    world_size: int | None
    start_ns: int | None
    exit_ns: int | None
    exit_code: int | None
    job: str | None
    # placement (PLACEMENT_COLUMNS)
    cgroup: str | None
    runtime: str | None
    container: str | None
    container_name: str | None
    pod: str | None
    namespace: str | None
    pod_uid: str | None
_V5 = "".join(f"ALTER TABLE process_data ADD COLUMN {c} TEXT;\n" for c in PLACEMENT_COLUMNS) \
    + """DROP VIEW processes;
CREATE VIEW processes AS
SELECT n.name AS node, p.pid, p.ppid, p.comm, p.exe, p.cmdline, p.rank, p.local_rank,
       p.world_size, p.start_ns, p.exit_ns, p.exit_code, p.job, p.cgroup, p.runtime,
       p.container, p.container_name, p.pod, p.namespace, p.pod_uid
FROM process_data p JOIN nodes n ON n.id = p.node;
"""

# Version 6: no change. Indexes on event_data(pid, op, ts_ns) and (tid, op, ts_ns) made
# explain on a 10-minute, 7 M-event file much faster, but doubled the writer's cost per
# row (test_store_writer's 4-thread load dropped rows) and grew the file 69%: an agent
# writes all the time and explains rarely, so they were withdrawn (docs/performance.md).
# The version stays (files at 6 exist); it creates nothing.
_V6 = ""

# Version 7: task_seen, the newest event id naming each thread or process id when the
# writer stored it (fleetd.store.taskrefs), so that pruning can delete the task_data and
# process_data rows no stored event names any more (there is no index on event_data's
# pid, tid or peer: see version 6). Rows already stored are given the newest event id of
# their node: kept until every event stored before the migration is pruned.
_SEEN_NEWEST = ("SELECT coalesce(max(e.id), 0) FROM event_data e WHERE e.id BETWEEN "
                "{t}.node << 40 AND ({t}.node << 40) + 1099511627775")
_V7 = f"""
CREATE TABLE task_seen (
    node    INTEGER NOT NULL,
    id      INTEGER NOT NULL,                -- a tid or a pid (the kernel numbers them alike)
    last_id INTEGER NOT NULL,                -- event_data.id: the newest naming it
    PRIMARY KEY (node, id)
) WITHOUT ROWID;
INSERT OR IGNORE INTO task_seen(node, id, last_id)
SELECT t.node, t.tid, ({_SEEN_NEWEST.format(t="t")}) FROM task_data t;
INSERT OR IGNORE INTO task_seen(node, id, last_id)
SELECT p.node, p.pid, ({_SEEN_NEWEST.format(t="p")}) FROM process_data p;
"""

# Version 8: event_sparse, a partial index on (op, ts_ns) of the sparse sources' rows
# only (NCCL, graphs, memory, block I/O, processes, cgroup and CPU samples), so that a
# read of a rare op does not walk every event of the window; the dense ones (CUDA calls,
# the scheduler, interrupts, syscalls) stay out of it and cost the writer one test of
# the condition each (fleetd.store.sparse, docs/performance.md).
_V8 = SPARSE_INDEX_SQL

# Version 9: second_sums and second_cover, per-second sums of each node's timed events
# that the writer makes in its idle time and explain's grouped read uses for the whole
# seconds still true of the file (fleetd.store.summaries, docs/performance.md).
_V9 = """
CREATE TABLE second_cover (
    node     INTEGER NOT NULL,
    sec      INTEGER NOT NULL,               -- ts_ns // 1e9
    n        INTEGER NOT NULL,               -- the node's events starting in it, when summed
    top_id   INTEGER NOT NULL,               -- the largest of their ids
    first_ns INTEGER NOT NULL,               -- the earliest start
    end_ns   INTEGER NOT NULL,               -- the latest ts_ns + dur_ns
    PRIMARY KEY (node, sec)
) WITHOUT ROWID;
CREATE TABLE second_sums (
    node     INTEGER NOT NULL,
    sec      INTEGER NOT NULL,
    tid      INTEGER NOT NULL,
    pid      INTEGER NOT NULL,
    op       INTEGER NOT NULL,
    state    INTEGER NOT NULL,               -- a0 & 255 of off_cpu and runq_wait, else 0
    wret     INTEGER NOT NULL,               -- ret of off_cpu and runq_wait, else 0
    n        INTEGER NOT NULL,
    total    INTEGER NOT NULL,               -- sum of dur_ns
    top      INTEGER NOT NULL,               -- the largest dur_ns
    failed   INTEGER NOT NULL,               -- of them with an error
    nbytes   INTEGER NOT NULL,               -- a reclaim run's bytes, summed
    first_ns INTEGER NOT NULL,
    end_ns   INTEGER NOT NULL,
    PRIMARY KEY (node, sec, tid, pid, op, state, wret)
) WITHOUT ROWID;
"""

# Index i holds the SQL that takes a database from version i to i + 1.
MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3, _V4, _V5, _V6, _V7, _V8, _V9)
assert len(MIGRATIONS) == SCHEMA_VERSION


def seed_catalog(conn: sqlite3.Connection) -> None:
    """(Re)write the sources and ops lookups; new ops appear in old files this way."""
    conn.executemany(
        "INSERT OR REPLACE INTO sources(name, description) VALUES (?, ?)", SOURCES.items()
    )
    conn.executemany(
        "INSERT OR REPLACE INTO ops(code, name, source, kind, a0, a1) VALUES (?,?,?,?,?,?)",
        [(o.code, o.name, o.source, o.kind, o.a0, o.a1) for o in OPS],
    )


def migrate(conn: sqlite3.Connection, from_version: int) -> None:
    """Apply every migration after ``from_version`` in one transaction."""
    steps: Sequence[str] = MIGRATIONS[from_version:]
    conn.execute("BEGIN IMMEDIATE")
    try:
        for sql in steps:
            for stmt in _statements(sql):
                conn.execute(stmt)
        seed_catalog(conn)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _statements(script: str) -> list[str]:
    """Split a migration script into statements (executescript would commit for us)."""
    out: list[str] = []
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out
