"""User stacks of emitted CUDA records: symbolized while the process is alive.

The kernel keeps stack ids in a stack map; here each (pid, id) is walked and
symbolized once, hashed by content and stored once in the ``stacks`` table. Native
stacks are short on these machines (no frame pointers), but the innermost frames
still tell which library and function called into CUDA.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import orjson

from fleetd.store.writer import BatchWriter
from fleetd.trace.decoder import Batch

log = logging.getLogger("fleetd.trace.stacks")


def stack_hash(frames: list[str]) -> int:
    """A signed 64-bit content hash (fits SQLite's INTEGER), 0 reserved for none."""
    digest = hashlib.blake2b(orjson.dumps(frames), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


class StackResolver:
    def __init__(self, bpf: Any) -> None:
        self.bpf = bpf
        self.table = bpf[b"fl_stacks"]
        self._cache: dict[tuple[int, int], int] = {}

    def frames(self, stack_id: int, pid: int) -> list[str]:
        out = []
        for addr in self.table.walk(stack_id):
            sym = self.bpf.sym(addr, pid, show_module=True, show_offset=True)
            out.append(sym.decode(errors="replace") if isinstance(sym, bytes) else str(sym))
        return out

    def resolve(self, batch: Batch, writer: BatchWriter) -> None:
        new: list[tuple[int, list[str]]] = []
        for row_i, stack_id, pid in batch.stack_ids:
            h = self._cache.get((pid, stack_id))
            if h is None:
                try:
                    frames = self.frames(stack_id, pid)
                except Exception as exc:  # a stack id evicted or a process gone
                    log.debug("stack %d of pid %d unreadable: %s", stack_id, pid, exc)
                    continue
                if not frames:
                    continue
                h = stack_hash(frames)
                self._cache[(pid, stack_id)] = h
                new.append((h, frames))
            row = batch.rows[row_i]
            batch.rows[row_i] = (*row[:10], h)
        if new:
            writer.add_stacks(new)
