"""The analyzers' typed answers (fleetd/wire/answers.py) against docs/json.md and the code.

docs/json.md lists every class's keys in one block; the block and the classes must name
the same classes with the same keys (``KEY?``: not always there). Then answers built by
the analyzers from real recordings (the shipped scenarios, the imported GPU traces of
tests/data/gpu, and synth's recordings where no scenario has the calls) are walked
against the classes: every required key there, no key the class lacks, every value of
the declared type, nested classes included.
"""

from __future__ import annotations

import json
import re
import sqlite3
import types
from collections.abc import Iterator
from pathlib import Path
from typing import (
    Any,
    NotRequired,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

import pytest

from fleetd.cli.main import main
from fleetd.wire import answers

from conftest import REPO

DOC = REPO / "docs" / "json.md"
MARKER = "tests/unit/test_answer_shapes.py reads the next block"
SCENARIOS = sorted((REPO / "investigations" / "scenarios").glob("*.db"))
GPU_TRACES = [REPO / "tests" / "data" / "gpu" / f"sampled_rank-{i}.json.gz" for i in (0, 1)]
# Built by the agent (fleetd/node), not by an analyzer: checked against the doc only.
NOT_BUILT_HERE = {"CpuStacksAnswer"}
# Met through the classes built on them (RankVerdict, GpuRank), whose keys they lead.
BASES = {"Judgement", "RankSpan", "GpuFigures"}


def documented(text: str) -> dict[str, list[str]]:
    """Class -> its keys (``KEY?`` for one not always there), from the block after MARKER."""
    after = text.split(MARKER, 1)
    assert len(after) == 2, f"docs/json.md lost the marker {MARKER!r}"
    block = re.search(r"```text\n(.*?)```", after[1], re.S)
    assert block is not None, "docs/json.md: no ```text block after the answers' marker"
    out: dict[str, list[str]] = {}
    name = ""
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        words = line.split()
        if not line[0].isspace():
            name = words.pop(0)
            assert name not in out, f"docs/json.md lists {name} twice"
            out[name] = []
        assert name, f"a continued line before any class: {line!r}"
        out[name] += words
    return out


def fields(cls: Any) -> dict[str, tuple[Any, bool]]:
    """Key -> (its type, whether it is always there), in order (a base's keys first).

    Read from the hints, not ``__required_keys__``: under ``from __future__ import
    annotations`` Python 3.11 cannot see ``NotRequired`` in a string and calls every key
    required."""
    out: dict[str, tuple[Any, bool]] = {}
    for key, hint in get_type_hints(cls, include_extras=True).items():
        optional = get_origin(hint) is NotRequired
        out[key] = (get_args(hint)[0] if optional else hint, not optional)
    return out


def doc_keys(cls: Any) -> list[str]:
    """The class's keys as the doc writes them."""
    return [k if always else f"{k}?" for k, (_, always) in fields(cls).items()]


def test_the_doc_lists_every_class_with_its_keys() -> None:
    listed = documented(DOC.read_text())
    classes = {c.__name__: c for c in answers.ANSWERS}
    assert sorted(listed) == sorted(classes), (
        "docs/json.md (The analyzers' answers) and fleetd/analyze/reading/answers.py name other "
        f"classes: only in the doc {sorted(set(listed) - set(classes))}, only in the code "
        f"{sorted(set(classes) - set(listed))}")
    assert all(is_typeddict(c) for c in classes.values())
    for name, cls in classes.items():
        assert listed[name] == doc_keys(cls), (
            f"{name}: docs/json.md lists {listed[name]}, the class has {doc_keys(cls)}")
    assert set(answers.__all__) >= set(classes)


def test_the_doc_parser_sees_a_missing_key() -> None:
    text = DOC.read_text().replace("CpuStack               pid tid frames samples gc",
                                   "CpuStack               pid tid frames samples")
    assert documented(text)["CpuStack"] == ["pid", "tid", "frames", "samples"]
    assert documented(text)["CpuStack"] != doc_keys(answers.CpuStack)


# ---- real answers against the classes -------------------------------------------------

def problems(value: Any, tp: Any, where: str, seen: set[str]) -> Iterator[str]:
    """What in ``value`` breaks the declared type ``tp``; the classes met go to ``seen``."""
    origin = get_origin(tp)
    if tp is Any:
        return
    if is_typeddict(tp):
        if not isinstance(value, dict):
            yield f"{where}: {type(value).__name__}, not an object"
            return
        seen.add(tp.__name__)
        declared = fields(tp)
        missing = {k for k, (_, always) in declared.items() if always} - value.keys()
        extra = value.keys() - declared.keys()
        if missing or extra:
            yield f"{where} ({tp.__name__}): missing {sorted(missing)}, extra {sorted(extra)}"
        for k in value.keys() & declared.keys():
            yield from problems(value[k], declared[k][0], f"{where}.{k}", seen)
    elif origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(options) < len(get_args(tp)):
            return
        found = [list(problems(value, a, where, seen)) for a in options]
        if all(found):
            yield from found[0]
    elif origin is list:
        if not isinstance(value, list):
            yield f"{where}: {type(value).__name__}, not a list"
            return
        for i, x in enumerate(value):
            yield from problems(x, get_args(tp)[0], f"{where}[{i}]", seen)
    elif origin is dict:
        if not isinstance(value, dict):
            yield f"{where}: {type(value).__name__}, not an object"
            return
        for k, x in value.items():
            yield from problems(x, get_args(tp)[1], f"{where}[{k!r}]", seen)
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            yield f"{where}: {value!r} is not a number"
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            yield f"{where}: {value!r} is not an integer"
    elif isinstance(tp, type) and not isinstance(value, tp):
        yield f"{where}: {value!r} is not a {tp.__name__}"


def check(value: Any, tp: Any, where: str, seen: set[str]) -> None:
    found = list(problems(value, tp, where, seen))
    assert not found, "the answer breaks its class:\n" + "\n".join(found[:20])


def test_the_checker_finds_a_missing_key_an_extra_key_and_a_wrong_type() -> None:
    good = {"pid": 1, "tid": 2, "frames": ["f"], "samples": 3, "gc": 0}
    assert list(problems(good, answers.CpuStack, "s", set())) == []
    assert list(problems({**good, "x": 1}, answers.CpuStack, "s", set()))
    assert list(problems({k: v for k, v in good.items() if k != "gc"}, answers.CpuStack,
                         "s", set()))
    assert list(problems({**good, "frames": [1]}, answers.CpuStack, "s", set()))
    assert list(problems({**good, "pid": None}, answers.CpuStack, "s", set()))
    assert list(problems({**good, "samples": True}, answers.CpuStack, "s", set()))


@pytest.fixture(scope="module")
def seen() -> set[str]:
    return set()


def _open(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True)


def _profile(db: Path) -> tuple[Any, Any, Any]:
    from fleetd.analyze.facade import Analysis
    from fleetd.analyze.reading.profile import flame_stacks, profile, stack_counts, stacks_json

    with _open(db) as conn:
        a = Analysis.of(conn)
        counts, period = [], 0
        for sl in a.slices:
            got, p = stack_counts(sl.conn, sl.node, sl.window)
            counts += got
            period = max(period, p)
    return profile(counts, period), stacks_json(counts, 10, 4)[0], flame_stacks(counts)


@pytest.mark.parametrize("db", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_answers_have_their_classes_keys(db: Path, seen: set[str]) -> None:
    from fleetd.analyze.explain import explain_node
    from fleetd.analyze.facade import Analysis

    with _open(db) as conn:
        a = Analysis.of(conn)
        for node in a.node_names():
            check(a.overview(node), answers.OverviewAnswer, f"{db.stem} overview", seen)
        check(a.stacks(None, None, 10, 2), answers.StacksAnswer, f"{db.stem} stacks", seen)
        check(a.graphs(), answers.GraphsAnswer, f"{db.stem} graphs", seen)
        check(a.gpu(), answers.GpuAnswer, f"{db.stem} gpu", seen)
        check(a.collectives(), answers.CollectivesAnswer, f"{db.stem} collectives", seen)
        report = a.explain()
        check(report, answers.ExplainReport, f"{db.stem} explain", seen)
        check(report["window"], answers.WindowJson, f"{db.stem} window", seen)
        check(a.stragglers(report["chains"]), list[answers.StragglerEntry],
              f"{db.stem} stragglers", seen)
        for sl in a.slices:
            check(a.profile(sl.name), answers.NodeProfile, f"{db.stem} profile", seen)
            check(explain_node(sl), answers.NodeExplain, f"{db.stem} {sl.name}", seen)
        check(a.profile("no-such-node"), answers.NoProfile, f"{db.stem} no profile", seen)
    summary, heavy, flame = _profile(db)
    check(summary, answers.CpuProfile, f"{db.stem} profile", seen)
    check(heavy, list[answers.CpuStack], f"{db.stem} cpu stacks", seen)
    check(flame, answers.FlameStacks, f"{db.stem} flame", seen)


def test_gpu_answers_of_imported_traces_have_their_classes_keys(
        tmp_path: Path, seen: set[str]) -> None:
    from fleetd.analyze.facade import Analysis
    from fleetd.analyze.gpu.device import parse_thresholds

    db = tmp_path / "ranks.db"
    assert main(["import", *map(str, GPU_TRACES), "--db", str(db)]) == 0
    with _open(db) as conn:
        a = Analysis.of(conn)
        for steps, limits in ((False, None), (True, ["ProfilerStep*:M1=0.01"])):
            got = a.gpu(None, steps, parse_thresholds(limits or []))
            assert len(got["ranks"]) == 2 and got["straggler"] is not None
            check(got, answers.GpuAnswer, f"gpu steps={steps}", seen)
        assert "phase_thresholds" in got["ranks"][0]["verdict"]
        check(a.explain(per_process=True)["chains"], list[answers.ChainJson], "gpu chains",
              seen)


def test_the_explain_command_prints_an_explain_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], seen: set[str]) -> None:
    """The report as `fleetd explain --format json` prints it: with the command's
    collectives, the GPU verdicts of an imported timeline and the straggler ranking."""
    db = tmp_path / "ranks.db"
    assert main(["import", *map(str, GPU_TRACES), "--db", str(db)]) == 0
    for path in (db, *SCENARIOS):
        capsys.readouterr()
        assert main(["explain", "--db", str(path), "--format", "json"]) == 0
        got = json.loads(capsys.readouterr().out)
        check(got, answers.ExplainReport, f"explain --db {path.name}", seen)
        assert path != db or (got["gpu"] and got["stragglers"])


def test_graphs_collectives_and_cpu_answers_of_synth_recordings(
        tmp_path: Path, seen: set[str]) -> None:
    import synth
    from collective_synth import four_ranks, write_job
    from test_oncpu_units import HOT_STACK, SYNC_STACK, _recording

    from fleetd.analyze.facade import Analysis

    with _open(synth.build("graph_storm", tmp_path)) as conn:
        got = Analysis.of(conn).graphs(buckets=5)
        assert got["processes"] and got["processes"][0]["episodes"]
        check(got, answers.GraphsAnswer, "graph storm", seen)
    db = write_job(tmp_path / "nccl", four_ranks(late_rank=2, delay=20 * synth.MS))["gpu-01"]
    with _open(db) as conn:
        got = Analysis.of(conn).collectives()
        assert got["stragglers"] and got["communicators"]
        check(got, answers.CollectivesAnswer, "collectives", seen)
    (tmp_path / "cpu").mkdir()
    _recording(tmp_path / "cpu", [(HOT_STACK, 250, 0), (SYNC_STACK, 10, 0)])
    summary, heavy, flame = _profile(tmp_path / "cpu" / "r.db")
    assert summary["top"] and heavy and flame["stacks"]
    check(summary, answers.CpuProfile, "cpu profile", seen)
    check(heavy, list[answers.CpuStack], "cpu stacks", seen)
    check(flame, answers.FlameStacks, "flame", seen)


def test_chains_of_the_rules_no_shipped_recording_has(tmp_path: Path, seen: set[str]) -> None:
    """Chains whose ``detail`` and evidence no scenario above holds (on-CPU samples: a
    CPU-bound feeder with its frames and flame graph, GC pauses; synth's graph storm,
    host syncs, allocation churn and DataLoader workers), against ChainJson: their
    detail keys and evidence kinds are ChainDetail's and EvidenceItem's."""
    import synth
    from test_oncpu_units import GC_STACK, HOT_STACK, SYNC_STACK, _recording

    from fleetd.analyze.explain import explain

    got = {}
    (tmp_path / "cpu").mkdir()
    for c in _recording(tmp_path / "cpu", [(HOT_STACK, 250, 0), (SYNC_STACK, 10, 0)])["chains"]:
        got[c["root_cause"]] = c
    (tmp_path / "gc").mkdir()
    pauses = [(1_000_000_000, 180_000_000), (3_000_000_000, 120_000_000)]
    for c in _recording(tmp_path / "gc", [(HOT_STACK, 20, 0), (GC_STACK, 15, 15)],
                        pauses)["chains"]:
        got[c["root_cause"]] = c
    for name in ("graph_storm", "host_sync", "alloc_churn", "dataloader"):
        for c in explain(synth.build(name, tmp_path / name))["chains"]:
            got[c["root_cause"]] = c
    wanted = {"host_cpu_bound", "gc_pause", "graph_recapture", "host_sync", "alloc_churn",
              "dataloader_oversubscription"}
    assert wanted <= got.keys(), sorted(got)
    assert got["host_cpu_bound"]["detail"]["flame"]["stacks"]
    for root, c in sorted(got.items()):
        check(c, answers.ChainJson, f"{root} chain", seen)


def test_the_diff_command_prints_a_gpu_diff(
        capsys: pytest.CaptureFixture[str], seen: set[str]) -> None:
    """`fleetd diff --format json` of the two ranks' traces: every part met."""
    capsys.readouterr()
    assert main(["diff", *map(str, GPU_TRACES), "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["baseline"]["ranks"] and got["metrics"] and got["steps"] and got["kernels"]
    check(got, answers.GpuDiff, "diff", seen)


def test_every_class_was_met_in_a_real_answer(seen: set[str]) -> None:
    """Runs after the tests above (file order): each class but the agent's own was
    checked against at least one answer."""
    if not seen:
        pytest.skip("run with the tests above")
    every = {c.__name__ for c in answers.ANSWERS}
    unmet = every - seen - NOT_BUILT_HERE - BASES
    assert not unmet, f"no real answer exercised: {sorted(unmet)}"
