"""nsys scheduler switches become off-CPU intervals whose a0 holds Linux task-state bits
(what every analyzer reads through ``a0 & 255``), never nsys's own enum ids.

The expected intervals are paired here from the export's SCHED_EVENTS with plain SQL and
the export's own ENUM_SAMPLING_THREAD_STATE labels, independently of the importer.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from fleetd.cli.main import main

NSYS = Path(__file__).resolve().parents[1] / "data" / "gpu" / "perlmutter-cloverleaf-cuda.sqlite"
NOT_RECORDED = 1 << 16  # docs/schema.md: the S in the low byte was assumed
# nsys label -> (op, a0) as docs/schema.md promises it.
WANT = {"Unknown": ("off_cpu", 1 | NOT_RECORDED), "Running": ("runq_wait", 0),
        "Interruptible": ("off_cpu", 1), "Uninterruptible": ("off_cpu", 2),
        "Stopped": ("off_cpu", 4), "Terminated": ("off_cpu", 0x10),
        "Waiting": ("off_cpu", 1), "OSRuntime": ("off_cpu", 1 | NOT_RECORDED)}


def source_intervals(path: Path) -> list[tuple[int, int, str]]:
    """(switched out, switched in, nsys state label) per thread, straight from the file."""
    c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    labels = dict(c.execute("SELECT id, name FROM ENUM_SAMPLING_THREAD_STATE"))
    out: dict[int, tuple[int, str]] = {}
    found = []
    for start, is_in, gtid, state in c.execute(
            "SELECT start, isSchedIn, globalTid, threadState FROM SCHED_EVENTS ORDER BY start"):
        if not is_in:
            out[gtid] = (start, labels[state])
        elif gtid in out:
            t0, label = out.pop(gtid)
            found.append((t0, start, label))
    c.close()
    return found


def imported(tmp: Path, src: Path) -> Counter[tuple[str, int]]:
    db = tmp / "out.db"
    assert main(["import", str(src), "--db", str(db)]) == 0
    c = sqlite3.connect(db)
    got = Counter((str(op), int(a0)) for op, a0 in c.execute(
        "SELECT op, a0 FROM events WHERE op IN ('off_cpu', 'runq_wait')"))
    c.close()
    return got


def test_the_real_exports_states_are_never_read_as_preemptions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = source_intervals(NSYS)
    labels = Counter(label for _, _, label in want)
    assert labels["Unknown"] > 0  # what a Linux nsys export holds: no state at all
    got = imported(tmp_path, NSYS)
    assert got == Counter({WANT[lab]: n for lab, n in labels.items()})
    # No interval reads as "preempted" (a0 & 255 == 0) unless nsys said Running.
    assert sum(n for (op, a0), n in got.items() if op == "off_cpu" and a0 & 255 == 0) == 0
    err = capsys.readouterr().err
    assert f"{labels['Unknown']} of {len(want)} scheduler switch-outs" in err
    assert "never as preemptions" in err
    c = sqlite3.connect(tmp_path / "out.db")
    total = c.execute("SELECT sum(dur_ns) FROM events WHERE op = 'off_cpu'").fetchone()[0]
    assert total == sum(b - a for a, b, _ in want)
    states = c.execute("SELECT json_extract(targets, '$.import.sched_states') FROM sessions"
                       ).fetchone()[0]
    assert states == f'{{"Unknown":{labels["Unknown"]}}}'


def test_recorded_states_map_to_linux_bits(tmp_path: Path) -> None:
    """A copy of the export whose switch-outs carry every state nsys can write on Linux."""
    src = tmp_path / "states.sqlite"
    shutil.copy(NSYS, src)
    with sqlite3.connect(src) as c:
        c.execute("UPDATE SCHED_EVENTS SET threadState = rowid % 5 WHERE isSchedIn = 0")
    want = source_intervals(src)
    labels = Counter(label for _, _, label in want)
    assert {"Running", "Interruptible", "Uninterruptible", "Stopped"} <= set(labels)
    got = imported(tmp_path, src)
    assert got == Counter({WANT[lab]: n for lab, n in labels.items()})
    c = sqlite3.connect(tmp_path / "out.db")
    d_state = c.execute("SELECT count(*) FROM events WHERE op = 'off_cpu' AND a0 & 2 != 0 "
                        "AND a0 & 255 != 0").fetchone()[0]
    assert d_state == labels["Uninterruptible"]
