"""Failed NCCL calls: one ``nccl_failures`` chain per process whose NCCL calls returned
an error, and a warning line for each (explain's finding about the calls themselves).

``ncclInProgress`` (7) is what a non-blocking communicator answers while an operation
runs: not a failure. A failed call that held its rank for :data:`FAILED_STALL_NS` or
more before returning is a stall the failure explains, and weighs as such.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from fleetd.analyze.causes.chains import Chain
from fleetd.analyze.causes.rules import Context, rule_chain
from fleetd.analyze.distributed.arrivals import dur_text
from fleetd.analyze.reading.answers_chain import ChainDetail, EvidenceItem, NcclErrorCount
from fleetd.analyze.reading.data import in_list, name_of
from fleetd.store.catalog import NCCL, NCCL_COMM_CREATES
from fleetd.store.sparse import sparse_only
from fleetd.store.timeparse import format_ns

NCCL_CODES: tuple[int, ...] = NCCL.codes
NCCL_RESULTS = {  # ncclResult_t
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
    3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
    6: "ncclRemoteError", 7: "ncclInProgress",
}
NOT_FAILED = (0, 7)
# A failed NCCL call that held its rank this long before returning is a stall.
FAILED_STALL_NS = 100_000_000


def nccl_error(ret: int) -> str:
    """``ncclInvalidArgument`` for 4; an unknown code as ``ncclResult 42``."""
    return NCCL_RESULTS.get(ret, f"ncclResult {ret}")


def failed(ret: int) -> bool:
    return ret not in NOT_FAILED


def failures(ctx: Context) -> tuple[list[Chain], list[str]]:
    """One ``nccl_failures`` chain per process whose NCCL calls returned an error, and a
    warning line for each: count per op and return code, with the NCCL error name."""
    v = ctx.view
    win = v.win
    where = ("WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? "
             f"AND op IN {in_list(NCCL_CODES)}{sparse_only(NCCL_CODES)}")
    params = (win.start_ns, win.end_ns, v.node.lo, v.node.hi)
    calls: Counter[int] = Counter()
    errors: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for pid, op, ret, n, first in v.conn.execute(
            f"SELECT pid, op, ret, count(*), min(ts_ns) FROM event_data {where} "
            "GROUP BY pid, op, ret", params):
        calls[int(pid)] += int(n)
        if failed(int(ret)):
            errors[int(pid)].append((int(op), int(ret), int(n), int(first)))
    chains, warnings = [], []
    for pid, errs in sorted(errors.items()):
        # A failed communicator creation explains the failures after it: it leads.
        errs.sort(key=lambda e: (e[0] not in NCCL_COMM_CREATES.code_set, -e[2], e[0], e[1]))
        n_failed = sum(e[2] for e in errs)
        by_error: list[NcclErrorCount] = [
            {"op": name_of(op), "ret": ret, "error": nccl_error(ret), "count": n}
            for op, ret, n, _ in errs]
        items: list[EvidenceItem] = [{"kind": "nccl_error", "op": name_of(op), "ret": ret,
                  "error": nccl_error(ret), "count": n, "ts_ns": first,
                  "time": format_ns(first),
                  "text": f"{name_of(op)} returned {ret} {nccl_error(ret)} {n} time(s), "
                          f"first at {format_ns(first)[11:]}"}
                 for op, ret, n, first in errs[:8]]
        items += _failed_calls(ctx, pid, where, params)
        share = n_failed / max(1, calls[pid])
        blocked = _longest_failed(ctx, pid, where, params)
        detail: ChainDetail = {"failed": n_failed, "calls": calls[pid], "by_error": by_error,
                  "longest_failed_ns": blocked}
        # Failing at once costs the job nothing by itself (the warning says it); failing
        # after holding the rank (a timed-out init, a collective that hung then broke)
        # is a stall the failure explains: then it weighs as the share that failed.
        impact = share if blocked >= FAILED_STALL_NS else 0.0
        ch = rule_chain(ctx, "nccl_failures", pid, name_of(errs[0][0]), 1.0, impact, items,
                        detail)
        chains.append(ch)
        listed = ", ".join(f"{e['op']} ret {e['ret']} {e['error']} x{e['count']}"
                           for e in by_error[:5])
        warnings.append(f"{v.node.name}: {n_failed} of {calls[pid]} NCCL call(s) of "
                        f"{v.names.get(pid) or 'pid'} (pid {pid}) failed: {listed}")
    return chains, warnings


def _longest_failed(ctx: Context, pid: int, where: str, params: tuple[int, ...]) -> int:
    row = ctx.view.conn.execute(
        f"SELECT max(dur_ns) FROM event_data {where} AND pid = ? "
        f"AND ret NOT IN {in_list(NOT_FAILED)}", (*params, pid)).fetchone()
    return int(row[0] or 0)


def _failed_calls(ctx: Context, pid: int, where: str, params: tuple[int, ...]
                  ) -> list[EvidenceItem]:
    v = ctx.view
    rows = v.conn.execute(
        f"SELECT id, ts_ns, dur_ns, tid, op, ret FROM event_data {where} AND pid = ? "
        f"AND ret NOT IN {in_list(NOT_FAILED)} ORDER BY ts_ns LIMIT 3", (*params, pid))
    return [{"kind": "call", "id": v.node.event_id(k), "ts_ns": ts, "time": format_ns(ts),
             "dur_ns": dur, "tid": tid, "op": name_of(op),
             "text": f"{name_of(op)} returned {ret} {nccl_error(ret)} after {dur_text(dur)}"}
            for k, ts, dur, tid, op, ret in rows]
