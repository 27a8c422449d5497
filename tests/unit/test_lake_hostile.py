"""Issue 29, item 3: a lake reads only its own regular files (fleetd/store/lakefs.py).

Each attack of the attack run on a copy of one lake (the 3-node set): the marker as a
symlink to /dev/zero, a FIFO, deep or huge JSON, a link to a secret outside the lake;
part files that are links or FIFOs; partitions that are links or not dates. The marker
attacks must end in under 5 s with one error line and no traceback, never printing a
value from the file; the bad files and partitions are left out with a warning while
the query answers from the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from contextlib import closing
from pathlib import Path

import pytest

from fleetd.errors import StoreError
from fleetd.export.parquet import export_lake
from fleetd.node.lake import LakeSettings, SegmentCloser
from fleetd.store.db import open_reader
from fleetd.store.lake import MARKER, clean_temporaries, lake_files
from fleetd.store.lakesql import LakeDB

from conftest import FLEETD, REPO, build_db

SOURCE = REPO / "investigations" / "fleet" / "cluster.db"
COUNT = "SELECT count(*) AS n FROM events"
SECRETS = {"format": "AKIA-SECRET-VALUE", "version": "hunter2", "token": "s3cr3t-t0ken"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    root = tmp_path_factory.mktemp("lake") / "lake"
    with closing(open_reader(SOURCE)) as conn:
        export_lake(conn, root)
    with LakeDB(root) as db:
        (n,), = db.query(COUNT).rows
    return root, int(n)


@pytest.fixture()
def lake(pristine: tuple[Path, int], tmp_path: Path) -> Path:
    root = tmp_path / "lake"
    shutil.copytree(pristine[0], root)
    return root


def _cli(root: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run([FLEETD, "query", "--lake", str(root), "--format", "json", COUNT],
                          capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - started


def _refused(root: Path, needle: str) -> str:
    proc, took = _cli(root)
    assert took < 5, f"took {took:.1f} s"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("fleetd: error:")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    return proc.stderr


def _marker(root: Path) -> Path:
    m = root / MARKER
    m.unlink()
    return m


def test_a_marker_linked_to_dev_zero_is_refused_at_once(lake: Path) -> None:
    _marker(lake).symlink_to("/dev/zero")
    _refused(lake, "is a symbolic link, not a regular file")


def test_a_marker_fifo_is_refused_without_blocking(lake: Path) -> None:
    os.mkfifo(_marker(lake))
    _refused(lake, "is a FIFO, not a regular file")


def test_a_marker_device_is_refused(lake: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(_marker(lake), 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    _refused(lake, "is a character device, not a regular file")


def test_deep_or_huge_marker_json_is_refused(lake: Path) -> None:
    marker = lake / MARKER
    marker.write_text("[" * 100_000 + "]" * 100_000)  # the attack: 200 KB
    _refused(lake, "over the limit of 65536")
    marker.write_text("[" * 30_000 + "]" * 30_000)  # under the size limit: the depth stops it
    _refused(lake, "is not a JSON object of at most 8 levels")
    marker.write_text('{"format": "fleetd-lake", "version": 1, "pad": "' + "x" * 70_000 + '"}')
    _refused(lake, "over the limit")


def test_a_marker_linked_to_a_secret_outside_is_not_read_or_printed(lake: Path,
                                                                    tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(SECRETS))
    _marker(lake).symlink_to(secret)
    err = _refused(lake, "is a symbolic link")
    assert not any(v in err for v in SECRETS.values()), err
    # A regular marker holding the same values: refused, and still no value printed.
    (lake / MARKER).unlink()
    (lake / MARKER).write_text(json.dumps(SECRETS))
    err = _refused(lake, "does not describe a fleetd lake")
    assert not any(v in err for v in SECRETS.values()), err


def _events(root: Path) -> list[Path]:
    return sorted(f.path for f in lake_files(root) if f.table == "events")


def _answers_with_warnings(root: Path, rows: int, *needles: str) -> list[str]:
    with LakeDB(root) as db:
        r = db.query(COUNT)
    assert r.rows == [(rows,)]
    for needle in needles:
        assert any(needle in w for w in r.warnings), r.warnings
    proc, took = _cli(root)  # and on the command line
    assert proc.returncode == 0 and took < 10, proc.stderr
    assert json.loads(proc.stdout)["rows"] == [[rows]]
    return list(r.warnings)


def _rows_of(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


def test_a_linked_part_file_is_left_out_and_the_rest_answers(
        lake: Path, pristine: tuple[Path, int], tmp_path: Path) -> None:
    first, second = _events(lake)[:2]
    lost = _rows_of(first)
    outside = tmp_path / "outside.parquet"
    shutil.copy(first, outside)  # a valid file, outside the lake
    first.unlink()
    first.symlink_to(outside)
    warnings = _answers_with_warnings(lake, pristine[1] - lost, f"{first} is a symbolic link")
    assert not any(str(outside) in w for w in warnings)  # the target is never named
    # A link to another file inside the lake is a link too (no rows counted twice).
    first.unlink()
    first.symlink_to(second)
    _answers_with_warnings(lake, pristine[1] - lost, f"{first} is a symbolic link")
    first.unlink()
    os.mkfifo(first)  # a FIFO: never opened, so nothing blocks
    _answers_with_warnings(lake, pristine[1] - lost, f"{first} is not a regular file")


def test_bad_partitions_are_left_out_and_the_rest_answers(
        lake: Path, pristine: tuple[Path, int], tmp_path: Path) -> None:
    part = _events(lake)[0]
    node_dir = part.parent.parent
    outside = tmp_path / "etc"
    outside.mkdir()
    shutil.copy(part, outside / "part-x.parquet")
    for name in ("date=..", "date=..%2F..%2Fetc", "date=2026-02-30"):
        (node_dir / name).mkdir()
        shutil.copy(part, node_dir / name / "part-x.parquet")
    (node_dir / "date=2020-01-01").symlink_to(outside)
    (node_dir.parent / "node=evil").symlink_to(outside.parent)
    (node_dir.parent / "node=a%3Ab").mkdir()  # a node name with ':' is no node name
    warnings = _answers_with_warnings(
        lake, pristine[1], f"{node_dir / 'date=..'} is not a date partition",
        f"{node_dir / 'date=..%2F..%2Fetc'} is not a date partition",
        f"{node_dir / 'date=2026-02-30'} is not a date partition",
        f"{node_dir / 'date=2020-01-01'} is a symbolic link",
        f"{node_dir.parent / 'node=evil'} is a symbolic link",
        "node=a%3Ab does not name a valid node")
    assert len(warnings) == 6, warnings


def test_many_bad_entries_make_a_bounded_list_of_warnings(lake: Path,
                                                          pristine: tuple[Path, int]) -> None:
    node_dir = _events(lake)[0].parent.parent
    for i in range(50):
        (node_dir / f"date=bad-{i:02d}").mkdir()
    warnings = _answers_with_warnings(lake, pristine[1], "30 more bad lake entries")
    assert len(warnings) == 21


def test_writers_never_follow_a_link_out_of_the_lake(lake: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    # Another agent on a shared mount swaps a node's partition for a link elsewhere.
    db = build_db(tmp_path / "n.db", "n1", 50)
    table = lake / "table=events"
    (table / "node=n1").symlink_to(outside)
    settings = LakeSettings(lake)
    with pytest.raises(StoreError, match="is a symbolic link or not a directory"):
        SegmentCloser(settings, db, "n1").close_segment()
    assert list(outside.iterdir()) == []
    # Temporary files are cleaned inside the lake only, never through a link.
    (outside / ".tmp-keep").write_text("x")
    assert clean_temporaries(lake, older_than_s=-1) == 0
    assert (outside / ".tmp-keep").exists()


def test_the_agents_state_file_is_read_only_when_it_is_a_small_regular_file(
        lake: Path, tmp_path: Path) -> None:
    db = build_db(tmp_path / "n.db", "n1", 50)
    state = lake / "_state"
    state.mkdir()
    os.mkfifo(state / "agent-n1.json")  # would block a plain read forever
    started = time.monotonic()
    closer = SegmentCloser(LakeSettings(lake), db, "n1")
    assert time.monotonic() - started < 5
    assert closer.after["events"] == 0
