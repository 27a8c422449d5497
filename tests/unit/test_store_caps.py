"""Names a traced process chose are capped where the writer stores them: a real writer
into a real database, read back with SQLite."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from fleetd.store import caps
from fleetd.store.writer import BatchWriter

from conftest import synthetic_events

HUGE = "x" * (1 << 20)


def _one(db: Path, sql: str) -> tuple[object, ...]:
    with sqlite3.connect(db) as conn:
        row = conn.execute(sql).fetchone()
    assert row is not None
    return tuple(row)


def _is_cut(value: object, what: str) -> bool:
    return (isinstance(value, str) and len(value) == caps.CAPS[what]
            and value.endswith(caps.MARK) and value.startswith("xxx"))


def test_every_process_name_is_cut_to_its_cap(tmp_path: Path) -> None:
    db = tmp_path / "n.db"
    named = ("comm", "exe", "cmdline", "job", "cgroup", "container_name", "pod",
             "namespace")
    with BatchWriter(db, "n") as w:
        w.add_processes([{"pid": 7, "rank": 0, **dict.fromkeys(named, HUGE)}])
        w.add_processes([{"pid": 8, "comm": "ok\x1b[2J\nname", "namespace": "ml"}])
        w.add_tasks([(7, 7, HUGE), (9, 8, "short")])
    got = _one(db, f"SELECT {', '.join(named)} FROM process_data WHERE pid = 7")
    assert all(_is_cut(v, what) for v, what in zip(got, named, strict=True)), \
        [len(str(v)) for v in got]
    # Short names stay exact, control characters and all (escaping is for output).
    assert _one(db, "SELECT comm, namespace FROM process_data WHERE pid = 8") == \
        ("ok\x1b[2J\nname", "ml")
    assert _is_cut(_one(db, "SELECT comm FROM task_data WHERE tid = 7")[0], "comm")
    assert _one(db, "SELECT comm FROM task_data WHERE tid = 9") == ("short",)


def test_event_args_and_stack_frames_are_cut(tmp_path: Path) -> None:
    db = tmp_path / "n.db"
    rows = synthetic_events(2)
    with BatchWriter(db, "n") as w:
        w.add_events(rows, [(0, {"kernel": HUGE, "cgroup": HUGE, "grid": [1, 2, 3],
                                 "pids": [1, 2], "names": [HUGE, "a"], "other": HUGE}),
                            (1, {"kernel": "void k<int>(int)"})])
        w.add_stacks([(11, ["main (train.py:3)", HUGE])])
    first, second = (json.loads(str(a)) for (a,) in sqlite3.connect(db).execute(
        "SELECT args FROM event_args ORDER BY id"))
    assert _is_cut(first["kernel"], "kernel") and _is_cut(first["cgroup"], "cgroup")
    assert len(first["other"]) == caps.DEFAULT_CAP and first["names"][1] == "a"
    assert len(first["names"][0]) == caps.DEFAULT_CAP
    assert (first["grid"], first["pids"]) == ([1, 2, 3], [1, 2])
    assert second == {"kernel": "void k<int>(int)"}
    frames = json.loads(str(_one(db, "SELECT frames FROM stacks WHERE hash = 11")[0]))
    assert frames[0] == "main (train.py:3)" and _is_cut(frames[1], "frame")
