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
from typing import Any, NotRequired, TypedDict

from fleetd.analyze.gpu.device import one_verdict
from fleetd.analyze.reading.answers import KernelRow, WindowJson
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

_YES_NO = ("YES", "NO")
_READINGS = ("CPU-bound", "GPU-bound", "unknown")


Metrics = dict[str, float | None]  # a verdict's figures or thresholds, by metric name


class CheckedDelays(TypedDict):
    """:class:`~fleetd.analyze.reading.answers.Delays` as read: any number may be a float."""

    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    max: float | None


class CheckedVerdict(TypedDict):
    """A rank's verdict as read: the keys the straggler scoring and tables use (a node's
    ``host_prep`` is not carried; missing thresholds read as none)."""

    host_overhead: str  # YES | NO
    metrics: Metrics
    thresholds: Metrics
    evidence: list[str]
    caveats: list[str]
    phases: list[str]
    phase_thresholds: NotRequired[dict[str, Metrics]]


class CheckedStep(TypedDict):
    name: str
    start_ns: int
    tklqt_ns: int
    step_ns: int
    idle_ns: int
    kernels: int
    launches: int
    idle_pct: float
    metrics: Metrics
    host_overhead: str
    evidence: list[str]


class CheckedRank(TypedDict):
    """A rank as read (:class:`~fleetd.analyze.reading.answers.GpuRank`'s checked keys);
    ``m3`` only from an agent that reports it (an older one does not), with whatever
    figures it names (numbers, or text for ``reason``)."""

    node: str
    pid: int
    device: int
    start_ns: int
    end_ns: int
    tklqt_ns: int
    window_ns: int
    idle_ns: int
    kernels: int
    nccl_kernels: int
    nccl_ns: int
    launches: int
    idle_pct: float
    compute_pct: float
    comm_pct: float
    memcpy_pct: float
    launch_delay_ns: CheckedDelays
    queue_delay_ns: CheckedDelays
    rank: int | None
    tklqt_reading: str  # CPU-bound | GPU-bound | unknown
    verdict: CheckedVerdict
    summary: str
    steps: list[CheckedStep]
    m3: NotRequired[dict[str, float | str | None]]


class CheckedGpuReply(TypedDict):
    """A node's ``GET /api/v1/gpu`` answer rebuilt from checked values (``window`` as
    the node sent it, when an object; ``note`` when it sent one)."""

    node: Any  # as sent: the fleet client names the node itself (questions.catalog)
    window: NotRequired[WindowJson]
    note: NotRequired[str]
    ranks: list[CheckedRank]
    kernels: list[KernelRow]
    warnings: list[str]


class _Head(TypedDict, total=False):
    window: WindowJson
    note: str


def check_gpu_reply(reply: Mapping[str, Any]) -> CheckedGpuReply:
    """The node's answer rebuilt from checked values; raises :class:`BadReply`."""
    ranks = need_list(reply.get("ranks"), "ranks", MAX_RANKS)
    kernels = need_list(reply.get("kernels", []), "kernels", MAX_KERNELS)
    head: _Head = {}
    if isinstance(reply.get("window"), dict):
        head["window"] = reply["window"]
    if "note" in reply:
        head["note"] = _text(reply["note"], "note")
    return {"node": reply.get("node"), **head,
            "ranks": [_rank(r, f"ranks[{i}]") for i, r in enumerate(ranks)],
            "kernels": [_kernel(k, f"kernels[{i}]") for i, k in enumerate(kernels)],
            "warnings": _lines(reply.get("warnings", []), "warnings")}


def _rank(r: Any, where: str) -> CheckedRank:
    d = need_dict(r, where)

    def whole(k: str, lo: int | None = None) -> int:
        return _int(d.get(k), f"{where}.{k}", lo)

    def pct(k: str) -> float:
        return _pct(d.get(k), f"{where}.{k}")

    def dist(k: str) -> CheckedDelays:
        return _dist(d.get(k), f"{where}.{k}")

    out: CheckedRank = {
        "node": _text(d.get("node", ""), f"{where}.node"),
        "pid": whole("pid"), "device": whole("device"), "start_ns": whole("start_ns"),
        "end_ns": whole("end_ns"), "tklqt_ns": whole("tklqt_ns"),
        "window_ns": whole("window_ns", 0), "idle_ns": whole("idle_ns", 0),
        "kernels": whole("kernels", 0), "nccl_kernels": whole("nccl_kernels", 0),
        "nccl_ns": whole("nccl_ns", 0), "launches": whole("launches", 0),
        "idle_pct": pct("idle_pct"), "compute_pct": pct("compute_pct"),
        "comm_pct": pct("comm_pct"), "memcpy_pct": pct("memcpy_pct"),
        "launch_delay_ns": dist("launch_delay_ns"), "queue_delay_ns": dist("queue_delay_ns"),
        "rank": optional(d.get("rank"), f"{where}.rank", _int),
        # Checked in this order, so the first bad field is the one an error names.
        "tklqt_reading": (reading := need_choice(d.get("tklqt_reading", "unknown"), _READINGS,
                                                 f"{where}.tklqt_reading")),
        "verdict": (verdict := _verdict(d.get("verdict"), f"{where}.verdict")),
        # Written here from the checked fields, never taken from the node's text.
        "summary": one_verdict(verdict["host_overhead"], reading),
        "steps": [_step(s, f"{where}.steps[{i}]")
                  for i, s in enumerate(need_list(d.get("steps", []), f"{where}.steps",
                                                  MAX_STEPS))]}
    if "m3" in d:
        out["m3"] = _m3(d["m3"], f"{where}.m3")
    return out


def _verdict(v: Any, where: str) -> CheckedVerdict:
    d = need_dict(v, where)
    out: CheckedVerdict = {
        "host_overhead": need_choice(d.get("host_overhead"), _YES_NO, f"{where}.host_overhead"),
        "metrics": _metrics(d.get("metrics"), f"{where}.metrics"),
        "thresholds": _metrics(d.get("thresholds", {}), f"{where}.thresholds"),
        "evidence": _lines(d.get("evidence", []), f"{where}.evidence"),
        "caveats": _lines(d.get("caveats", []), f"{where}.caveats"),
        "phases": _lines(d.get("phases", []), f"{where}.phases"),
    }
    if "phase_thresholds" in d:
        phases = need_dict(d["phase_thresholds"], f"{where}.phase_thresholds")
        if len(phases) > MAX_METRICS:
            raise BadReply(f"{where}.phase_thresholds: more than {MAX_METRICS} phases")
        out["phase_thresholds"] = {_text(p, f"{where}.phase_thresholds"): _metrics(
            m, f"{where}.phase_thresholds") for p, m in phases.items()}
    return out


def _step(s: Any, where: str) -> CheckedStep:
    d = need_dict(s, where)

    def whole(k: str, lo: int | None = None) -> int:
        return _int(d.get(k), f"{where}.{k}", lo)

    return {"name": _text(d.get("name"), f"{where}.name"),
            "start_ns": whole("start_ns"), "tklqt_ns": whole("tklqt_ns"),
            "step_ns": whole("step_ns", 0), "idle_ns": whole("idle_ns", 0),
            "kernels": whole("kernels", 0), "launches": whole("launches", 0),
            "idle_pct": _pct(d.get("idle_pct"), f"{where}.idle_pct"),
            "metrics": _metrics(d.get("metrics"), f"{where}.metrics"),
            "host_overhead": need_choice(d.get("host_overhead"), _YES_NO,
                                         f"{where}.host_overhead"),
            "evidence": _lines(d.get("evidence", []), f"{where}.evidence")}


def _m3(m: Any, where: str) -> dict[str, float | str | None]:
    d = need_dict(m, where)
    out: dict[str, float | str | None] = {}
    for k, v in d.items():
        key = _text(k, where)
        if key == "reason":
            out[key] = optional(v, f"{where}.reason", _text)
        else:
            out[key] = optional(v, f"{where}.{key}", need_number)
    if len(out) > MAX_METRICS:
        raise BadReply(f"{where}: more than {MAX_METRICS} entries")
    return out


def _kernel(k: Any, where: str) -> KernelRow:
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


def _dist(v: Any, where: str) -> CheckedDelays:
    d = need_dict(v, where)

    def number(k: str) -> float | None:
        return optional(d.get(k), f"{where}.{k}", need_number)

    return {"count": _int(d.get("count", 0), f"{where}.count", 0), "mean": number("mean"),
            "p50": number("p50"), "p95": number("p95"), "max": number("max")}


def _metrics(v: Any, where: str) -> Metrics:
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
