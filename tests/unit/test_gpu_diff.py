"""``fleetd diff``: the two shared Kineto ranks against each other, every figure
recomputed here from the JSON files (plain json, exact integer ns), and bad input."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetd.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
RANKS = [DATA / "sampled_rank-0.json.gz", DATA / "sampled_rank-1.json.gz"]


def _ns(us: Any) -> int:
    return int(Decimal(str(us)) * 1000)


def _source(path: Path) -> dict[str, Any]:
    ev = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    calls = {e["args"]["correlation"] for e in ev if e.get("cat") == "cuda_runtime"}
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    by_name: dict[str, int] = defaultdict(int)
    for k in kernels:
        by_name[k["name"]] += _ns(k["dur"])
    steps = sorted((e["ts"], _ns(e["dur"])) for e in ev if e.get("cat") == "user_annotation"
                   and e["name"].startswith("ProfilerStep#"))
    return {"kernels": len(kernels), "by_name": by_name, "steps": [d for _, d in steps],
            "launches": sum(1 for k in kernels if k["args"].get("correlation") in calls)}


def _diff(capsys: pytest.CaptureFixture[str], a: Path, b: Path) -> dict[str, Any]:
    rc = main(["diff", "--db", str(a), "--db", str(b), "--format", "json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return dict(orjson.loads(out.out))


def test_two_ranks_compared(capsys: pytest.CaptureFixture[str]) -> None:
    got = _diff(capsys, *RANKS)
    base, target = _source(RANKS[0]), _source(RANKS[1])
    m = {r["metric"]: r for r in got["metrics"]}
    assert m["kernels"]["baseline"] == base["kernels"]
    assert m["kernels"]["target"] == target["kernels"]
    assert m["launches"]["baseline"] == base["launches"]
    assert m["launches"]["target"] == target["launches"]
    kb, kt = sum(base["by_name"].values()), sum(target["by_name"].values())
    assert (m["kernel_ns"]["baseline"], m["kernel_ns"]["target"]) == (kb, kt)
    assert m["kernel_ns"]["delta"] == kt - kb and m["kernel_ns"]["worse"] is (kt > kb)
    sb, st = base["steps"], target["steps"]
    assert m["step_ns"]["baseline"] == sum(sb) / len(sb)
    assert m["step_ns"]["target"] == sum(st) / len(st)
    assert [(s["baseline_ns"], s["target_ns"]) for s in got["steps"]] == list(zip(sb, st,
                                                                                strict=True))
    # Kernel rows: every name of either side, biggest increase of total time first.
    names = base["by_name"].keys() | target["by_name"].keys()
    assert {k["name"] for k in got["kernels"]} == names
    deltas = [target["by_name"].get(k["name"], 0) - base["by_name"].get(k["name"], 0)
              for k in got["kernels"]]
    assert deltas == [k["delta_ns"] for k in got["kernels"]]
    assert deltas == sorted(deltas, reverse=True)
    top = got["kernels"][0]
    assert top["delta_ns"] == max(target["by_name"].get(n, 0) - base["by_name"].get(n, 0)
                                  for n in names)
    # The regressions are exactly the judged metrics that got worse, largest change first.
    worse = [r for r in got["metrics"] if r["worse"]]
    assert set(got["regressions"]) == {r["metric"] for r in worse}
    pcts = [abs(m[name]["delta_pct"]) for name in got["regressions"]]
    assert pcts == sorted(pcts, reverse=True)


def test_databases_diff_like_their_files(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    dbs = []
    for i, src in enumerate(RANKS):
        db = tmp_path / f"r{i}.db"
        assert main(["import", str(src), "--db", str(db)]) == 0
        dbs.append(db)
    capsys.readouterr()
    from_files = _diff(capsys, *RANKS)
    from_dbs = _diff(capsys, *dbs)
    for key in ("metrics", "steps", "kernels", "regressions"):
        assert from_files[key] == from_dbs[key]
    rc = main(["diff", str(dbs[0]), str(dbs[1])])  # positional, as a user types it
    table = capsys.readouterr().out
    assert rc == 0 and "ProfilerStep#551" in table and "regressions, largest first" in table
    # Every column of the metrics table is named: the judged direction is "verdict".
    header = next(line for line in table.splitlines() if line.startswith("metric "))
    assert header.split() == ["metric", "baseline", "target", "change", "change%", "verdict"]
    judged = {r["metric"].removesuffix("_ns"): r["worse"] for r in from_dbs["metrics"]}
    lines = table.splitlines()
    first = lines.index(header) + 2
    rows = lines[first:first + len(judged)]
    for line in rows:
        name = line.split(" (")[0].split()[0]
        if judged.get(name) is not None:
            assert line.split()[-1] == ("worse" if judged[name] else "better"), line
    assert any(line.endswith("better") for line in rows)


@pytest.mark.parametrize("argv, says", [
    (["--db", "RANK0"], "compares two timelines, got 1"),
    (["RANK0", "RANK0", "RANK0"], "compares two timelines, got 3"),
    (["--db", "RANK0", "--db", "BAD"], "not a trace fleetd can import"),
    (["--db", "RANK0", "--db", "RANK0", "--format", "xml"], "unknown format"),
])
def test_mistakes_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                               argv: list[str], says: str) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a trace\n")
    argv = [str(RANKS[0]) if a == "RANK0" else str(bad) if a == "BAD" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(["diff", *argv]))
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert says in err and "Traceback" not in err
    assert err.count("fleetd: error:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
