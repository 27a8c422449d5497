"""The reference workload (train_loop.py) in a process that keeps many Python objects:
a dataset index of dicts built at start-up and a per-step history that grows, as a
training script that records every step's metrics does. CPython's collector then runs
full collections every few seconds, each one walking the whole index while the feeding
thread makes no CUDA call.

``--gc-freeze``: the fix: ``gc.freeze()`` once the index is built (the collector never
walks it again) and a bounded history. Every other option is train_loop.py's.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_loop import Workload, parse_args  # noqa: E402


class GcWorkload(Workload):
    def __init__(self, argv: list[str], index_size: int, per_step: int, freeze: bool) -> None:
        super().__init__(parse_args(argv))
        self.per_step = per_step
        # The index: one dict per item, each with a nested dict and a list (containers
        # the collector tracks), kept for the whole run.
        self.index = {i: {"id": i, "path": f"/data/{i:08d}.bin", "meta": {"len": i % 977},
                          "labels": [i % 10, i % 7]} for i in range(index_size)}
        self.history: Any = collections.deque(maxlen=20) if freeze else []
        if freeze:
            gc.freeze()

    def step(self) -> None:
        super().step()
        # What the step keeps: per-step metrics, each a dict holding a list (a dict of
        # plain values alone is not tracked by the collector).
        self.history.append([{"loss": [0.1], "n": k} for k in range(self.per_step)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--gc-freeze", action="store_true")
    p.add_argument("--index-size", type=int, default=300_000)
    p.add_argument("--per-step", type=int, default=300, help="records kept per step")
    a, rest = p.parse_known_args()
    summary = GcWorkload(rest, a.index_size, a.per_step, a.gc_freeze).run()
    print(json.dumps(asdict(summary), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
