"""Stack frames as text: which frames are Python's, the short form people read, and the
folded lines flame-graph tools take. The tracer (fleetd/trace/enrich/stacks.py) writes Python
frames as ``qualname (/path/file.py:line)`` and native ones as ``function (lib.so)``."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from fleetd.printable import printable

_PY_FRAME = re.compile(r" \(([^()]*\.pyw?|<[^>]+>):(\d+)\)$")


def is_python_frame(frame: str) -> bool:
    """A Python frame (``name (file.py:123)``), not a native one."""
    return bool(_PY_FRAME.search(frame))


def short_frame(frame: str) -> str:
    """A frame with only its file's base name: ``step (train_loop.py:304)``."""
    m = _PY_FRAME.search(frame)
    if m is None:
        return frame
    return f"{frame[:m.start()]} ({PurePosixPath(m.group(1)).name}:{m.group(2)})"


def top_python_frame(frames: list[str]) -> str | None:
    """The innermost Python frame of a stack (innermost first): the user's line."""
    return next((short_frame(f) for f in frames if is_python_frame(f)), None)


def folded(frames: list[str], count: int) -> str:
    """One line of the folded format flame-graph tools read: frames outermost first,
    joined by ``;``, then a space and the count. The format has no quoting: a ``;``
    inside a frame (C++ templates rarely have one; a traced process can name a function
    or file with one) becomes ``:``, and a newline or other control character is shown
    escaped (fleetd.printable), so a frame can neither split nor add a line."""
    parts = [printable(short_frame(f)).replace(";", ":") for f in reversed(frames)]
    return f"{';'.join(parts) or '[no frames]'} {count}"
