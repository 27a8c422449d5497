"""Tracks whose slices nest: the rule Perfetto and chrome://tracing both require.

A *group* is what a user thinks of as one track (a thread, a node's block I/O). Slices
arrive in start order; each goes to the first lane of its group where it nests inside
the innermost open slice (or where nothing is open). A slice that would straddle an open
one's end opens a new lane, shown just below the first, so no lane ever holds two
overlapping slices that do not nest. Memory is the open slices, not the events.
"""

from __future__ import annotations

from collections.abc import Callable


class Group:
    """One logical track and its lanes (each lane is one trace ``tid``)."""

    __slots__ = ("name", "sort_base", "tids", "stacks", "new_lane")

    def __init__(self, name: str, sort_base: int, first_tid: int,
                 new_lane: Callable[[Group], int]) -> None:
        self.name = name
        self.sort_base = sort_base
        self.tids: list[int] = [first_tid]
        self.stacks: list[list[int]] = [[]]  # per lane: end times of the open slices
        self.new_lane = new_lane  # allocates and announces the tid of an extra lane

    def place(self, ts: int, end: int) -> int:
        """The tid of the lane where a slice [ts, end) nests; ``ts`` never decreases."""
        for i, stack in enumerate(self.stacks):
            while stack and stack[-1] <= ts:
                stack.pop()
            if not stack or stack[-1] >= end:
                stack.append(end)
                return self.tids[i]
        tid = self.new_lane(self)
        self.tids.append(tid)
        self.stacks.append([end])
        return tid
