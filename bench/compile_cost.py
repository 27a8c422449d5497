"""CPU cost of a cold compile of fleetd's BPF programs: what a default ``fleetd trace``
compiles when the compiled-program cache has no entry for them.

Each run is a fresh process (BCC keeps per-process state, such as the kernel symbols
its rewriter reads, that a start does not have) that compiles, without loading, the
source and flags ``compile_program`` would compile, and reports the CPU seconds of
that compile (user + system, which the machine's other load leaves nearly alone) and
the instructions it produced. ``complete`` is the same with the per-op programs of the
per-symbol probe ladder (what a start on a kernel without uprobe_multi compiles).

``--repo DIR`` measures another checkout's sources with this script (its ``fleetd``
package is imported from there): before and after a change, on the same machine.

Last line: ``BENCH compile_cost start_compile_cpu_s=.. complete_compile_cpu_s=..
start_insns=.. complete_insns=..`` (CPU: the median of ``--runs`` runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _bpf_sources(repo: Path) -> None:
    """``fleetd.bpf`` (the C sources) from ``repo``: an editable install maps the package
    to its own checkout's bpf/, whatever PYTHONPATH says."""
    spec = importlib.util.spec_from_file_location(
        "fleetd.bpf", repo / "bpf" / "__init__.py", submodule_search_locations=[str(repo / "bpf")])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fleetd.bpf"] = module
    spec.loader.exec_module(module)


def once(complete: bool) -> dict[str, float]:
    """One compile in this process, of the checkout in the current directory:
    {"cpu_s", "insns"}."""
    _bpf_sources(Path.cwd())
    from fleetd.trace.bpf import bpfsrc
    from fleetd.trace.enrich.oncpu import DEFAULT_HZ

    asked: dict[str, Any] = {}

    def caught(text: str, flags: list[str] | None = None, params: Any = None,
               say: Any = None, complete: str | None = None) -> tuple[None, None]:
        asked.update(text=text, flags=flags or [], complete=complete)
        return None, None

    # What the start compiles: compile_program's own choice of source and flags.
    bpfsrc.compile_source = caught  # type: ignore[assignment]
    bpfsrc.compile_program(bpfsrc.ProgramOptions(tracer_pid=os.getpid(),
                                                 cpu_sample_hz=DEFAULT_HZ))
    text = (asked.get("complete") or asked["text"]) if complete else asked["text"]
    before = _cpu_s()
    bpf, _route = bpfsrc._compile(text, asked["flags"], autoload=False)
    spent = _cpu_s() - before
    from bcc.libbcc import lib

    names = [lib.bpf_function_name(bpf.module, i) for i in range(lib.bpf_num_functions(bpf.module))]
    insns = sum(lib.bpf_function_size(bpf.module, n) for n in names) // 8
    bpf.cleanup()
    return {"cpu_s": spent, "insns": insns}


def _run(repo: Path, complete: bool, cache: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(repo), "FLEETD_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, __file__, "--once"]
                         + (["--complete"] if complete else []),
                         capture_output=True, text=True, env=env, cwd=repo, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"the compile failed:\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure")
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--complete", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.once:
        print(json.dumps(once(args.complete)))
        return
    figures: dict[str, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory(prefix="fleetd-compile-cost-") as tmp:
        for what in ("start", "complete"):
            runs = [_run(args.repo.resolve(), what == "complete", Path(tmp))
                    for _ in range(args.runs)]
            cpu = [r["cpu_s"] for r in runs]
            print(f"{what}: compile CPU {', '.join(f'{c:.2f}' for c in cpu)} s; "
                  f"{int(runs[0]['insns'])} instructions; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            figures[what] = (statistics.median(cpu), int(runs[0]["insns"]))
    print(f"BENCH compile_cost start_compile_cpu_s={figures['start'][0]:.2f} "
          f"complete_compile_cpu_s={figures['complete'][0]:.2f} "
          f"start_insns={figures['start'][1]} complete_insns={figures['complete'][1]}")


if __name__ == "__main__":
    main()
