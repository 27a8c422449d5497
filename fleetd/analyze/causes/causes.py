"""The root causes ``explain`` can name: each written once, with its words and fixes.

The analyzers (chains.py for time-aligned spikes, rules.py for patterns) decide *which*
cause a chain has and fill in its victim, culprits, detail and evidence; this registry
says it: a one-line description (docs, the MCP tool description), the evidence kinds the
cause produces, the phrase a spike summary uses, the summary of a rule chain, and the
fixes. :data:`CAUSES` is the whole set; docs/explain.md documents every entry
(tests/unit/test_causes.py checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from fleetd.analyze.causes.chains import COLUMN_WORDS, Chain
from fleetd.analyze.causes.wait_words import (
    DRIVER_POLLERS as DRIVER_POLLERS,
)
from fleetd.analyze.causes.wait_words import (
    block_io_fixes,
    data_starvation_fixes,
    data_starvation_summary,
    lock_contention_fixes,
    lock_contention_summary,
    lock_wait_fixes,
    pipe_blocked_fixes,
    pipe_blocked_summary,
)
from fleetd.analyze.causes.wait_words import (
    is_driver_poller as is_driver_poller,
)
from fleetd.analyze.causes.wait_words import ms as _ms
from fleetd.analyze.reading.answers_chain import ChainDetail
from fleetd.analyze.reading.data import TRACER_MARK
from fleetd.store.catalog import HOST_DELAYS

# The host events a spike or stall can cite (chains.evidence_timeline): whatever
# overlapped it is shown, so a chain may list these beside its own cause's kinds.
SPIKE_HOST_KINDS = HOST_DELAYS.names


@dataclass(frozen=True, slots=True)
class Cause:
    """One root cause class.

    ``why``: for chains of slow calls or stalls, what the thread was doing, given the
    top culprit as ``comm (pid N)`` or None. ``summary``: for rule chains (no spikes),
    the whole line, given the chain, the victim as ``comm (pid, tid)`` and the culprit.
    ``fixes``: concrete actions with the chain's pids filled in.
    """

    name: str
    description: str
    evidence: tuple[str, ...]
    fixes: Callable[[Chain], list[str]]
    why: Callable[[str | None], str] | None = None
    summary: Callable[[Chain, str, str | None], str] | None = None


# ---- fixes --------------------------------------------------------------------------


# Causes whose fixes take nothing from the chain: the same advice whatever it names,
# kept as text here (one table) rather than as a function each returning a constant.
_FIXED_ADVICE: Mapping[str, tuple[str, ...]] = {
    "host_sync": (
        "remove per-step host syncs: no .item(), .cpu(), .numpy(), print(tensor) or "
        "torch.cuda.synchronize() inside the training loop",
        "accumulate losses/metrics on the GPU and read them every N steps; use non_blocking=True "
        "copies from pinned memory and CUDA events to poll"),
    "graph_recapture": (
        "capture each graph once: pre-warm every batch size at start-up and pad inputs to a "
        "fixed set of shapes (torch.compile mode='reduce-overhead' with bucketed shapes)",
        "update an instantiated graph with cudaGraphExecUpdate instead of capturing and "
        "instantiating again"),
    "alloc_churn": (
        "use a caching allocator: keep PyTorch's (do not set PYTORCH_NO_CUDA_MEMORY_CACHING, no "
        "torch.cuda.empty_cache() in the loop)",
        "allocate buffers once before the loop; use cudaMallocAsync with a memory pool for "
        "per-step temporaries"),
    "startup": (
        "nothing to fix in the loop: a one-time cost per process; where processes start "
        "often (short jobs, restarts), keep them alive (persistent workers, a serving "
        "process) rather than starting new ones",
        "create the context early and overlap it with other set-up: torch.cuda.init() or "
        "cudaFree(0) while the data loads; CUDA_MODULE_LOADING=LAZY loads kernels on "
        "first use"),
    "unexplained": (
        "the host shows no cause during these calls: the time is on the GPU side (kernel "
        "duration, queueing); profile the kernels with nsys or ncu",),
}


def _advice(cause: str) -> Callable[[Chain], list[str]]:
    """The fixes of a cause in :data:`_FIXED_ADVICE`, as the registry wants them: a
    function of the chain (which they do not read)."""
    texts = _FIXED_ADVICE[cause]

    def fixes(ch: Chain) -> list[str]:
        return list(texts)  # a fresh list each time, as the other fixes give

    return fixes


SHARED_CULPRIT = 0.25  # a further culprit with this share of the time is named in fixes


def _cpu_contention_fixes(ch: Chain) -> list[str]:
    v, c = ch.victim, (ch.culprits[0] if ch.culprits else None)
    vp = v["pid"]
    cp, cn = (c["pid"], c["comm"]) if c else (None, None)
    if c and TRACER_MARK in str(cn):
        return [f"the tracer itself (pid {cp}) took the CPU: keep fleetd off the "
                f"workload's cores (taskset -acp <other cores> {cp}, or CPUAffinity= in "
                "configs/fleetd-agent.service)",
                "trace less: a larger --sample, fewer --host-events groups, or higher "
                "--offcpu-min / --syscall-min thresholds"]
    if c and c.get("self"):
        return [f"threads of {v['comm']} itself compete for the CPU: cap them "
                f"(OMP_NUM_THREADS, torch.set_num_threads) below the cores given to pid {vp}",
                f"give the GPU-feeding thread {v['tid']} a core of its own: "
                f"taskset -cp <core> {v['tid']}"]
    own = ch.detail.get("own_kernel_work")
    if own and c is not None:  # a kworker running work the victim queued (analyze.memory)
        first = (f"the kernel workers run work {v['comm']} (pid {vp}) queues itself: raise "
                 "its memory limit (its memory_reclaim chain), whose reclaim queues that work"
                 if own.get("reclaim") else
                 f"the kernel workers run work {v['comm']} (pid {vp}) queues itself ("
                 + ", ".join(own.get("functions") or {}) + "): reduce that work on the "
                 "thread's side rather than renicing kernel threads")
        # A per-CPU worker runs on the CPU that queued the work: pinning cannot move it.
        return [first]
    out = [f"pin {v['comm']} to dedicated cores and keep other work off them: "
           f"taskset -cp <cores> {vp}, or a cgroup cpuset (systemd-run --scope -p "
           "AllowedCPUs=<cores> ...) for the workload and another for the rest"]
    q = ch.detail.get("quota")
    if q and cp is not None:  # the culprit spends the victim's own CPU quota
        out.insert(0, f"move {cn} (pid {cp}) out of the workload's cgroup {q['cgroup']}: "
                      f"it spends the same {q['cpus']:g}-CPU quota, which ran out in "
                      f"{q['throttled_period_share']:.0%} of the periods")
    if c is not None:
        # Tasks that took turns on the CPU share the time: name each that took a large
        # part of it, not only the first.
        every = [c, *(x for x in ch.culprits[1:3] if not x.get("self")
                      and float(x.get("share") or 0) >= SHARED_CULPRIT)]
        names = " and ".join(f"{x['comm']} (pid {x['pid']})" for x in every)
        out += [f"lower the priority of {names}: renice -n 19 -p "
                f"{' '.join(str(x['pid']) for x in every)}, or run "
                f"{'them' if len(every) > 1 else 'it'} with chrt --idle 0",
                f"move {names} off the workload's cores: "
                + "; ".join(f"taskset -acp <other cores> {x['pid']}" for x in every)]
    return out


def _dataloader_fixes(ch: Chain) -> list[str]:
    n = ch.detail.get("workers", "many")
    return [f"reduce DataLoader workers ({n} now): num_workers at most the free cores "
            "minus one for the training thread",
            "set persistent_workers=True and pin_memory=True; move heavy decoding/"
            "augmentation to the GPU or precompute it",
            f"keep workers off the training thread's core: os.sched_setaffinity in "
            f"worker_init_fn, and taskset -cp <core> {ch.victim['tid']} for the main thread"]


def _irq_fixes(ch: Chain) -> list[str]:
    v = ch.victim
    return ["steer interrupts away from the GPU-feeding cores: /proc/irq/<n>/smp_affinity "
            "or irqbalance --banirq", f"pin {v['comm']} to cores that take no interrupts: "
            f"taskset -cp <cores> {v['pid']}"]


# ---- summaries of rule chains -------------------------------------------------------


def _host_sync_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    if d.get("readbacks"):
        return (f"{who} copies {d['readback_bytes']} bytes back from the device "
                f"{d['syncs_per_s']}/s, once every {d['launches'] / max(1, d['syncs']):.0f} "
                f"launches (.item()/.cpu() in the loop): each one waits for the GPU; "
                f"{d['sync_share']:.2%} of its time here")
    return (f"{who} spends {d['sync_share']:.0%} of its time in {ch.op} "
            f"({d['syncs_per_s']}/s, a sync every {d['launches'] / max(1, d['syncs']):.0f} "
            "launches): per-step host synchronization")


def _alloc_churn_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    return (f"{who} calls cudaMalloc/cudaFree {d['allocs_per_s']}/s after start-up "
            f"({d['alloc_share']:.1%} of its time): allocation churn")


def _startup_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    return (f"{who} spent {_ms(d['startup_ns'])} in {d['calls']} allocation call(s) before "
            f"its first launch, the first {d['first_op']} {_ms(d['first_ns'])} (the CUDA "
            "context's creation): start-up, paid once, not churn")


def _graph_recapture_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    return (f"{who} captured/instantiated graphs {d['captures']} times; the launch rate "
            f"fell {d['launch_rate_drop']:.0%} while it did")


def _dataloader_summary(ch: Chain, who: str, by: str | None) -> str:
    return (f"{who} lost {ch.impact:.1%} of its time preempted or queued for a CPU; its "
            f"{ch.detail['workers']} DataLoader workers ran for {ch.explained:.0%} of the "
            f"time it was preempted{'; most: ' + by if by else ''}")


def _gpu_idle_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    while_ = f"; {by} ran instead most" if by else ""
    return (f"GPU {d['device']} of {who} sat idle {_ms(int(d['idle_ns']))} in {d['gaps']} "
            f"gap(s); {ch.explained:.0%} of it ({_ms(int(d['covered_ns']))}) while a launching "
            f"thread was off the CPU or queued for it, mostly {d['dominant']}{while_}")


def _gpu_idle_fixes(ch: Chain) -> list[str]:
    """By the wait that covered most of the idle time: the CPU taken away (preempted,
    run queue), I/O or a kernel lock (D state), or the thread waiting for something
    (sleeping: input, a lock, a queue)."""
    v, d = ch.victim, ch.detail
    c = ch.culprits[0] if ch.culprits else None
    dominant = d.get("dominant")
    out: list[str]
    if dominant in ("preempted", "run queue"):
        out = [f"give the launching thread a core of its own: taskset -cp <core> {v['tid']}, "
               f"and keep other work off the cores of {v['comm']} (pid {v['pid']})"]
        if c is not None and not c.get("self"):
            out.append(f"lower the priority of {c['comm']} (pid {c['pid']}): renice -n 19 -p "
                       f"{c['pid']}, or move it to other cores")
    elif dominant == "D-state":
        out = ["move file and checkpoint I/O off the launching thread (a background writer, "
               "async checkpointing); find the file with ls -l /proc/<pid>/fd"]
    elif dominant == "off the CPU (state not recorded)":
        # An import whose profiler saw the switches but not why (nsys on Linux): which of
        # the fixes above applies is not known yet, so the first step is to find out.
        out = [f"record the run with fleetd trace beside the profiler to learn whether "
               f"{v['comm']} (pid {v['pid']}) was preempted, sleeping or in D state while "
               "the GPU idled; the imported trace did not record why it left the CPU"]
    else:
        out = ["find what the launching thread waits for while the GPU idles (the input "
               "pipeline, a lock, a queue): py-spy dump --pid " + str(v["pid"]),
               "prefetch input ahead of the step (more DataLoader workers, prefetch_factor, "
               "pin_memory, non_blocking copies)"]
    out.append("launch ahead of the GPU so host hiccups do not empty its queue: CUDA graphs "
               "(torch.compile mode='reduce-overhead'), fewer host syncs per step")
    return out


def _nccl_failures_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    errs = ", ".join(f"{e['op']} {e['ret']} {e['error']} x{e['count']}"
                     for e in d["by_error"][:3])
    more = f" and {len(d['by_error']) - 3} more" if len(d["by_error"]) > 3 else ""
    return (f"{d['failed']} of {d['calls']} NCCL calls of {who} failed ({errs}{more}): "
            "those collectives did not run")


def _nccl_failures_fixes(ch: Chain) -> list[str]:
    """By the errors seen: a bad call or a communicator that does not exist, a peer or
    the network, CUDA underneath, NCCL itself; always: NCCL's own log says why."""
    v = ch.victim
    rets = {int(e["ret"]) for e in ch.detail.get("by_error", [])}
    out = [f"run {v['comm']} (pid {v['pid']}) with NCCL_DEBUG=WARN (or INFO, with "
           "NCCL_DEBUG_SUBSYS=INIT,COLL) to get NCCL's reason for each failure"]
    if rets & {4, 5}:
        out.append("ncclInvalidArgument/ncclInvalidUsage: a call with a communicator that "
                   "was never created (its ncclCommInitRank failed: no GPU visible, see "
                   "CUDA_VISIBLE_DEVICES and nvidia-smi), a bad buffer, count or root, or "
                   "calls out of order between ranks")
    if rets & {2, 6}:
        out.append("ncclSystemError/ncclRemoteError: a peer rank died or the network "
                   "failed: look at the other ranks (fleetd explain --nodes), their logs, "
                   "NCCL_SOCKET_IFNAME / NCCL_IB_HCA and the links (dmesg, ibstat)")
    if 1 in rets:
        out.append("ncclUnhandledCudaError: a CUDA call inside NCCL failed: check the "
                   "device (nvidia-smi, Xid errors in dmesg) and the CUDA calls before it")
    if 3 in rets:
        out.append("ncclInternalError: an NCCL bug or a library mismatch between ranks: use "
                   "one NCCL version everywhere (python -c 'import torch; print(torch.cuda."
                   "nccl.version())')")
    return out


def _limited(d: Mapping[str, object]) -> str:
    """Whose limit it is, as a user knows it: the pod (and container), else the cgroup."""
    if d.get("pod"):
        ns = f"{d['namespace']}/" if d.get("namespace") else ""
        container = d.get("container_name") or d.get("container")
        return f"pod {ns}{d['pod']}" + (f" (container {container})" if container else "")
    return str(d["cgroup"])


def _cpu_throttled_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    return (f"{who} was kept off the CPU by its cgroup's CPU quota: {_limited(d)} allows "
            f"{d['cpus']:g} CPU ({d['quota_us']} us per {d['period_us']} us) and was "
            f"throttled in {d['throttled_period_share']:.0%} of its periods "
            f"({_share(ch)}); no process took that time from it")


def _cpu_throttled_fixes(ch: Chain) -> list[str]:
    d = ch.detail
    out = []
    if d.get("pod_uid") or d.get("pod"):
        out += ["raise or remove the pod's CPU limit (resources.limits.cpu): GPU pods are "
                "usually best with CPU requests and no CPU limit",
                "or make it a Guaranteed pod with whole CPUs under the kubelet's static CPU "
                "manager policy (cpuManagerPolicy: static), so its cores are its own"]
    else:
        out.append(f"raise or remove the quota: echo -1 > /sys/fs/cgroup/cpu{d['cgroup']}"
                   f"/cpu.cfs_quota_us (cgroup v1; on v2 write 'max' to cpu.max), or "
                   f"CPUQuota= of its systemd unit")
    out.append("fewer threads inside the quota: OMP_NUM_THREADS, torch.set_num_threads(), "
               "fewer DataLoader workers: each burns the same quota as the feeding thread")
    return out


def _memory_reclaim_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    limit = (f" at its cgroup's memory limit ({d['limit_bytes'] / (1 << 20):.0f} MiB, "
             f"{_limited(d)})" if d.get("limit_bytes") else "")
    return (f"{who} stalled {d['stalls']} time(s) reclaiming memory for its own "
            f"allocations{limit} ({_share(ch)}); no process took that time from it")


def _memory_reclaim_fixes(ch: Chain) -> list[str]:
    d = ch.detail
    out = []
    if d.get("limit_bytes"):
        if d.get("pod_uid") or d.get("pod"):
            out.append("raise the pod's memory limit (resources.limits.memory) above the "
                       "job's working set plus the page cache its input needs")
        else:
            out.append(f"raise the memory limit of {d['cgroup']} (memory.limit_in_bytes on "
                       "cgroup v1, memory.max on v2, MemoryMax= of its systemd unit)")
    else:
        out.append("the machine is short of free memory: fewer or smaller jobs per node, "
                   "or raise vm.min_free_kbytes so kswapd reclaims before allocations do")
    out += ["size what lives in the limit: pinned host buffers (pin_memory, "
            "cudaHostAlloc) and prefetch depth (DataLoader prefetch_factor), and read input "
            "with O_DIRECT or a smaller page-cache footprint (posix_fadvise DONTNEED after "
            "each shard)",
            "fewer DataLoader workers (num_workers): each holds its own batches and "
            "page cache inside the same limit"]
    if d.get("by_kind", {}).get("direct compaction"):
        out.append("compaction for huge pages: set transparent_hugepage/defrag to "
                   "'defer' or 'madvise' so allocations do not compact synchronously")
    return out


def _gc_pause_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    return (f"{who} stalled in the garbage collector between CUDA calls: {d['pauses']} "
            f"pause(s), longest {_ms(d['longest_ns'])}, {_ms(d['gc_ns'])} in all "
            f"({ch.impact:.1%} of wall, from {d['gc_samples']} of its {d['samples']} "
            "on-CPU samples)")


def _gc_pause_fixes(ch: Chain) -> list[str]:
    trig = ch.detail.get("triggers") or []
    where = f" (collections started at {trig[0]['frame']})" if trig else ""
    return ["call gc.freeze() once the model, the dataset index and other long-lived "
            "objects are loaded: the collector then never walks them again",
            "or gc.disable() for the training loop and gc.collect() at a step boundary "
            "(every N steps, while the GPU still has queued work), so a pause never lands "
            "between two launches",
            "keep fewer long-lived container objects" + where + ": bound per-step "
            "histories (collections.deque(maxlen=...)), store metrics as numbers or arrays "
            "instead of dicts and lists, build indexes as arrays (numpy, pyarrow)"]


def _host_cpu_bound_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    top = d["top_frames"][0] if d["top_frames"] else None
    lead = f"; top frame {top['frame']} with {top['share']:.0%} of its on-CPU samples" \
        if top else ""
    return (f"{who} was on the CPU outside CUDA calls {ch.impact:.1%} of wall time and "
            f"waited for the GPU {d['gpu_wait_share']:.1%}: the host sets the pace{lead}")


def _host_cpu_bound_fixes(ch: Chain) -> list[str]:
    top = ch.detail["top_frames"][0]["frame"] if ch.detail.get("top_frames") else None
    return [("move the work of " + top if top else "move preprocessing") + " off the "
            "feeding thread: into DataLoader workers (num_workers > 0), or onto the GPU",
            "fewer, bigger launches: larger batches, fused ops; CUDA graphs or "
            "torch.compile(mode='reduce-overhead') to cut per-launch Python and driver "
            "overhead",
            "profile the top frames (fleetd profile --pid PID --format folded | "
            "flamegraph.pl) and remove Python work per step (logging, .item() formatting, "
            "per-sample loops)"]


# ---- the registry -------------------------------------------------------------------

_ALL = (
    Cause("cpu_contention",
          "the thread was preempted, or runnable but queued for a CPU, while another task "
          "ran",
          ("spike", "stall", "off_cpu", "runq_wait", "cgroup_quota", "kernel_work"),
          _cpu_contention_fixes,
          why=lambda by: "preempted or queued for the CPU" + (f" while {by} ran" if by else "")),
    Cause("cpu_throttled",
          "the thread was runnable but held off the CPU by its cgroup's CPU quota (a "
          "Kubernetes CPU limit), whatever else the CPU did meanwhile",
          ("cgroup_quota",), _cpu_throttled_fixes, summary=_cpu_throttled_summary),
    Cause("memory_reclaim",
          "the thread stalled in the kernel reclaiming (or compacting) memory for its own "
          "allocations: its cgroup at its memory limit, or the machine short of memory",
          ("reclaim_stalls", "cgroup_memory", "memory_pressure", "cpu_profile"),
          _memory_reclaim_fixes,
          summary=_memory_reclaim_summary),
    Cause("lock_wait",
          "the thread waited in D state (a kernel lock, e.g. a shared file's inode lock) or "
          "slept outside a sync call until another process woke it",
          ("spike", "stall", "off_cpu", "lock_spin"), lock_wait_fixes,
          why=lambda by: "blocked in a D-state/lock wait" + (f" until {by} woke it"
                                                               if by else "")),
    Cause("block_io",
          "the thread waited in D state while block I/O requests were in flight",
          ("spike", "stall", "off_cpu", "block_io"), block_io_fixes,
          why=lambda by: "blocked on block I/O" + (f" issued by {by}" if by else "")),
    Cause("irq_preemption",
          "hard or soft interrupts ran on the thread's CPU during its calls",
          ("spike", "hardirq", "softirq"), _irq_fixes,
          why=lambda by: "preempted by interrupts"),
    Cause("host_sync",
          "sync calls every few launches take a large share of the thread's time, or a "
          "scalar is read back from the device every step",
          ("op_stats", "ratio", "readback", "call"), _advice("host_sync"),
          summary=_host_sync_summary),
    Cause("alloc_churn",
          "cudaMalloc/cudaFree keep being called after start-up (the process's first "
          "launch)",
          ("op_stats", "ratio", "call"), _advice("alloc_churn"), summary=_alloc_churn_summary),
    Cause("startup",
          "allocation calls before the process's first launch, the CUDA context's creation "
          "among them: a one-time start-up cost, LOW",
          ("call",), _advice("startup"), summary=_startup_summary),
    Cause("graph_recapture",
          "CUDA graphs are captured and instantiated again and again, and the launch rate "
          "drops while it happens",
          ("launch_rate", "call"), _advice("graph_recapture"), summary=_graph_recapture_summary),
    Cause("dataloader_oversubscription",
          "the tasks taking the CPU from the GPU-feeding thread are its own worker processes",
          ("spike", "stall", "off_cpu", "runq_wait", "preemption", "page_alloc"),
          _dataloader_fixes,
          why=lambda by: "preempted by its own DataLoader workers"
                         + (f" ({by})" if by else ""),
          summary=_dataloader_summary),
    Cause("lock_contention",
          "the GPU-feeding thread waited on a futex that another thread of its own process "
          "released: a lock that thread holds (in CPython most likely the interpreter lock)",
          ("lock_wait", "holder", "off_cpu"), lock_contention_fixes,
          summary=lock_contention_summary),
    Cause("data_starvation",
          "the GPU-feeding thread waited for input (a pipe, socket or queue) that other "
          "processes produce: too few or too slow producers",
          ("data_wait", "producer", "off_cpu"), data_starvation_fixes,
          summary=data_starvation_summary),
    Cause("pipe_blocked",
          "the GPU-feeding thread slept in writes to a full pipe, FIFO, socket or terminal "
          "until the process at the other end read from it: a slow reader (a log shipper, "
          "an SSH terminal, a remote collector)",
          ("peer_wait", "peer", "off_cpu"), pipe_blocked_fixes,
          summary=pipe_blocked_summary),
    Cause("gc_pause",
          "the GPU-feeding thread stalled in the Python garbage collector between CUDA "
          "calls (on-CPU samples in the collector)",
          ("gc_pause", "cpu_profile"), _gc_pause_fixes, summary=_gc_pause_summary),
    Cause("host_cpu_bound",
          "the GPU-feeding thread ran on the CPU outside CUDA calls most of its time and "
          "waited little for the GPU: the host is the bottleneck",
          ("cpu_profile", "gpu_idle_frames"), _host_cpu_bound_fixes,
          summary=_host_cpu_bound_summary),
    Cause("gpu_idle",
          "the GPU sat idle (imported GPU timeline) while the thread that launches its work "
          "was off the CPU, queued for it or in D state",
          ("gpu_gap", "off_cpu", "runq_wait"), _gpu_idle_fixes, summary=_gpu_idle_summary),
    Cause("nccl_failures",
          "NCCL calls returned an error (a ncclResult_t other than ncclSuccess): those "
          "collectives or communicators did not work",
          ("nccl_error", "call"), _nccl_failures_fixes, summary=_nccl_failures_summary),
    Cause("unexplained",
          "slow calls with no host cause on their thread: the time is on the GPU side",
          ("spike", "off_cpu"), _advice("unexplained"),
          why=lambda by: "with no host cause on its thread (GPU-side time)"),
)

CAUSES: Mapping[str, Cause] = MappingProxyType({c.name: c for c in _ALL})
"""Every root cause, by name, in the order the MCP tool description lists them."""


# A first culprit with less than this share of the attributed time is named as one of
# several in the summary, with its share.
MOST_OF_IT = 0.8


def summary(ch: Chain) -> str:
    """The chain's one-line summary."""
    v, c = ch.victim, (ch.culprits[0] if ch.culprits else None)
    cause = CAUSES.get(ch.root_cause)
    who = f"{v['comm']} (pid {v['pid']}, tid {v['tid']})"
    by = f"{c['comm']} (pid {c['pid']})" if c else None
    if c and c.get("self") and ch.root_cause == "block_io":
        by = f"its own process {by}"  # its own reads: said so, not as if another's
    if ch.spikes:
        tail = ""
        share = c.get("share") if c else None
        if by and c and isinstance(share, float) and share < MOST_OF_IT:
            # The sentence gives the cause's share of the extra time; where the first
            # culprit took only part of it, say so, or it reads as that culprit's.
            by, tail = f"{by} and others", f", {c['comm']} {share:.0%} of it"
        why = cause.why(by) if cause is not None and cause.why is not None else ch.root_cause
        return f"{_spike_head(ch, who)}: {why} for {ch.explained:.0%} of the extra " \
               f"time{tail} ({_share(ch)})"
    if cause is not None and cause.summary is not None:
        return cause.summary(ch, who, by)
    return f"{ch.root_cause} in {who}"


def _spike_head(ch: Chain, who: str) -> str:
    """What the thread went through: stalls between calls, slow calls, or both."""
    d = ch.detail
    n = d.get("spikes_scaled", len(ch.spikes))
    stalls, calls = d.get("stalls"), d.get("slow_calls")
    worst = _ms(d["worst_ns"])
    if stalls and calls:
        return (f"{who} stalled {stalls} time(s) between CUDA calls and {calls} CUDA call(s) "
                f"spiked, worst {worst}")
    if d.get("kind") == "stall":
        return f"{who} stalled {n} time(s) between CUDA calls, worst {worst}"
    return f"{ch.op} in {who} spiked {n} time(s) to {worst} (usual {_ms(d['baseline_ns'])})"


def _share(ch: Chain) -> str:
    """The chain's lost share, and of what: its thread's time in the breakdown column
    of its cause (chains.account), or, where there is none, what its spikes cost."""
    words = COLUMN_WORDS.get(str(ch.detail.get("share_of")))
    if not words:
        return f"{ch.impact:.1%} of wall"
    also = [str(k) for k in ch.detail.get("share_also") or [] if k in COLUMN_WORDS]
    if not also:
        return f"{ch.impact:.1%} of wall time {words}"
    # Each column's share as the breakdown prints it, then their sum (the impact).
    parts = [f"{ch.detail.get('share', 0.0):.1%} {words}"] + [
        f"{_also_share(ch.detail, k):.1%} {COLUMN_WORDS[k]}" for k in also]
    return f"{ch.impact:.1%} of wall time: {' and '.join(parts)}"


def _also_share(d: ChainDetail, column: str) -> float:
    """The share a chain states of a further breakdown column (``detail.share_also``):
    only kernel lock spinning is one (oncpu, beside a lock_wait's D state)."""
    return d.get("lock_spin_share", 0.0) if column == "lock_spin" else 0.0


def fixes(ch: Chain) -> list[str]:
    """Concrete actions for the chain (a cause not in the registry: the GPU-side advice)."""
    return CAUSES.get(ch.root_cause, CAUSES["unexplained"]).fixes(ch)
