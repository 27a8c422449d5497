"""A node's ``GET /api/v1/gpu`` answer, checked before ranks are compared.

The answer is untrusted: a node of another version, a broken one or an impostor with a
valid certificate may send any JSON up to the client's body limit. The straggler scoring
and the table formats index and format its fields, so every rank and kernel row is
rebuilt here from the keys ``fleetd gpu`` documents (docs/json.md), each type- and
range-checked, strings cleaned and bounded, lists capped. One bad value rejects the
node's whole answer (:class:`~fleetd.wire.failure.BadReply`): half of a lying answer
is still a lie, and the fleet command then reports that node as failed (a warning, the
partial exit code).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetd.analyze.gpu.device import one_verdict
from fleetd.wire.failure import BadReply
from fleetd.wire.limits import INT64_MIN
from fleetd.wire.values import (
    need_choice,
    need_dict,
    need_int,
    need_list,
    need_number,
    need_text,
    optional,
)

MAX_RANKS = 1024  # processes x devices per node
MAX_STEPS = 10_000  # profiler steps per rank
MAX_KERNELS = 10_000  # kernel names per node
MAX_LINES = 1000  # evidence/caveat/warning lines per list
MAX_TEXT = 4096  # characters per string (kernel names run long)
MAX_METRICS = 32
PCT_SLACK = 1e-6  # rounding above 100 %

_INTS = ("pid", "device", "start_ns", "end_ns", "tklqt_ns")
_COUNTS = ("window_ns", "idle_ns", "kernels", "nccl_kernels", "nccl_ns", "launches")
_PCTS = ("idle_pct", "compute_pct", "comm_pct", "memcpy_pct")
_DIST = ("launch_delay_ns", "queue_delay_ns")
_YES_NO = ("YES", "NO")
_READINGS = ("CPU-bound", "GPU-bound", "unknown")


def check_gpu_reply(reply: Mapping[str, Any]) -> dict[str, Any]:
    """The node's answer rebuilt from checked values; raises :class:`BadReply`."""
    ranks = need_list(reply.get("ranks"), "ranks", MAX_RANKS)
    kernels = need_list(reply.get("kernels", []), "kernels", MAX_KERNELS)
    out: dict[str, Any] = {"node": reply.get("node")}
    if isinstance(reply.get("window"), dict):
        out["window"] = reply["window"]
    if "note" in reply:
        out["note"] = _text(reply["note"], "note")
    out["ranks"] = [_rank(r, f"ranks[{i}]") for i, r in enumerate(ranks)]
    out["kernels"] = [_kernel(k, f"kernels[{i}]") for i, k in enumerate(kernels)]
    out["warnings"] = _lines(reply.get("warnings", []), "warnings")
    return out


def _rank(r: Any, where: str) -> dict[str, Any]:
    d = need_dict(r, where)
    out: dict[str, Any] = {"node": _text(d.get("node", ""), f"{where}.node")}
    for k in _INTS:
        out[k] = _int(d.get(k), f"{where}.{k}")
    for k in _COUNTS:
        out[k] = _int(d.get(k), f"{where}.{k}", 0)
    for k in _PCTS:
        out[k] = _pct(d.get(k), f"{where}.{k}")
    for k in _DIST:
        out[k] = _dist(d.get(k), f"{where}.{k}")
    out["rank"] = optional(d.get("rank"), f"{where}.rank", _int)
    out["tklqt_reading"] = need_choice(d.get("tklqt_reading", "unknown"), _READINGS,
                                   f"{where}.tklqt_reading")
    out["verdict"] = _verdict(d.get("verdict"), f"{where}.verdict")
    # Written here from the checked fields, never taken from the node's text.
    out["summary"] = one_verdict(out["verdict"]["host_overhead"], out["tklqt_reading"])
    out["steps"] = [_step(s, f"{where}.steps[{i}]")
                    for i, s in enumerate(need_list(d.get("steps", []), f"{where}.steps",
                                                MAX_STEPS))]
    if "m3" in d:
        out["m3"] = _m3(d["m3"], f"{where}.m3")
    return out


def _verdict(v: Any, where: str) -> dict[str, Any]:
    d = need_dict(v, where)
    out: dict[str, Any] = {
        "host_overhead": need_choice(d.get("host_overhead"), _YES_NO, f"{where}.host_overhead"),
        "metrics": _metrics(d.get("metrics"), f"{where}.metrics"),
        "thresholds": _metrics(d.get("thresholds", {}), f"{where}.thresholds"),
    }
    for k in ("evidence", "caveats", "phases"):
        out[k] = _lines(d.get(k, []), f"{where}.{k}")
    if "phase_thresholds" in d:
        phases = need_dict(d["phase_thresholds"], f"{where}.phase_thresholds")
        if len(phases) > MAX_METRICS:
            raise BadReply(f"{where}.phase_thresholds: more than {MAX_METRICS} phases")
        out["phase_thresholds"] = {_text(p, f"{where}.phase_thresholds"): _metrics(
            m, f"{where}.phase_thresholds") for p, m in phases.items()}
    return out


def _step(s: Any, where: str) -> dict[str, Any]:
    d = need_dict(s, where)
    out: dict[str, Any] = {"name": _text(d.get("name"), f"{where}.name")}
    for k in ("start_ns", "tklqt_ns"):
        out[k] = _int(d.get(k), f"{where}.{k}")
    for k in ("step_ns", "idle_ns", "kernels", "launches"):
        out[k] = _int(d.get(k), f"{where}.{k}", 0)
    out["idle_pct"] = _pct(d.get("idle_pct"), f"{where}.idle_pct")
    out["metrics"] = _metrics(d.get("metrics"), f"{where}.metrics")
    out["host_overhead"] = need_choice(d.get("host_overhead"), _YES_NO, f"{where}.host_overhead")
    out["evidence"] = _lines(d.get("evidence", []), f"{where}.evidence")
    return out


def _m3(m: Any, where: str) -> dict[str, Any]:
    d = need_dict(m, where)
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = _text(k, where)
        if key == "reason":
            out[key] = optional(v, f"{where}.reason", _text)
        else:
            out[key] = optional(v, f"{where}.{key}", need_number)
    if len(out) > MAX_METRICS:
        raise BadReply(f"{where}: more than {MAX_METRICS} entries")
    return out


def _kernel(k: Any, where: str) -> dict[str, Any]:
    d = need_dict(k, where)
    return {"name": _text(d.get("name"), f"{where}.name"),
            "count": _int(d.get("count"), f"{where}.count", 0),
            "total_ns": _int(d.get("total_ns"), f"{where}.total_ns", 0),
            "mean_ns": need_number(d.get("mean_ns"), f"{where}.mean_ns"),
            "p50_ns": need_number(d.get("p50_ns"), f"{where}.p50_ns"),
            "p99_ns": need_number(d.get("p99_ns"), f"{where}.p99_ns"),
            "share_pct": _pct(d.get("share_pct"), f"{where}.share_pct")}


# ---- values ------------------------------------------------------------------------------


def _int(v: Any, where: str, lo: int | None = None) -> int:
    return need_int(v, where, INT64_MIN if lo is None else lo)


def _pct(v: Any, where: str) -> float | int:
    n = need_number(v, where)
    if not 0 <= n <= 100 + PCT_SLACK:
        raise BadReply(f"{where}: {n} is not a percentage (0-100)")
    return n


def _dist(v: Any, where: str) -> dict[str, Any]:
    d = need_dict(v, where)
    out: dict[str, Any] = {"count": _int(d.get("count", 0), f"{where}.count", 0)}
    for k in ("mean", "p50", "p95", "max"):
        out[k] = optional(d.get(k), f"{where}.{k}", need_number)
    return out


def _metrics(v: Any, where: str) -> dict[str, Any]:
    d = need_dict(v, where)
    if len(d) > MAX_METRICS:
        raise BadReply(f"{where}: more than {MAX_METRICS} metrics")
    return {_text(k, where)[:16]: optional(x, f"{where}.{k}", need_number)
            for k, x in d.items()}


def _text(v: Any, where: str) -> str:
    return need_text(v, where, MAX_TEXT)


def _lines(v: Any, where: str) -> list[str]:
    lines = need_list(v, where, MAX_LINES)
    return [_text(x, f"{where}[{i}]") for i, x in enumerate(lines)]
