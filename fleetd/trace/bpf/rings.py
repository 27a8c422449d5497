"""The tracer's ring buffers, one per layer, and how their records are taken.

Each ring is mapped into this process and read in bulk (:mod:`fleetd.trace.bpf.ringbuf`),
with one epoll set to wait on them all. Where a ring cannot be mapped (or
``FLEETD_NO_RING_MMAP`` is set), BCC's per-record callbacks copy each record into a
pending list instead; the caller decodes either kind with the matching decoder path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
from collections.abc import Callable
from typing import Any

from fleetd.trace.bpf.bpfsrc import RINGS
from fleetd.trace.bpf.ringbuf import Chunk, RingReader

log = logging.getLogger("fleetd.trace.bpf.rings")

# Bytes taken from one ring per drain: bounds a batch (and the time it holds the GIL)
# when a ring is full; whatever is left is taken on the next poll, at once.
DRAIN_BYTES = 4 << 20


class Rings:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}  # ring -> records taken from it
        # Rings mapped into this process and read in bulk; empty when BCC's per-record
        # callbacks are used instead. Cleared, never replaced: the tracer shows this dict.
        self.readers: dict[str, RingReader] = {}
        self._epoll: select.epoll | None = None
        self._pending: list[bytes] = []  # records the callbacks copied, not yet taken

    @property
    def mapped(self) -> bool:
        return self._epoll is not None

    def open(self, bpf: Any, rings: list[str]) -> None:
        for ring in rings:
            self.counts[ring] = 0
        try:
            if os.environ.get("FLEETD_NO_RING_MMAP"):
                raise OSError("disabled by FLEETD_NO_RING_MMAP")
            self._map(bpf, rings)
            return
        except OSError as exc:  # no mmap of ring buffers here: BCC's callbacks instead
            self.close()
            log.info("ring buffers not mappable (%s); reading them record by record", exc)
        for ring in rings:
            bpf[RINGS[ring].encode()].open_ring_buffer(self._make_callback(ring))

    def _map(self, bpf: Any, rings: list[str]) -> None:
        ep = self._epoll = select.epoll()
        for ring in rings:
            table = bpf[RINGS[ring].encode()]
            reader = RingReader(table.map_fd, int(table.max_entries))
            self.readers[ring] = reader
            ep.register(reader.fd, select.EPOLLIN)

    def close(self) -> None:
        """Unmap the rings; before the maps' fds close."""
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None

    def _make_callback(self, ring: str) -> Callable[[Any, int, int], int]:
        pending, counts, string_at = self._pending, self.counts, ctypes.string_at

        def callback(_ctx: Any, data: int, size: int) -> int:
            pending.append(string_at(data, size))
            counts[ring] += 1
            return 0

        return callback

    def wait(self, bpf: Any, timeout_ms: int) -> None:
        """Up to ``timeout_ms`` for records; on the callback path, runs the callbacks."""
        if self._epoll is not None:
            if not self.backlog():
                # The BPF side wakes us only every few hundred records (fl_submit), so
                # a quiet ring is also drained when the wait times out.
                self._epoll.poll(timeout_ms / 1000)
        else:
            bpf.ring_buffer_poll(timeout_ms)
            # Records that arrived without a wakeup too.
            bpf.ring_buffer_consume()

    def backlog(self) -> int:
        """Bytes waiting in the mapped rings (0 when read through BCC's callbacks)."""
        return sum(r.available() for r in self.readers.values())

    def take_chunks(self, max_bytes: int | None = DRAIN_BYTES) -> list[Chunk]:
        """What every mapped ring holds, up to ``max_bytes`` from each."""
        chunks: list[Chunk] = []
        for ring, reader in self.readers.items():
            self.counts[ring] += reader.drain(chunks, max_bytes)
        return chunks

    def take_pending(self) -> list[bytes]:
        """The records the callbacks copied since the last take."""
        blobs = self._pending[:]
        del self._pending[:]
        return blobs
