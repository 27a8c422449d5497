"""Bulk decode against the per-record decoder (a golden comparison), and the ring
reader on a real BPF ring buffer.

The buffer is built the way the kernel lays a ring out: every record kind the BPF
side emits (every op of the catalogue, with the fields that steer each branch of the
decoder set), a stacked record with Python frames, a record the producer discarded,
and one still being written, each behind its 8-byte header and padded to 8 bytes.
The per-record decoder (``Decoder.decode``, BCC's callback path) is the reference:
the bulk path (``split_frames`` + ``Decoder.decode_bulk``, with the launch-args reuse
in between batches) must give the very same batch.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import orjson
import pytest

from fleetd.store.catalog import BY_NAME, OPS
from fleetd.store.syscalls import NR
from fleetd.trace.bpf.bpfsrc import PYFRAME, PYSTACK_HEAD, REC
from fleetd.trace.bpf.decoder import Batch, Decoder
from fleetd.trace.bpf.ringbuf import (
    BUSY_BIT,
    DISCARD_BIT,
    FRAME,
    HDR,
    Chunk,
    RingReader,
    frame_size,
    split_frames,
)
from fleetd.trace.enrich.stacks import KernelNames
from fleetd.trace.enrich.symbols import FunctionSymbols

from netbed import why_no_bpf

OFFSET = 1_700_000_000_000_000_000
PID = 4242
KERNEL = 0x7F00_1234_5678


def rec(op: str, *, ts: int = 0, tid: int = PID, pid: int = PID, ret: int = 0,
        nbytes: int = 0, peer: int = 0, peer_pid: int = 0, a0: int = 0, a1: int = 0,
        stack: int = -1, flags: int = 1, x: tuple[int, int, int, int] = (0, 0, 0, 0),
        median: int = 0, func: int = 0, comm: bytes = b"") -> bytes:
    return REC.pack(10**9 + ts, 1000 + ts, pid, tid, BY_NAME[op].code, ret, nbytes, peer,
                    peer_pid, a0, a1, stack, flags, *x, median, func, comm)


def stacked(record: bytes, frames: list[tuple[int, int]]) -> bytes:
    body = PYSTACK_HEAD.pack(len(frames), 1) + b"".join(PYFRAME.pack(*f) for f in frames)
    return record + body + bytes(520 - len(body))  # struct fl_pystack: 32 frames


def every_kind() -> list[bytes]:
    """One or more records of every op, with the fields each branch reads."""
    dims = (2 | 3 << 32, 1 | 4 << 16 | 256 << 32, 128 | 1 << 32, 0x5000)
    comm = 0xC0FFEE
    out = []
    for i, op in enumerate(OPS):
        out.append(rec(op.name, ts=i, tid=PID + i % 3, x=(7, 8, 9, 10)))
    out += [
        # Launches: repeated (reuse of their args), another kernel, a driver launch,
        # one without a kernel, one slow (median kept).
        *[rec("cudaLaunchKernel", ts=100 + k, x=dims, func=KERNEL) for k in range(4)],
        rec("cudaLaunchKernel", ts=110, x=dims, func=KERNEL + 64),
        *[rec("cuLaunchKernel", ts=120 + k, x=dims, func=KERNEL + 128) for k in range(2)],
        rec("cudaLaunchKernel", ts=130, x=dims),
        rec("cudaLaunchKernel", ts=131, x=dims, func=KERNEL, flags=2, median=5000),
        rec("cudaStreamSynchronize", ts=140, flags=2, median=777, x=(0, 0, 0, 0xABC)),
        rec("cudaMemcpy", ts=141, flags=2, median=9000),
        # NCCL: a communicator made, used, split and destroyed.
        rec("ncclCommInitRank", ts=150, a0=4, a1=1, x=(0x1234_5678_9ABC_DEF0, comm, 0, 0)),
        rec("ncclAllReduce", ts=151, x=(7 | 0 << 32, comm, 1, 0x5000), nbytes=4096),
        rec("ncclReduceScatter", ts=152, x=(99 | 9 << 32, comm, 2, 0)),
        rec("ncclSend", ts=153, x=(1, comm, 1, 0), peer=2),
        rec("ncclCommSplit", ts=154, a0=1, a1=0, x=(comm, comm + 8, 0, 0)),
        rec("ncclCommDestroy", ts=155, x=(0, comm, 0, 0)),
        rec("ncclAllReduce", ts=156, x=(7, comm, 3, 0)),
        # Scheduler, block, lifecycle: peers' names, kernel stacks, futex waits.
        rec("off_cpu", ts=160, peer=77, peer_pid=70, a1=78, comm=b"hog\0",
            x=(int.from_bytes(b"prev-tas", "little"), int.from_bytes(b"k", "little"), 5, 0)),
        rec("off_cpu", ts=161, ret=NR["futex"] + 1, nbytes=0xDEAD0, peer=77, comm=b"hog"),
        rec("runq_wait", ts=162, peer=79, a1=80, comm=b"other",
            x=(int.from_bytes(b"ran-befo", "little"), int.from_bytes(b"re", "little"), 0, 0)),
        rec("wakeup", ts=163, peer=81, peer_pid=82, comm=b"waker"),
        rec("block_io", ts=164, tid=90, pid=91, comm=b"kworker",
            x=(int.from_bytes(b"WS", "little"), 0, 0, 0)),
        rec("fork", ts=170, peer=5000, comm=b"python"),
        rec("exec", ts=171, comm=b"train"),
        rec("exit", ts=172, a0=3, x=(1, 0, 0, 0)),
        rec("exit", ts=173, a0=0),
        rec("syscall", ts=174, tid=PID + 7, flags=2, median=10),
    ]
    # Stacked records: a launch with its Python frames, a wakeup with its waker's.
    out.append(stacked(rec("cudaLaunchKernel", ts=180, x=dims, func=KERNEL, stack=12),
                       [(0x1000, 0x20), (0x2000, 0x40)]))
    out.append(stacked(rec("wakeup", ts=181, peer=83, peer_pid=84, stack=-1), [(0x3000, 1)]))
    out.append(rec("cudaLaunchKernel", ts=182, x=dims, func=KERNEL))  # after a stacked one
    out.append(rec("cudaLaunchKernel", ts=183, x=dims, func=KERNEL, flags=2, median=6000))
    return out


def frame(blob: bytes, flags: int = 0) -> bytes:
    size = frame_size(len(blob))
    return HDR.pack(len(blob) | flags, 0) + blob + bytes(size - HDR.size - len(blob))


def kernel_names() -> KernelNames:
    """The real kernel namer, with the names of the buffer's kernels already known
    (no process to read them from): the same names go into both decoders' batches."""
    kn = KernelNames({}, FunctionSymbols())  # no fl_knames map: driver names off
    kn._names.update({(PID, KERNEL): "matmul_kernel", (PID, KERNEL + 64): "softmax",
                      (PID, KERNEL + 128): "drv_kernel"})
    return kn


def normal(batch: Batch) -> dict[str, Any]:
    """A batch as plain data; args that came as finished JSON text parsed back."""
    return {
        "rows": batch.rows,
        "args": sorted(((i, a if isinstance(a, dict) else orjson.loads(a))
                        for i, a in batch.args), key=lambda ia: ia[0]),
        "tasks": batch.tasks, "new_tids": batch.new_tids, "lifecycle": batch.lifecycle,
        "stacks": batch.stacks, "kstack_ids": batch.kstack_ids,
        "futex_waits": batch.futex_waits,
        "kernels": sorted({(i, p, o, f) for i, p, o, f in batch.kernels}),
    }


def merged(batches: list[Batch]) -> Batch:
    """Batches one after the other as one (row numbers shifted)."""
    out = Batch()
    for b in batches:
        at = len(out.rows)
        out.rows += b.rows
        out.args += [(i + at, a) for i, a in b.args]
        out.tasks += b.tasks
        out.new_tids += b.new_tids
        out.lifecycle += b.lifecycle
        for s in b.stacks:
            s.row += at
        out.stacks += b.stacks
        out.kstack_ids += [(i + at, k) for i, k in b.kstack_ids]
        out.futex_waits += [(i + at, p, a) for i, p, a in b.futex_waits]
        out.kernels += [(i + at, p, o, f) for i, p, o, f in b.kernels]
    return out


def test_bulk_decode_gives_the_rows_of_the_per_record_decoder() -> None:
    records = every_kind()
    ring = b"".join(map(frame, records))
    ring += frame(rec("cudaMemcpy", ts=999), DISCARD_BIT)  # given up by its producer
    tail = rec("cudaMemcpy", ts=1000)
    ring += frame(tail) + frame(rec("cudaFree", ts=1001), BUSY_BIT) + frame(tail)

    # The reference: one record at a time, then kernel names, as the tracer does.
    kn = kernel_names()
    ref = Decoder(lambda mono: mono + OFFSET)
    want = ref.decode([*records, tail])
    kn.resolve(want)

    # Bulk: split at the busy record; two batches, so the second reuses the finished
    # args of launches the first one saw.
    chunks, used = split_frames(ring)
    assert used == len(ring) - 2 * frame_size(REC.size)  # stopped at the busy record
    assert sum(c.count or 1 for c in chunks) == len(records) + 1  # the discarded skipped
    assert any(c.count > 1 for c in chunks) and any(c.count == 0 for c in chunks)
    bulk = Decoder(lambda mono: mono + OFFSET)
    batches = []
    for part in (chunks[: len(chunks) // 2], chunks[len(chunks) // 2:]):
        b = bulk.decode_bulk(part)
        kn.resolve(b)
        bulk.remember_launches(b)
        batches.append(b)
    assert any(isinstance(a, str) for _, a in batches[1].args), "no launch args reused"
    got = merged(batches)

    assert got.rows == want.rows
    want_n, got_n = normal(want), normal(got)
    # A launch whose args were reused has its name already: not asked for again.
    reused = {i for i, a in got.args if isinstance(a, str)}
    want_n["kernels"] = [k for k in want_n["kernels"] if k[0] not in reused]
    assert got_n == want_n
    assert bulk.records == ref.records == len(records) + 1


def test_split_frames_stops_at_a_cut_record() -> None:
    ring = frame(rec("cudaFree")) * 3
    chunks, used = split_frames(ring[:-10])
    assert used == 2 * FRAME and [c.count for c in chunks] == [2]
    assert split_frames(b"")[0] == []
    assert Chunk(b"", 0).count == 0


_WHY = why_no_bpf()

_RING_PROG = f"""
BPF_RINGBUF_OUTPUT(rb, 1);
TRACEPOINT_PROBE(raw_syscalls, sys_enter)
{{
    if (args->id != {NR["getppid"]} || (bpf_get_current_pid_tgid() >> 32) != {os.getpid()})
        return 0;
    u64 *r = rb.ringbuf_reserve({REC.size});
    if (!r)
        return 0;
    __builtin_memset(r, 0, {REC.size});
    r[0] = bpf_ktime_get_ns();
    r[3] = {BY_NAME["cudaFree"].code}; /* op (and ret = 0): after ts, dur, pid|tid */
    rb.ringbuf_submit(r, 0);
    return 0;
}}
"""


@pytest.mark.bpf
@pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
def test_ring_reader_takes_every_record_of_a_real_ring_across_wraps() -> None:
    """A one-page kernel ring filled and drained many times over: every record comes
    out once, in order, also where a frame wraps past the end of the data area."""
    from fleetd.trace.bpf.bpfsrc import compile_source
    from fleetd.trace.tracer import ensure_tracefs

    ensure_tracefs()
    bpf, _ = compile_source(_RING_PROG)
    try:
        table = bpf[b"rb"]
        reader = RingReader(table.map_fd, int(table.max_entries))
        libc = ctypes.CDLL(None)
        per_fill = table.max_entries // FRAME  # what one page holds
        dec = Decoder(lambda mono: mono)
        made = 0
        taken = 0
        last_ts = 0
        for _ in range(12):  # ~12 laps of the ring: its end is crossed mid-frame
            for _ in range(per_fill - 3):
                libc.getppid()  # the libc call, not Python's cached one
                made += 1
            chunks: list[Chunk] = []
            taken += reader.drain(chunks)
            batch = dec.decode_bulk(chunks)
            assert all(r[4] == BY_NAME["cudaFree"].code for r in batch.rows)
            stamps = [r[0] for r in batch.rows]
            assert stamps == sorted(stamps) and (not stamps or stamps[0] > last_ts)
            last_ts = stamps[-1] if stamps else last_ts
        assert taken == made and reader.available() == 0
        reader.close()
    finally:
        bpf.cleanup()


def test_a_peer_first_seen_without_its_process_gets_it_from_a_later_wakeup() -> None:
    """The task that ran before a switch comes without its pid; a later wakeup by the
    same thread names it. Both orders must leave the thread under its process (the
    native-mutex test lost its holder's process when the switch came first, so the
    holder looked like another process and no lock chain was made)."""
    holder, name = PID + 7, b"holder".ljust(16, b"\0")
    comm = int.from_bytes(name, "little")
    ran_before = rec("off_cpu", ts=1, a1=holder, x=(comm & (2**64 - 1), comm >> 64, 0, 0))
    woke = rec("wakeup", ts=2, peer=holder, peer_pid=PID, comm=name)
    for order in ([ran_before, woke], [woke, ran_before]):
        tasks = Decoder(lambda mono: mono).decode(order).tasks
        assert (holder, PID, "holder") in tasks, tasks
        assert all(pid == PID for tid, pid, _ in tasks if tid == holder and pid is not None)
