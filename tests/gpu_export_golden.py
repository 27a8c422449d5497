"""The ``gpu_export`` scenario: a small slice of a real PyTorch profiler trace (rank 0 of
``tests/data/gpu/sampled_rank-0.json.gz``, 4 ms around the first NCCL launch), imported
and exported; its timeline is the golden file ``tests/data/gpu_export/trace.json``.

The slice and the golden file change only through this script:

    .venv/bin/python tests/gpu_export_golden.py --write    # cut the slice, export, write both
    .venv/bin/python tests/gpu_export_golden.py            # compare, exit 1 on a difference

What the slice holds: the process and thread names, every ``cuda_runtime`` call that
starts in the window, every kernel, copy and set those calls launched or that starts in
the window (an NCCL SendRecv kernel among them, three streams), and the ``cpu_op`` and
``user_annotation`` ranges that lie wholly inside it.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from export_golden import write_or_compare  # noqa: E402

from fleetd.cli.main import main as fleetd_main  # noqa: E402

SOURCE = ROOT / "tests" / "data" / "gpu" / "sampled_rank-0.json.gz"
HERE = ROOT / "tests" / "data" / "gpu_export"
SLICE = HERE / "rank-0-slice.json"
GOLDEN = HERE / "trace.json"
LO_US, HI_US = 1682725898093500, 1682725898097500
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def cut() -> dict[str, Any]:
    """The slice, from the shared trace (deterministic: same input, same bytes)."""
    doc = orjson.loads(gzip.decompress(SOURCE.read_bytes()))
    events = doc["traceEvents"]
    calls = [e for e in events if e.get("cat") == "cuda_runtime" and LO_US <= e["ts"] < HI_US]
    corr = {e["args"].get("correlation") for e in calls}
    gpu = [e for e in events if e.get("cat") in GPU_CATS
           and (e["args"].get("correlation") in corr or LO_US <= e["ts"] < HI_US)]
    ranges = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")
              and e["ts"] >= LO_US and e["ts"] + e["dur"] <= HI_US]
    meta = [e for e in events if e.get("ph") == "M"]
    return {"distributedInfo": doc["distributedInfo"],
            "traceEvents": meta + calls + gpu + ranges}


def export(tmp: Path, chains: str = "none") -> bytes:
    db, trace = tmp / "slice.db", tmp / "trace.json"
    assert fleetd_main(["import", str(SLICE), "--db", str(db)]) == 0
    assert fleetd_main(["export", "--db", str(db), "-o", str(trace), "--chains", chains]) == 0
    return trace.read_bytes()


def main(argv: list[str]) -> int:
    import tempfile

    if "--write" in argv:
        HERE.mkdir(parents=True, exist_ok=True)
        SLICE.write_bytes(orjson.dumps(cut(), option=orjson.OPT_INDENT_2) + b"\n")
    with tempfile.TemporaryDirectory() as d:
        data = export(Path(d))
    return write_or_compare(GOLDEN, data, "--write" in argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
