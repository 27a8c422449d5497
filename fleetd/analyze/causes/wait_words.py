"""What the wait causes say: the fixes and summaries of ``block_io``, ``lock_wait``,
``lock_contention``, ``data_starvation`` and ``pipe_blocked``, the waits a thread spends
on a disk, a lock or another process (registered in fleetd.analyze.causes.causes, which holds
every cause's words; these are the longest, so they live apart).
"""

from __future__ import annotations

from fleetd.analyze.causes.chains import Chain

# Processes that poll the NVIDIA driver (NVML ioctls on /dev/nvidia*) and so take driver
# locks a CUDA thread also needs. Only the culprit's name is recorded (which files a
# process has open is not), so they are recognized by comm (15 characters at most).
DRIVER_POLLERS = ("nvidia-smi", "nvidia-persiste", "nv-hostengine", "dcgm", "nvtop")

def is_driver_poller(comm: object) -> bool:
    """True for a process known to poll the NVIDIA driver, by its name."""
    return str(comm or "").startswith(DRIVER_POLLERS)


def ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms" if ns >= 1_000_000 else f"{ns / 1e3:.0f} us"


def block_io_fixes(ch: Chain) -> list[str]:
    c = ch.culprits[0] if ch.culprits else None
    out = ["move checkpoint and log I/O off the training thread (async checkpointing, "
           "e.g. torch.distributed.checkpoint.async_save, or a background writer)",
           "write checkpoints less often, to fast local storage, without an fsync per "
           "write"]
    if c is not None and c["pid"] is not None and not c.get("self"):
        cp, cn = c["pid"], c["comm"]
        out.append(f"lower the I/O priority of {cn} (pid {cp}): ionice -c3 -p {cp}, or "
                   "cap it with a cgroup io.max")
    return out


def lock_wait_fixes(ch: Chain) -> list[str]:
    """A driver poller: the NVML advice. Anything else: the wait itself, D state (a
    kernel lock such as a shared file's inode lock) or a sleep ended by the culprit (a
    futex, pipe or socket), and what to do about the culprit's use of it."""
    v, c = ch.victim, (ch.culprits[0] if ch.culprits else None)
    vp, vc = v["pid"], v["comm"]
    cp, cn = (c["pid"], c["comm"]) if c else (None, None)
    pid = cp if cp is not None else "<pid>"
    if c is not None and is_driver_poller(cn):
        poller = f"{cn} (pid {cp})" if cp is not None else "the waking task"
        return [f"{poller} held what {vc} waited for: see what it does (cat "
                f"/proc/{pid}/stack, perf trace -p ...) and stop or slow its polling of the "
                "driver on GPU nodes",
                f"if it must run, renice -n 19 -p {pid} and schedule it outside training"]
    if c is None or cp is None:
        who = "another task"
    elif c.get("self"):
        who = f"another thread of {cn} (pid {cp})"
    else:
        who = f"{cn} (pid {cp})"
    host = ch.detail.get("host_ns")
    by_cause = host if isinstance(host, dict) else {}  # a spike chain's, by cause
    both = list(dict.fromkeys(str(p) for p in (pid, vp)))  # the culprit, then the victim
    if by_cause.get("d_state", 0) >= by_cause.get("sleep", 0):
        return [f"{vc} waited in D state until {who} woke it: they share a kernel lock, "
                "most likely the inode lock of a file both write; find the file (ls -l "
                f"{' '.join(f'/proc/{p}/fd' for p in both)}) and watch what it does "
                f"(perf trace -p {pid})",
                f"keep that file off the training thread's path: stop {who} rewriting it "
                "during training, give each writer its own file, or write it from a "
                "background thread"]
    return [f"{vc} slept until {who} woke it: it waited for a lock (futex) {who} held or "
            f"for its answer on a pipe or socket; see which (perf trace -p {','.join(both)}, "
            f"cat /proc/{pid}/stack)",
            f"take that wait off the training thread's path: no blocking call to {who} "
            "each step; hand it to a background thread, or have it hold the lock for less "
            "time"]


def lock_contention_fixes(ch: Chain) -> list[str]:
    """The interpreter lock: take the CPU work out of the process or out of the lock.
    Any other lock: name it by address and shorten what the holder does under it."""
    d, c = ch.detail, (ch.culprits[0] if ch.culprits else None)
    holder = (f"thread {c['thread'] or c['comm']} (tid {c['tid']})" if c
              else "the releasing thread")
    tid = c["tid"] if c else "<tid>"
    if d.get("gil"):
        return [f"move the CPU-bound Python work of {holder} out of the training process: "
                "a multiprocessing worker, or DataLoader workers for input work",
                "if that work is native code, release the GIL around it (ctypes calls do; "
                "in C/C++ extensions Py_BEGIN_ALLOW_THREADS, in pybind11 "
                "py::gil_scoped_release); numpy and torch ops release it already",
                f"batch that work or run it less often, and lower its thread's priority: "
                f"renice -n 19 -p {tid} (a thread id is a pid to renice)"]
    named = f"{d['lock_symbol']} " if d.get("lock_symbol") else ""
    return [f"{holder} holds the lock {named}at {d.get('lock_addr')} that the GPU-feeding "
            "thread waits for: shorten its critical section, or move that work outside "
            "the lock",
            "use finer-grained locks (one per queue or per buffer) or a lock-free handoff "
            "between the two threads",
            f"see where the holder takes it: py-spy dump --pid {ch.victim['pid']} (Python), "
            f"or perf record -g -t {tid} (native)"]


def data_starvation_fixes(ch: Chain) -> list[str]:
    """A producer at full CPU is the bottleneck: more of them, or cheaper batches. Idle
    producers wait on something else: their own input, or too small a queue."""
    if ch.detail.get("producer_bound"):
        return ["add producers: raise DataLoader num_workers (up to the free cores) so "
                "batches are made in parallel",
                "make each batch cheaper: decode and augment on the GPU (e.g. NVIDIA DALI, "
                "torchvision.io.decode_jpeg on device), or precompute and cache the data",
                "keep the pipeline full: prefetch_factor >= 2, persistent_workers=True, "
                "pin_memory=True so the copy overlaps compute"]
    return ["the producers are not busy: they wait on their own input (disk, network, "
            "a remote service); trace them too (fleetd trace --pid <producer>) and look "
            "at their waits",
            "give the queue more room (DataLoader prefetch_factor, a larger "
            "multiprocessing.Queue maxsize) so short stalls upstream do not reach the "
            "training thread"]


def pipe_blocked_fixes(ch: Chain) -> list[str]:
    """Room at the writer's end first, then the reader: by what the object is."""
    d, c = ch.detail, (ch.culprits[0] if ch.culprits else None)
    reader = f"{c['comm']} (pid {c['pid']})" if c else "the reader"
    logging = ("log asynchronously: hand lines to a background thread (logging's "
               "QueueHandler and QueueListener) or log every N steps, so a slow reader "
               "never blocks the training thread")
    kind = d.get("kind")
    if kind == "tty":
        return [f"write the output to a file instead of the terminal {d.get('object')} "
                "(python train.py > train.log, or nohup) and follow it with tail -f; run "
                "inside tmux or screen so a slow SSH link is not in the loop", logging]
    if kind == "socket":
        to = f" at {d['remote']}" if d.get("remote") else ""
        return [logging + f"; the collector{to} is slow to read: check it and the network",
                "write to a local file and let the shipper send it (the collector no longer "
                "paces the job); or a larger send buffer (SO_SNDBUF) for short bursts"]
    return [f"{reader} drains the pipe more slowly than the job writes: "
            "write the log to a file and let the shipper read the file (tail it) "
            "instead of the job's stdout",
            "a larger pipe for bursts: fcntl(fd, F_SETPIPE_SZ, 1 << 20) (up to "
            "/proc/sys/fs/pipe-max-size)", logging,
            f"speed up or lower the load on {reader}: less output per step, or more "
            "shipper throughput"]


def pipe_blocked_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    what = {"pipe": "a full pipe", "fifo": "a full FIFO", "socket": "a socket",
            "tty": "a terminal"}.get(str(d.get("kind")), "an fd")
    obj = f" ({d['object']}, fd {d['fd']})" if d.get("object") else f" (fd {d['fd']})"
    remote = f" to {d['remote']}" if d.get("remote") else ""
    peer = f": its reader {by} drains it too slowly" if by else ""
    return (f"{who} was blocked writing to {what}{obj}{remote} {d['blocked_share']:.1%} of "
            f"wall time, {d['waits']} write(s), longest {ms(d['longest_ns'])}{peer}")


def lock_contention_summary(ch: Chain, who: str, by: str | None) -> str:
    d, c = ch.detail, (ch.culprits[0] if ch.culprits else None)
    holder = f"thread {c['thread'] or c['comm']} (tid {c['tid']})" if c else "another thread"
    # Traced with stacks: where the holder was as it released the lock.
    at = f" in {c['where']}" if c and c.get("where") else ""
    lock = ("the interpreter lock (GIL)" if d.get("gil") and d.get("lock_symbol")
            else "the interpreter lock (GIL, most likely)" if d.get("gil")
            else f"the lock {d['lock_symbol']} at {d['lock_addr']}" if d.get("lock_symbol")
            else f"the lock at {d['lock_addr']}")
    busy = (f", which wanted the CPU {d['holder_busy']:.0%} of the time"
            if d.get("holder_busy") is not None else "")
    return (f"{who} lost {d['lock_share']:.1%} of its time waiting for {lock}, released by "
            f"{holder} of the same process{at}{busy}")


def data_starvation_summary(ch: Chain, who: str, by: str | None) -> str:
    d = ch.detail
    busy = d.get("producer_busy")
    state = (f"; the producer wanted the CPU {busy:.0%} of the time: it is the bottleneck"
             if d.get("producer_bound") else
             f"; the producer wanted the CPU only {busy:.0%} of the time: it waits on "
             "something else" if busy is not None else "")
    return (f"{who} lost {d['data_share']:.1%} of its time waiting for data from "
            f"{by or 'another process'}{state}")
