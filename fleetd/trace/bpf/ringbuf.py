"""BPF ring buffers read in bulk, without a Python call per record.

BCC's ``ring_buffer_poll`` calls back into Python once per record (a ctypes callback
costs about a microsecond by itself). A ``BPF_MAP_TYPE_RINGBUF`` map can instead be
mapped into this process and read directly, the way libbpf's consumer does:

* page 0 (read-write): the consumer position, a u64 only we advance;
* page 1 (read-only): the producer position, a u64 the kernel advances;
* then the data area, mapped twice back to back, so a record that wraps around the
  end is still contiguous in memory.

Each record is an 8-byte header (u32 length with a BUSY bit while the producer still
writes it and a DISCARD bit when it gave it up, u32 page offset) and the record
itself, the whole rounded up to 8 bytes. Records are consumed in order and the
consumer stops at the first one still busy (another CPU reserved it and has not
committed), exactly as libbpf does.

fleetd's records are nearly all one fixed size (``struct fl_rec``), so what is
available is usually a run of equal frames. :meth:`RingReader.drain` finds the
longest run of them with a few strided byte comparisons (C speed, not a loop over
records), copies it out as one ``bytes`` and moves the consumer position past it;
the decoder then unpacks it with one ``struct.iter_unpack`` (``FAST``). Odd records (stacked
records, which carry Python frames after the fixed part) come out one by one.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import struct
from dataclasses import dataclass

from fleetd.trace.bpf.bpfsrc import REC

log = logging.getLogger("fleetd.trace.bpf.ringbuf")

HDR = struct.Struct("<II")  # len (with BUSY/DISCARD bits), page offset
BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
LEN_MASK = ~(BUSY_BIT | DISCARD_BIT) & 0xFFFFFFFF
_POS = struct.Struct("<Q")


def frame_size(length: int) -> int:
    """Bytes a record of ``length`` takes in the ring: header + record, 8-aligned."""
    return (length + HDR.size + 7) & ~7


# Bytes a plain record takes in the ring, its header included.
FRAME = frame_size(REC.size)
# One plain frame as the bulk decoder reads it, only what its inline cases use (ts,
# dur, pid, tid, op, ret, bytes, peer, a0, a1, flags, x0..x3, median, func): skipping
# the header, the peer's pid, the stack id and the comm makes each tuple a quarter
# cheaper to build. Other records are unpacked again whole (REC, past the header).
FAST = struct.Struct("<8xQQIIIiQI4xqq4xI4QQQ16x" + "x" * (FRAME - HDR.size - REC.size))
assert FAST.size == FRAME and REC.format == "<QQIIIiQIIqqiI4QQQ16s", "fl_rec changed"
# The header's 4 length bytes of a committed plain record.
_LEN_BYTES = REC.size.to_bytes(4, "little")


@dataclass(slots=True)
class Chunk:
    """Records drained from one ring: ``count`` framed plain records back to back in
    ``raw`` (``FRAME`` bytes each, header included), or, with ``count`` == 0, one odd
    record without its header (a stacked record)."""

    raw: bytes
    count: int


def uniform_prefix(view: memoryview, n: int) -> int:
    """How many of the first ``n`` frames of ``view`` are committed plain records
    (length == REC.size, neither busy nor discarded): the first frame that is not
    ends the run. Strided slices compare every header's four length bytes at once."""
    if n <= 0:
        return 0
    end = n * FRAME
    k = n
    for pos, want in enumerate(_LEN_BYTES):
        col = bytes(view[pos:end:FRAME])
        same = len(col) - len(col.lstrip(bytes((want,))))
        if same < k:
            k = same
            if k == 0:
                break
    return k


def split_frames(buf: bytes | memoryview) -> tuple[list[Chunk], int]:
    """Cut a run of ring bytes (headers included, starting at a record) into chunks,
    as :meth:`RingReader.drain` does: the chunks, and how many bytes were consumed
    (a busy record, or a record cut by the end of ``buf``, stops the walk)."""
    view = memoryview(buf)
    out: list[Chunk] = []
    at, total = 0, len(buf)
    while at + HDR.size <= total:
        k = uniform_prefix(view[at:], (total - at) // FRAME)
        if k:
            out.append(Chunk(bytes(view[at:at + k * FRAME]), k))
            at += k * FRAME
            continue
        length, _ = HDR.unpack_from(view, at)
        if length & BUSY_BIT:
            break
        size = frame_size(length & LEN_MASK)
        if at + size > total:
            break
        if not length & DISCARD_BIT:
            out.append(Chunk(bytes(view[at + HDR.size:at + HDR.size + length]), 0))
        at += size
    return out, at


class RingReader:
    """One ring buffer map, mapped into this process; :meth:`drain` takes what is
    committed, in bulk. ``size`` is the map's data size (max_entries, a power of two)."""

    def __init__(self, map_fd: int, size: int) -> None:
        if size <= 0 or size & (size - 1):
            raise ValueError(f"ring buffer size {size} is not a power of two")
        page = mmap.PAGESIZE
        self.fd = map_fd
        self.size = size
        self._mask = size - 1
        self._cons_map = mmap.mmap(map_fd, page, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod_map = mmap.mmap(map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ,
                                   offset=page)
        # A ctypes u64 over the consumer page: one aligned 8-byte store per update, so
        # the kernel never sees a torn position.
        self._cons = ctypes.c_uint64.from_buffer(self._cons_map)
        self._data = memoryview(self._prod_map)[page:]
        self.records = 0
        self.bytes = 0

    def available(self) -> int:
        """Bytes the producer has committed or reserved past our position."""
        prod: int = _POS.unpack_from(self._prod_map, 0)[0]
        return prod - int(self._cons.value)

    def drain(self, out: list[Chunk], max_bytes: int | None = None) -> int:
        """Append what is committed to ``out`` (at most about ``max_bytes``) and give
        the space back to the kernel; returns the number of records taken."""
        taken = 0
        while True:
            cons = int(self._cons.value)
            prod: int = _POS.unpack_from(self._prod_map, 0)[0]
            avail = prod - cons
            if avail <= 0:
                break
            if max_bytes is not None:
                avail = min(avail, max(max_bytes, FRAME))
            off = cons & self._mask
            chunks, used = split_frames(self._data[off:off + avail])
            if used == 0:
                break  # the next record is still being written
            for c in chunks:
                taken += c.count or 1
            out.extend(chunks)
            self._cons.value = cons + used  # the kernel may now reuse that space
            self.bytes += used
            if max_bytes is not None:
                max_bytes -= used
                if max_bytes <= 0:
                    break
        self.records += taken
        return taken

    def close(self) -> None:
        # The exported buffers must be released before the maps can close; a view
        # still held elsewhere leaves the unmapping to the garbage collector.
        del self._cons
        self._data.release()
        try:
            self._cons_map.close()
            self._prod_map.close()
        except BufferError as exc:
            log.debug("ring buffer mapping still in use: %s", exc)
