"""A node's ``GET /api/v1/collectives`` answer, checked before arrivals are compared.

Untrusted like every answer: a node of another version, a broken one or an impostor
with a valid certificate may send anything up to the client's body limit, and the
matching groups by its strings and sorts by its numbers. So every row is rebuilt here
from checked values (types, ranges, the op one of the five collectives, the
communicator's hash and pointer as hex of the documented width, process names made
printable and cut), rows beyond the limit asked for are cut, and lists are capped. One
bad value rejects that node's arrivals (:class:`~fleetd.wire.failure.BadReply`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fleetd.analyze.distributed import collectives as coll
from fleetd.wire.failure import BadReply
from fleetd.wire.limits import INT64_MAX
from fleetd.wire.values import need_bool, need_int, need_list, need_text, printable

MAX_PROCESSES = 65_536  # processes per node that made collective calls
MAX_NAME = 64  # a process name (comm is 15 bytes; leave room for a marker)
MAX_JOB = 256  # a torchrun job identity (a run id, or MASTER_ADDR:MASTER_PORT)
MAX_RANK = 2**31 - 1
MAX_PID = 2**31 - 1
INT32 = 2**31
_HEX = frozenset("0123456789abcdef")
_COLLECTIVES = frozenset(coll.COLLECTIVES)
BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def check_reply(reply: Mapping[str, Any], node: str,
                max_rows: int = coll.DEFAULT_ROWS) -> coll.NodeArrivals:
    """The node's arrivals rebuilt from checked values; raises :class:`BadReply`."""
    if reply.get("columns") != list(coll.ARRIVAL_COLUMNS):
        raise BadReply(f"columns {printable(reply.get('columns'), 200)} are not "
                       f"{list(coll.ARRIVAL_COLUMNS)}")
    rows = need_list(reply.get("rows"), "rows", None)
    truncated = need_bool(reply.get("truncated", False), "truncated")
    reason = reply.get("truncated_reason")
    if reason not in (None, "rows", "bytes"):
        raise BadReply(f"truncated_reason: {printable(reason, 40)}")
    if len(rows) > max_rows:  # a node that ignores the limit is cut, and says so
        rows, truncated, reason = rows[:max_rows], True, "rows"
    arrivals = [_arrival(r, f"rows[{i}]") for i, r in enumerate(rows)]
    procs_obj = reply.get("processes", {"columns": list(coll.PROCESS_COLUMNS), "rows": []})
    if not isinstance(procs_obj, dict) or procs_obj.get("columns") != list(
            coll.PROCESS_COLUMNS):
        raise BadReply("processes: expected {columns: "
                       f"{list(coll.PROCESS_COLUMNS)}, rows: [...]}}")
    procs: dict[int, coll.Proc] = {}
    for i, r in enumerate(need_list(procs_obj.get("rows"), "processes.rows", MAX_PROCESSES)):
        p = _proc(r, f"processes.rows[{i}]")
        procs[p.pid] = p
    err = reply.get("clock_error_ns")
    if err is not None:
        err = need_int(err, "clock_error_ns", 0, INT64_MAX)
    boot = reply.get("boot_id")
    if boot is not None and not (isinstance(boot, str) and BOOT_ID.fullmatch(boot)):
        raise BadReply(f"boot_id {printable(boot, 60)} is not a boot id (a UUID)")
    mono = reply.get("mono_offset_ns")
    if mono is not None:
        mono = need_int(mono, "mono_offset_ns", -INT64_MAX, INT64_MAX)
    return coll.NodeArrivals(node, arrivals, procs, err, truncated,
                             reason if truncated else None, boot, mono if boot else None)


def _arrival(r: Any, where: str) -> coll.Arrival:
    if not isinstance(r, list) or len(r) != len(coll.ARRIVAL_COLUMNS):
        raise BadReply(f"{where}: expected a list of {len(coll.ARRIVAL_COLUMNS)} values")
    ts, dur, pid, tid, op, ret, nbytes, seq, ptr, chash, rank, nranks = r
    if op not in _COLLECTIVES:
        raise BadReply(f"{where}.op: {printable(op, 40)} is not an NCCL collective")
    rank = None if rank is None else need_int(rank, f"{where}.rank", 0, MAX_RANK)
    nranks = None if nranks is None else need_int(nranks, f"{where}.nranks", 1, MAX_RANK)
    chash = None if chash is None else _hex(chash, f"{where}.comm_hash", exact=16)
    if (chash is None) != (rank is None) or (rank is None) != (nranks is None):
        raise BadReply(f"{where}: comm_hash, rank and nranks come together or not at all")
    if rank is not None and nranks is not None and rank >= nranks:
        raise BadReply(f"{where}: rank {rank} is not below nranks {nranks}")
    return coll.Arrival(
        need_int(ts, f"{where}.ts_ns", 0), need_int(dur, f"{where}.dur_ns", 0),
        need_int(pid, f"{where}.pid", 0, MAX_PID), need_int(tid, f"{where}.tid", 0, MAX_PID),
        str(op), need_int(ret, f"{where}.ret", -INT32, INT32 - 1),
        need_int(nbytes, f"{where}.bytes", 0, INT64_MAX),
        None if seq is None else need_int(seq, f"{where}.seq", 1, INT64_MAX),
        None if ptr is None else _hex(ptr, f"{where}.comm_ptr", prefix=True), chash, rank,
        nranks)


def _proc(r: Any, where: str) -> coll.Proc:
    if not isinstance(r, list) or len(r) != len(coll.PROCESS_COLUMNS):
        raise BadReply(f"{where}: expected a list of {len(coll.PROCESS_COLUMNS)} values")
    pid, comm, rank, size, job = r
    return coll.Proc(
        need_int(pid, f"{where}.pid", 0, MAX_PID),
        None if comm is None else need_text(comm, f"{where}.comm", MAX_NAME),
        None if rank is None else need_int(rank, f"{where}.rank", 0, MAX_RANK),
        None if size is None else need_int(size, f"{where}.world_size", 1, MAX_RANK),
        None if job is None else need_text(job, f"{where}.job", MAX_JOB))


def _hex(v: Any, where: str, *, exact: int = 0, prefix: bool = False) -> str:
    """``exact`` lowercase hex digits, or (``prefix``) ``0x`` and 1 to 16 of them."""
    if isinstance(v, str):
        body = v[2:] if prefix and v.startswith("0x") else (None if prefix else v)
        if body is not None and set(body) <= _HEX and (
                len(body) == exact if exact else 0 < len(body) <= 16):
            return v
    raise BadReply(f"{where}: {printable(v, 40)} is not "
                   + (f"{exact} lowercase hex digits" if exact else "a 0x... pointer"))
