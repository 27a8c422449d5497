"""A real process chrooted in a directory tree, for tests of reads through
/proc/PID/root (no binary is needed inside the tree: the process chroots itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def chrooted(root: Path) -> Iterator[int]:
    """A real process chrooted in ``root`` (no binary needed inside: it chroots itself,
    says so, and waits for its stdin to close); its pid."""
    ready_r, ready_w = os.pipe()
    code = (f"import os, sys; os.chroot({str(root)!r}); os.write({ready_w}, b'x'); "
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             pass_fds=(ready_w,))
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        yield child.pid
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        os.close(ready_r)
