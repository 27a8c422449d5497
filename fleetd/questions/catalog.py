"""Every question asked of a node's analysis through the registry, and how each is
answered on a node, on a local file and across the fleet (docs/api.md, docs/json.md).

Adding a question: its analyzer, an entry here, and (when a table is not enough) its
renderer; the node route, the fleet call, the MCP tool and ``fleetd NAME`` follow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, cast

from fleetd.analyze.distributed import arrivals
from fleetd.errors import QueryError, UsageError
from fleetd.questions.spec import Answer, Param, Params, Question
from fleetd.wire import paths
from fleetd.wire.answers import (
    CpuStack,
    CpuStacksAnswer,
    GpuAnswer,
    GraphsAnswer,
    NodeProfile,
    NoProfile,
    OverviewAnswer,
    StacksAnswer,
)
from fleetd.wire.limits import POD_CHARS
from fleetd.wire.pods import read_params, read_placement
from fleetd.wire.shapes import ChainsReply, OpsReply
from fleetd.wire.values import printable, valid_int

if TYPE_CHECKING:
    from fleetd.analyze.facade import Analysis
    from fleetd.analyze.reading.profile import StackCount
    from fleetd.analyze.reading.rows import KernelOpRow, OpRow, PodGroup, PodProcess, PodsAnswer
    from fleetd.wire.answers import RankStraggler
    from fleetd.wire.gpu import CheckedGpuReply, CheckedRank

MAX_TOP_N = 1000  # stacks per answer
MAX_FRAMES = 128  # frames per stack
MAX_BUCKETS = 500  # graph timeline buckets
MAX_CPU_STACKS = 5000  # (thread, stack) counts per on-CPU profile answer

PID = Param("pid", "int", help="only this process")


def _number(value: Any) -> float:
    """A peer's number, or 0 for anything else (sorting must not fail on a bad value)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _items(value: object) -> list[object]:
    """A node's list, or none for anything else."""
    return value if isinstance(value, list) else []


def _tagged(nodes: list[dict[str, object]], key: str) -> list[dict[str, object]]:
    """Every node's ``key`` rows that are objects, each with its node (the rows of a
    question without a reader: their values are read with care where they are used)."""
    return [dict(r, node=n["node"]) for n in nodes for r in _items(n.get(key))
            if isinstance(r, dict)]


class MergedStacks(TypedDict):
    """What the fleet's ``stacks`` answer gains: every node's, heaviest first."""

    stacks: list[dict[str, object]]


class NodeCpuStack(CpuStack):
    node: str


class MergedCpuStacks(TypedDict):
    stacks: list[NodeCpuStack]
    period_ns: int


class MergedProcesses(TypedDict):
    processes: list[dict[str, object]]  # each node's graph processes, with its node


class MergedGpu(TypedDict):
    ranks: list[CheckedRank]
    kernels: list[dict[str, object]]
    straggler: RankStraggler | None


class MergedPods(TypedDict):
    processes: list[PodProcess]
    pods: list[PodGroup]


# ---- stacks -------------------------------------------------------------------------


def _op(text: str) -> str:
    from fleetd.analyze.stacks import op_code

    op_code(text)  # an unknown op is refused with the close matches
    return text


def _stacks_local(a: Analysis, p: Params) -> Answer:
    """Every node's ``top_n`` groups (a merged file: more than ``top_n`` in all)."""
    return a.stacks(p.text("op"), p.maybe_int("pid"), p.num("top_n"), p.num("frames_n"),
                    min_dur_ns=p.num("min_dur_ns"))


def _stacks(a: Analysis, node: str, p: Params) -> Answer:
    out = _stacks_local(a, p)
    return {**out, "stacks": out["stacks"][:p.num("top_n")]}


def _stacks_combine(nodes: list[dict[str, object]]) -> MergedStacks:
    found = _tagged(nodes, "stacks")
    found.sort(key=lambda s: -_number(s.get("total_ns")))
    return {"stacks": found}


STACKS = Question(
    "stacks", "the recorded user stacks of CUDA calls, heaviest first",
    (PID, Param("top_n", "int", 10, MAX_TOP_N, "stacks to return"),
     Param("frames_n", "int", 16, MAX_FRAMES, "frames per stack, innermost first"),
     Param("min_dur_ns", "int", 0, help="only calls at least this long"),
     Param("op", "str", help="only calls of this CUDA op", read=_op)),
    _stacks, "stacks", path=paths.STACKS, local=_stacks_local, combine=_stacks_combine,
    shape=StacksAnswer)


# ---- on-CPU samples -----------------------------------------------------------------


def _counts(a: Analysis, p: Params) -> tuple[list[StackCount], int]:
    from fleetd.analyze.reading.profile import stack_counts

    counts: list[StackCount] = []
    period = 0
    for sl in a.slices:
        got, per = stack_counts(sl.conn, sl.node, sl.window, p.maybe_int("pid"), p.maybe_int("tid"))
        counts += got
        period = max(period, per)
    return counts, period


def _cpu_stacks(a: Analysis, node: str, p: Params) -> Answer:
    from fleetd.analyze.reading.profile import stacks_json

    counts, period = _counts(a, p)
    found, left = stacks_json(counts, p.num("top_n"), p.num("frames_n"))
    return {"window": a.window.to_json(), "period_ns": period, "stacks": found,
            "stacks_omitted": left, "warnings": list(a.window.warnings)}


def _cpu_stacks_local(a: Analysis, p: Params) -> Answer:
    """Every (thread, stack) of the file in full, each with its node, as the fleet
    answer has them; ``names``: the file's nodes."""
    counts, period = _counts(a, p)
    return {"stacks": [{"node": s.node, "pid": s.pid, "tid": s.tid, "frames": list(s.frames),
                        "samples": s.samples, "gc": s.gc} for s in counts],
            "period_ns": period, "names": a.node_names()}


def _cpu_stacks_combine(nodes: list[dict[str, object]]) -> MergedCpuStacks:
    """The rows a merged profile is made of, each with its node; values that are not
    what the route answers are left out."""
    found: list[NodeCpuStack] = []
    for n in nodes:
        for s in _items(n.get("stacks")):
            frames = s.get("frames") if isinstance(s, dict) else None
            if isinstance(s, dict) and isinstance(frames, list) and all(
                    isinstance(f, str) for f in frames) and all(
                    isinstance(s.get(k), int) and s[k] >= 0 for k in ("pid", "tid", "samples",
                                                                        "gc")):
                found.append({"node": str(n["node"]), "pid": s["pid"], "tid": s["tid"],
                              "frames": [f[:1000] for f in frames[:128]],
                              "samples": s["samples"], "gc": s["gc"]})
    period = max((int(got) for n in nodes if isinstance(got := n.get("period_ns"), int)),
                 default=0)
    return {"stacks": found, "period_ns": period}


CPU_STACKS = Question(
    "cpu_stacks", "on-CPU samples per (thread, stack)",
    (PID, Param("tid", "int", help="only this thread"),
     Param("top_n", "int", MAX_CPU_STACKS, MAX_CPU_STACKS, "stacks to return"),
     Param("frames_n", "int", MAX_FRAMES, MAX_FRAMES, "frames per stack")),
    _cpu_stacks, "stacks", path=paths.CPU_STACKS, local=_cpu_stacks_local,
    combine=_cpu_stacks_combine, shape=CpuStacksAnswer)


# ---- CUDA graphs --------------------------------------------------------------------


def _graphs(a: Analysis, node: str, p: Params) -> Answer:
    return a.graphs(p.maybe_int("pid"), p.num("buckets"))


GRAPHS = Question(
    "graphs", "CUDA graph lifecycle per process",
    (PID, Param("buckets", "int", 20, MAX_BUCKETS, "timeline rows per process")),
    _graphs, "processes", path=paths.GRAPHS,
    combine=lambda nodes: MergedProcesses(processes=_tagged(nodes, "processes")),
    shape=GraphsAnswer)


# ---- GPU ranks ----------------------------------------------------------------------


def _thresholds(text: str) -> dict[str, float]:
    from fleetd.analyze.gpu.device import parse_thresholds

    return parse_thresholds(t for t in text.split(",") if t)


def _thresholds_text(limits: Mapping[str, float]) -> str:
    return ",".join(f"{k}={v}" for k, v in limits.items())


def _gpu(a: Analysis, node: str, p: Params) -> Answer:
    return a.gpu(p.maybe_int("pid"), p.flag("steps"), p.get("thresholds") or _thresholds(""))


def _gpu_combine(nodes: list[dict[str, object]]) -> MergedGpu:
    """The ranks side by side, the slowest flagged with the straggler scoring; kernel
    rows keep their node."""
    from fleetd.analyze.gpu.device import slowest_rank

    read = [cast("CheckedGpuReply", n) for n in nodes]  # each read by GPU.check (_gpu_check)
    for g in read:  # a rank is named by the node that answered, not by what it claims
        for r in g["ranks"]:
            r["node"] = g["node"]
    ranks = [r for g in read for r in g["ranks"]]
    kernels = sorted(_tagged(nodes, "kernels"), key=lambda k: -_number(k.get("total_ns")))
    return {"ranks": ranks, "kernels": kernels, "straggler": slowest_rank(ranks)}


def _gpu_check(reply: dict[str, object]) -> CheckedGpuReply:
    from fleetd.wire.gpu import check_gpu_reply  # the GPU analyzer only when asked

    return check_gpu_reply(reply)


GPU = Question(
    "gpu", "GPU idle, launch delays and the host-overhead verdict per rank",
    (PID, Param("steps", "bool", False, help="whole profiler steps only"),
     Param("thresholds", "str", help="verdict thresholds, METRIC=VALUE,...",
           read=_thresholds, write=_thresholds_text)),
    _gpu, "ranks", path=paths.GPU, combine=_gpu_combine, check=_gpu_check, shape=GpuAnswer)


# ---- overview and straggler profile -------------------------------------------------

OVERVIEW_COLUMNS = ("node", "events", "lost_events", "sessions", "crashed", "high", "medium",
                    "low", "verdict")


def overview_rows(nodes: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    rows = []
    for n in nodes:
        chains = n.get("chains") or {}
        rows.append([n.get("node"), n.get("events"), n.get("lost_events"),
                     len(n.get("sessions") or []), n.get("crashed_sessions"),
                     chains.get("HIGH", 0),
                     chains.get("MEDIUM", 0), chains.get("LOW", 0), n.get("verdict")])
    return rows


def _overview_local(a: Analysis, p: Params) -> Answer:
    """Every node of the file; the window's warnings said once, not per node."""
    found = [{k: v for k, v in a.overview(name).items() if k != "warnings"}
             for name in a.node_names()]
    return {"nodes": found, "warnings": list(a.window.warnings), "skew": {}}


OVERVIEW = Question(
    "overview", "per node: events, lost events, chains by severity, verdict",
    (), lambda a, node, p: a.overview(node), "events", path=paths.OVERVIEW,
    local=_overview_local, tag_node=False, node_warnings=False, shape=OverviewAnswer)

def _profile_check(reply: dict[str, object]) -> NodeProfile | NoProfile:
    from fleetd.wire.chains import check_profile_reply

    return check_profile_reply(reply)


PROFILE = Question(
    "profile", "the node's straggler features",
    (), lambda a, node, p: a.profile(node), "node", path=paths.PROFILE,
    tag_node=False, check=_profile_check, shape=NodeProfile)


# ---- pods ---------------------------------------------------------------------------


def _pods(a: Analysis, node: str, p: Params) -> Answer:
    from fleetd.analyze.reading import pods

    procs = [r for sl in a.slices for r in pods.processes(sl.conn, sl.node.key, sl.name)]
    out: PodsAnswer = {"processes": procs, "pods": pods.by_pod(procs)}
    if not procs:
        out["note"] = pods.NOTE_NO_PODS
    return out


def _pods_combine(nodes: list[dict[str, object]]) -> MergedPods:
    """Every node's processes, their names and placements read as untrusted text."""
    from fleetd.analyze.reading.pods import by_pod

    procs: list[PodProcess] = []
    for n in nodes:
        for r in _items(n.get("processes")):
            pid = valid_int(r.get("pid"), 1) if isinstance(r, dict) else None
            if isinstance(r, dict) and pid is not None:
                procs.append({"node": str(n["node"]), "pid": pid,
                              "comm": printable(r.get("comm") or "", POD_CHARS),
                              **read_placement(r)})
    return {"processes": procs, "pods": by_pod(procs)}


PODS = Question(
    "pods", "which Kubernetes pods ran on each node, with their processes",
    (), _pods, "processes", path=paths.PODS, combine=_pods_combine, windowed=False,
    columns=("node", "namespace", "pod", "container", "pid", "comm"), rows="processes",
    tool="get_pods", description=(
        "The Kubernetes pods (and other containers) whose processes fleetd traced, per "
        "node: processes (node, pid, comm, pod, namespace, container, pod_uid) and pods "
        "(node, namespace, pod, pids; a container outside any pod stands for its pod). "
        "Use a pod's name with the pod argument of get_causal_chains or query_fleet. A "
        "'note' says when no traced process ran in a container."))


# ---- op statistics ------------------------------------------------------------------

OPS_BY = ("op", "kernel")  # /api/v1/ops?by=


def _by(text: str) -> str:
    if text not in OPS_BY:
        raise QueryError(f"by={text[:40]!r} is not one of {'|'.join(OPS_BY)}",
                         "by=op (the default) or by=kernel", code="bad_request")
    return text


def _placement(name: str) -> Callable[[str], str]:
    """The reader of ``pod`` or ``namespace``: a Kubernetes name (fleetd.wire.pods)."""
    def read(text: str) -> str:
        try:
            read_params({name: text})
        except ValueError as exc:
            raise QueryError(str(exc), None, code="bad_request") from None
        return text

    return read


def _one_selection(p: Params) -> None:
    if p.maybe_int("pid") and (p.text(paths.POD_PARAM) or p.text(paths.NAMESPACE_PARAM)):
        raise UsageError("pid and pod/namespace both select processes", "give one of them")


def _ops(a: Analysis, node: str, p: Params) -> Answer:
    from fleetd.analyze.reading import pods

    by = p.text("by") or "op"
    pod, ns = p.text(paths.POD_PARAM), p.text(paths.NAMESPACE_PARAM)
    pid, per_process = p.maybe_int("pid"), p.flag("per_process")
    rows: list[OpRow] | list[KernelOpRow]
    if not pod and not ns:
        rows = a.kernel_stats(pid, per_process) if by == "kernel" else a.op_stats(pid, per_process)
    else:
        # A pod's processes: per process, each row with its pod (as fleetd ops --pod).
        pids = pods.select(a.conn, pod, ns)
        found = pods.placements(a.conn)
        if by == "kernel":
            rows = [r for sl in a.slices
                    for r in pods.placed(sl.kernel_stats(None, True), pids, sl.node.key, found)]
        else:
            rows = [r for sl in a.slices
                    for r in pods.placed(sl.op_stats(None, True), pids, sl.node.key, found)]
    return {"window": a.window.to_json(), "warnings": list(a.window.warnings), "ops": rows}


POD = Param(paths.POD_PARAM, "str", help="only this pod's processes, [NAMESPACE/]NAME",
            read=_placement(paths.POD_PARAM))
NAMESPACE = Param(paths.NAMESPACE_PARAM, "str", help="only processes of pods in this namespace",
                  read=_placement(paths.NAMESPACE_PARAM))

OPS = Question(
    "ops", "p50/p95/p99 per op (or kernel name) and process",
    (PID, Param("per_process", "bool", False, help="one row per process and op"),
     Param("by", "str", "op", help="op (the default) or kernel", read=_by), POD, NAMESPACE),
    _ops, "ops", path=paths.OPS, validate=_one_selection, shape=OpsReply)


# ---- causal chains (fleetd explain --nodes asks them beside profile and collectives) ------


def _chains(a: Analysis, node: str, p: Params) -> Answer:
    from fleetd.analyze.reading import pods

    pod, ns = p.text(paths.POD_PARAM), p.text(paths.NAMESPACE_PARAM)
    report = a.explain(p.maybe_int("pid"),
                       pids=pods.select(a.conn, pod, ns) if pod or ns else None)
    top_n = p.maybe_int("top_n")
    return {"window": report["window"], "verdict": report["verdict"],
            "chains": report["chains"][:top_n] if top_n else report["chains"],
            "processes": report["processes"], "warnings": report["warnings"]}


def _chains_check(reply: dict[str, object]) -> ChainsReply:
    from fleetd.wire.chains import check_chains_reply

    return check_chains_reply(reply)


CHAINS = Question(
    "chains", "causal chains, most severe first",
    (Param("pid", "int", help="only chains whose victim is this process"),
     Param("top_n", "int", help="chains to return (default: all)"), POD, NAMESPACE),
    _chains, "chains", path=paths.CHAINS, validate=_one_selection, check=_chains_check,
    shape=ChainsReply)


# ---- NCCL collective calls (fleetd collectives, explain --nodes) -----------------------


def _collectives(a: Analysis, node: str, p: Params) -> Answer:
    """The node's collective calls in the window, newest ``max_rows`` (bounded by rows
    and bytes), for the fleet client to compare arrivals across nodes."""
    from fleetd.analyze.distributed.collectives import NodeArrivals

    parts = a.arrivals(p.num("max_rows"), arrivals.MAX_BYTES)
    body = (parts[0] if parts else NodeArrivals(node, [], {})).to_json()
    return {"window": a.window.to_json(), **body, "warnings": list(a.window.warnings)}


COLLECTIVES = Question(
    "collectives", "the node's NCCL collective calls in the window",
    (Param("max_rows", "int", arrivals.DEFAULT_ROWS, arrivals.MAX_ROWS,
           "the newest calls to send"),),
    _collectives, "rows", path=paths.COLLECTIVES)


QUESTIONS: tuple[Question, ...] = (CHAINS, OPS, STACKS, CPU_STACKS, GRAPHS, GPU, OVERVIEW,
                                   PROFILE, COLLECTIVES, PODS)
"""The questions of the registry, in the order of the node's routes."""
