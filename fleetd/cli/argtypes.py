"""Argument types shared by several commands, each with an error that names the option."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def byte_size(text: str) -> int:
    """``10G``, ``512MiB``, ``1.5g`` or a bare number of bytes. Units are binary
    (1G = 1024^3 bytes), as ``du -h`` and ``ls -h`` print them."""
    m = _SIZE.match(text)
    if m is None or (m.group(3) and not m.group(2) and m.group(3).lower() != "b"):
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use a number with an optional unit, e.g. 10G, 512M")
    value = int(float(m.group(1)) * _SCALE[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be more than zero")
    return value


def positive(name: str) -> Callable[[str], int]:
    """An argparse type for a positive integer whose error names the option."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value <= 0:
            raise argparse.ArgumentTypeError(f"invalid {name} {text!r}: use a positive "
                                             "integer")
        return value

    return parse
