"""The reference loop after a start-up that allocates: bench/accuracy.py's
``first_alloc`` scenario.

A training process allocates its weights, optimizer state and buffers once, right
after it starts (the first ``cudaMalloc`` also creates the CUDA context), and then
steps without allocating. Those first calls are start-up, not allocation churn: the
scenario is right when no ``alloc_churn`` chain above LOW, and no HIGH chain, is named.

Runs tests/workloads/train_loop.py's Workload with its arguments, plus ``--first-allocs
N`` (default 48) cudaMalloc calls and half as many cudaFree calls (scratch buffers
given back) after the go-file and before the first step. Prints train_loop's summary.
"""

from __future__ import annotations

import ctypes
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "workloads"))

from train_loop import Workload, parse_args  # noqa: E402


class FirstAllocs(Workload):
    """The loop, led by ``allocs`` allocations and ``allocs // 2`` frees."""

    allocs = 48

    def _loop(self, t0: int, deadline: int) -> int:
        kept = []
        for _ in range(self.allocs):
            p = ctypes.c_void_p()
            self._rec("cudaMalloc", self.rt.cudaMalloc(ctypes.byref(p), 64 << 20))
            kept.append(p)
        for p in kept[: self.allocs // 2]:
            self._rec("cudaFree", self.rt.cudaFree(p))
        return super()._loop(t0, deadline)


def main(argv: list[str]) -> int:
    allocs = 48
    if "--first-allocs" in argv:
        i = argv.index("--first-allocs")
        allocs = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    w = FirstAllocs(parse_args(argv))
    w.allocs = allocs
    print(json.dumps(asdict(w.run()), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
