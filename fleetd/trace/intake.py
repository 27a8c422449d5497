"""From the rings to the writer: decode what the rings hold, enrich it (stacks, kernel
names, wait channels, lock names), queue it, and keep the process rows up to date
(forks, execs, exits, renames, processes seen first as a waker or a culprit).

The CPU time this thread spends per stage (:data:`STAGES`) is counted in ``stage_ns``:
where each event's time goes (the writer's commits are in ``WriterStats.commit_cpu_ns``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from fleetd.store.schema import PLACEMENT_COLUMNS, ProcessFields
from fleetd.store.torchrun import job_of, ranks_of
from fleetd.store.writer import BatchWriter
from fleetd.trace.bpf.decoder import OP_EXEC, OP_EXIT, OP_FORK, Batch, Decoder, Lifecycle
from fleetd.trace.bpf.rings import DRAIN_BYTES, Rings
from fleetd.trace.enrich.fdpeers import FdNames
from fleetd.trace.enrich.stacks import KernelNames, StackResolver, WaitChannels
from fleetd.trace.enrich.symbols import LockNames
from fleetd.trace.host import procinfo
from fleetd.trace.host.cgroups import process_placement
from fleetd.trace.targets import Targets

STAGES = ("poll", "decode", "enrich", "queue")
FORGET_EVERY_S = 60.0  # how often the memos drop the tasks that have exited


def task_gone(tid: int) -> bool:
    """True when no process or thread has this id now (/proc/TID exists for threads too,
    though /proc lists only processes)."""
    return not os.path.exists(f"/proc/{tid}")


class Intake:
    def __init__(self, decoder: Decoder, targets: Targets) -> None:
        self.decoder = decoder
        self.targets = targets
        self.stage_ns: dict[str, int] = dict.fromkeys(STAGES, 0)
        # The enrichers; set by the tracer once the programs are loaded (None: off).
        self.stacks: StackResolver | None = None
        self.kernels: KernelNames | None = None
        self.wchan: WaitChannels | None = None
        self._locks = LockNames()
        self._fds = FdNames()  # what reads and writes slept on, and its other end
        self._proc_comm: dict[int, str] = {}  # the name each process row was given

    def forget_gone(self, gone: Callable[[int], bool]) -> int:
        """Forget the processes and threads for which ``gone(id)`` (decoder's memos and
        the process names given): see :meth:`Decoder.forget_gone`."""
        dead = [pid for pid in self._proc_comm if gone(pid)]
        for pid in dead:
            del self._proc_comm[pid]
        return len(dead) + self.decoder.forget_gone(gone)

    def drain(self, rings: Rings, writer: BatchWriter, max_bytes: int | None = DRAIN_BYTES
              ) -> int:
        """Take what every mapped ring holds, decode it in bulk and store it."""
        clock, st = time.thread_time_ns, self.stage_ns
        t0 = clock()
        chunks = rings.take_chunks(max_bytes)
        t1 = clock()
        st["poll"] += t1 - t0
        if not chunks:
            return 0
        batch = self.decoder.decode_bulk(chunks)
        st["decode"] += clock() - t1
        self.store(batch, writer)
        return len(batch.rows)

    def flush_pending(self, rings: Rings, writer: BatchWriter) -> int:
        """Decode and store the records BCC's callbacks copied (rings not mapped)."""
        blobs = rings.take_pending()
        if not blobs:
            return 0
        t0 = time.thread_time_ns()
        batch = self.decoder.decode(blobs)
        self.stage_ns["decode"] += time.thread_time_ns() - t0
        self.store(batch, writer)
        return len(blobs)

    def store(self, batch: Batch, w: BatchWriter) -> None:
        clock, st = time.thread_time_ns, self.stage_ns
        t0 = clock()
        if batch.stacks and self.stacks is not None:
            self.stacks.resolve(batch, w)
        if batch.kernels and self.kernels is not None:
            self.kernels.resolve(batch)
        self.decoder.remember_launches(batch)
        if batch.kstack_ids and self.wchan is not None:
            self.wchan.resolve(batch)
        self._locks.resolve(batch)
        self._fds.resolve(batch)
        t1 = clock()
        st["enrich"] += t1 - t0
        # Args may be finished JSON text (repeated launches), which add_events takes
        # as it is; its signature names only the dicts other callers pass.
        w.add_events(batch.rows, batch.args)
        st["queue"] += clock() - t1
        if batch.tasks:
            w.add_tasks(batch.tasks)
        seen = [(tid, pid, procinfo.comm(pid, tid)) for tid, pid in batch.new_tids]
        if seen:
            w.add_tasks(seen)
        for ev in batch.lifecycle:
            self._lifecycle(ev, w)
        self._rename_processes([*batch.tasks, *seen], w)

    def _rename_processes(self, tasks: list[tuple[int, int | None, str | None]],
                          w: BatchWriter) -> None:
        """A process that names itself after fork (prctl PR_SET_NAME in a worker: a
        DataLoader worker, a producer) shows it on its main thread's comm; the process
        row, read at fork, still has the parent's name: carry the new one over."""
        renamed: list[ProcessFields] = []
        for tid, pid, comm in tasks:
            # A main thread (tid == pid); a peer's pid is often unknown (None), but a tid
            # that has a process row of ours is that process's main thread too.
            main = tid == pid or (pid is None and tid in self._proc_comm)
            if main and comm and self._proc_comm.get(tid) != comm:
                first = tid not in self._proc_comm
                self._proc_comm[tid] = comm
                row: ProcessFields = {"pid": tid, "comm": comm}
                if first:
                    row.update(_job_of(tid))
                renamed.append(row)
        if renamed:
            w.add_processes(renamed)

    def _lifecycle(self, ev: Lifecycle, w: BatchWriter) -> None:
        if ev.op == OP_FORK and ev.child:
            self.targets.pids.setdefault(ev.child, "child")
            row = procinfo.process_row(ev.child)
            row["ppid"] = ev.pid
            row["start_ns"] = row.get("start_ns") or ev.ts_ns
            row["comm"] = row["comm"] or ev.comm  # a child's comm is its parent's at fork
            self._proc_comm[ev.child] = str(row["comm"] or "")
            w.add_processes([row])
        elif ev.op == OP_EXEC:
            row = procinfo.process_row(ev.pid)
            row["comm"] = row["comm"] or ev.comm  # short-lived: /proc may be gone already
            self._proc_comm[ev.pid] = str(row["comm"] or "")
            w.add_processes([row])
            self.targets.rescan_soon()
            self.targets.execed.add(ev.pid)
        elif ev.op == OP_EXIT:
            self.targets.exited[ev.pid] = ev.exit_code
            w.add_processes([{"pid": ev.pid, "exit_ns": ev.ts_ns, "exit_code": ev.exit_code}])


def _job_of(pid: int) -> ProcessFields:
    """The torchrun job of a process seen first as a waker or a culprit, without its
    rank: a rank that another node traces must be known here as one of the job (a
    peer's wait is the collective's, never a data-starvation cause), yet must not count
    among this node's own ranks (tracks, rank books). Its parent tells a worker of the
    traced rank (which inherits the rank's environment) from a peer. Where it runs (its
    cgroup, container and pod) comes with it: a culprit is named with its pod too."""
    env = procinfo.environ(pid)
    found = process_placement(pid, env)
    place: ProcessFields = {}
    for key in PLACEMENT_COLUMNS:
        if found[key] is not None:
            place[key] = found[key]
    if "RANK" not in env:
        return place
    place["ppid"] = procinfo.ppid_of(pid)
    place["world_size"] = ranks_of(env)["world_size"]
    place["job"] = job_of(env)
    return place
