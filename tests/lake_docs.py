"""What the lake tests share: the SQL blocks of docs/scale-out.md (so the documented
queries and table definitions are the ones the tests run) and a row comparison that
holds across engines."""

from __future__ import annotations

import math
import re
from typing import Any

from conftest import REPO


def doc_blocks(tag: str) -> list[tuple[str, str]]:
    """The ```sql blocks of docs/scale-out.md whose first line is ``-- TAG: name``."""
    text = (REPO / "docs" / "scale-out.md").read_text()
    out = []
    for body in re.findall(r"```sql\n(.*?)```", text, re.S):
        first, _, rest = body.partition("\n")
        m = re.fullmatch(rf"-- {tag}: (\S+)", first.strip())
        if m:
            out.append((m.group(1), rest.strip()))
    return out


def same_rows(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    """Equal as multisets of rows; floats to 1e-9 relative."""
    if len(a) != len(b):
        return False

    def key(r: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple((v is None, round(v, 3) if isinstance(v, float) else v) for v in r)

    for x, y in zip(sorted(a, key=key), sorted(b, key=key), strict=True):
        for u, v in zip(x, y, strict=True):
            if isinstance(u, float) or isinstance(v, float):
                if u is None or v is None or not math.isclose(u, v, rel_tol=1e-9):
                    return False
            elif u != v:
                return False
    return True
