"""Names a traced process chose, live: every text output shows them escaped, every
machine format keeps them exact.

The workload (tests/workloads/hostile_names.py, the reference loop over the real CUDA
runtime) names itself, a thread, its Python function and file with escape sequences
(CSI colour, OSC 0 title), BEL, CR, LF and a forged ``[HIGH] cpu_contention`` line; its
argv and HOSTNAME (its pod's name) carry the same, it loads the CUDA runtime from a
directory whose name holds an OSC and a CSI sequence, and it runs in a kubepods-style
cgroup whose own directory name holds ESC and BEL, under a CPU quota. Real ``fleetd
trace`` records it with on-CPU samples and stacks; then each text command renders the
database and, for comparison, a copy of it where every name is harmless (the same rows,
each control character replaced by ``_``):

* no text output (stdout or stderr) holds a byte below 0x20 but newline and tab, DEL
  or a C1 control;
* each has as many lines as over the harmless copy (no forged line), and so has
  explain's fleet report over the database merged with a copy of itself as a second
  node;
* the escaped form (``\\x1b]0;X\\x07\\n[HIGH] x``) is what they show;
* JSON, CSV and NDJSON hold the exact original values.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from recorder import running, trace_for

from conftest import FLEETD, REPO

sys.path.insert(0, str(REPO / "tests" / "workloads"))
import hostile_names as H  # noqa: E402
from train_loop import find_cudart  # noqa: E402

from fleetd.printable import printable  # noqa: E402

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and BPF need root")]

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
# The cgroup's own name: ESC and BEL (a directory name holds no '/'; a newline would
# break /proc/PID/cgroup's lines, which is the tracer's concern, not the output's).
CGROUP_LEAF = "evil\x1b[31m\x07x"
LIB_DIR = "lib\x1b]0;lib\x07\x1b[31mx"  # where it loads libcudart from (no newline either)
STEP = ["--launches", "8", "--memcpy", "1", "--cpu-us", "400", "--gpu-ms", "4"]
# A control character of any kind, where text output may only hold newline and tab.
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# JSON's escapes of those, as stored in JSON text columns (frames, event args).
RAW_JSON = re.compile(r"\\u00[01][0-9a-fA-F]|\\u00[89][0-9a-fA-F]|\\u007[fF]|\\[nrtbf]")
COMM = H.COMM.decode()
THREAD = H.THREAD.decode()

# Every text command over the database (each also run over the harmless copy).
TEXT = [
    ["explain"], ["explain", "--per-process"], ["-v", "explain"],
    ["ops"], ["ops", "--per-process"], ["overview"], ["pods"],
    ["stacks"], ["stacks", "--format", "folded"],
    ["profile"], ["profile", "--format", "folded"],
    ["gpu"], ["graphs"], ["collectives"],
    ["query", "SELECT pid, comm, cmdline, pod, cgroup FROM processes"],
    ["query", "SELECT tid, comm FROM threads"],
    ["-vv", "query", "SELECT DISTINCT comm, thread FROM events"],
]


@dataclass(frozen=True)
class Recorded:
    db: Path
    harmless: Path
    pid: int
    trace_err: str


@contextmanager
def pod_cgroup() -> Iterator[Path]:
    """``<scratch>/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope/<leaf>``
    on the v1 cpu controller, 0.1 CPU: a container of a pod, as the kubelet's systemd
    driver names it (no runtime record, so the pod is named from HOSTNAME), with a
    hostile last directory. Everything made is removed again."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        pytest.fail("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex + uuid.uuid4().hex
    top = CPU_ROOT / f"fleetd-test-{uuid.uuid4().hex[:8]}"
    leaf = (top / f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
            / f"cri-containerd-{cid}.scope" / CGROUP_LEAF)
    leaf.mkdir(parents=True)
    try:
        (leaf / "cpu.cfs_period_us").write_text("100000")
        (leaf / "cpu.cfs_quota_us").write_text("10000")
        yield leaf
    finally:
        for pid in (leaf / "cgroup.procs").read_text().split():
            (CPU_ROOT / "cgroup.procs").write_text(pid)
        for d in (leaf, *leaf.parents):
            if d == CPU_ROOT:
                break
            d.rmdir()


def harmless(text: str) -> str:
    return RAW_JSON.sub("_", RAW.sub("_", text.replace("\n", "_")))


def harmless_copy(src: Path, dst: Path) -> None:
    """The same database with every control character in every text value (JSON text
    included) replaced by ``_``: what the outputs would be for harmless names."""
    shutil.copyfile(src, dst)
    conn = sqlite3.connect(dst)
    try:
        conn.create_function("harmless", 1, lambda v: harmless(v) if isinstance(v, str) else v)
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master "
                                             "WHERE type = 'table'")]
        for t in tables:
            cols = [r[1] for r in conn.execute(f'PRAGMA table_info("{t}")')
                    if (r[2] or "").upper() == "TEXT"]
            if cols:
                sets = ", ".join(f'"{c}" = harmless("{c}")' for c in cols)
                conn.execute(f'UPDATE "{t}" SET {sets}')
        conn.commit()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    tmp = tmp_path_factory.mktemp("hostile")
    go, db = tmp / "go", tmp / "t.db"
    # The CUDA runtime loaded from a directory the process named: the tracer logs it.
    lib = tmp / LIB_DIR / "libcudart.so.12"
    lib.parent.mkdir()
    shutil.copyfile(find_cudart(), lib)
    with pod_cgroup() as group:
        env = {**os.environ, "HOSTNAME": H.HOSTNAME}
        with running([sys.executable, str(REPO / "tests/workloads/hostile_names.py"), H.ARG,
                      "--cudart", str(lib), "--duration", "40", "--go-file", str(go), *STEP],
                     sorted(os.sched_getaffinity(0))[0], groups=[group], env=env) as wl:
            # -v: the tracer logs the library it attached to (test_the_tracer_log_...).
            err = trace_for(wl.pid, db, go, "5s", "--stacks", "--stack-sample", "5",
                            "--cpu-sample-hz", "99", verbose=True)
    copy = tmp / "harmless.db"
    harmless_copy(db, copy)
    return Recorded(db, copy, wl.pid, err)


def two_nodes(db: Path, out: Path) -> Path:
    """``db`` merged with a copy of itself as a second node: explain then ranks the
    nodes and renders its fleet report (the one ``--nodes`` prints)."""
    twin = out.with_name(out.stem + "-twin.db")
    shutil.copyfile(db, twin)
    with sqlite3.connect(twin) as conn:
        conn.execute("UPDATE nodes SET name = 'twin', uid = ?", (uuid.uuid4().hex,))
    conn.close()
    r = subprocess.run([FLEETD, "merge", "-o", str(out), str(db), str(twin)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    return out


def fleetd(argv: list[str], db: Path) -> tuple[str, str]:
    """``fleetd ARGV --db DB`` to a pipe (no width: nothing wrapped or cut): stdout and
    stderr as bytes decoded strictly, so a stray byte fails here."""
    flags = argv[:1] if argv[0].startswith("-v") else []
    rest = argv[len(flags):]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([FLEETD, *flags, rest[0], "--db", str(db), *rest[1:]],
                       capture_output=True, timeout=180, env=env)
    assert r.returncode == 0, (argv, r.stderr.decode(errors="replace"))
    return r.stdout.decode(), r.stderr.decode()


def test_the_database_holds_the_raw_names(recorded: Recorded) -> None:
    """What the rest depends on: the hostile names were recorded as they are."""
    out, _ = fleetd(["query", "--format", "json", "SELECT comm, cmdline, pod, cgroup FROM "
                     f"processes WHERE pid = {recorded.pid}"], recorded.db)
    [[comm, cmdline, pod, cgroup]] = json.loads(out)["rows"]
    assert comm == COMM and pod == H.HOSTNAME, (comm, pod)
    assert H.ARG in cmdline and cgroup.endswith("/" + CGROUP_LEAF), (cmdline, cgroup)


@pytest.mark.parametrize("argv", TEXT, ids=[" ".join(a)[:40] for a in TEXT])
def test_text_output_is_printable_and_forges_no_line(recorded: Recorded,
                                                     argv: list[str]) -> None:
    out, err = fleetd(argv, recorded.db)
    for name, text in (("stdout", out), ("stderr", err)):
        bad = [line for line in text.split("\n") if RAW.search(line)]
        assert not bad, (argv, name, bad[:3])
    same_out, same_err = fleetd(argv, recorded.harmless)
    assert out.count("\n") == same_out.count("\n"), (argv, out, same_out)
    assert err.count("\n") == same_err.count("\n"), (argv, err, same_err)
    assert not [line for line in out.split("\n") if re.match(r"\[HIGH\] (x|cpu_contention "
                                                             r"(forged|host|argv))", line)]


def test_the_fleet_report_is_printable_and_forges_no_line(recorded: Recorded) -> None:
    merged = two_nodes(recorded.db, recorded.db.with_name("merged.db"))
    same = two_nodes(recorded.harmless, recorded.db.with_name("merged-harmless.db"))
    out, err = fleetd(["explain"], merged)
    assert out.startswith("fleetd explain: 2 node(s)"), out  # the fleet report
    assert not [line for line in (out + err).split("\n") if RAW.search(line)]
    assert out.count("\n") == fleetd(["explain"], same)[0].count("\n")
    assert f"victim:  {printable(COMM)} pid {recorded.pid}" in out


def test_text_shows_the_escaped_names(recorded: Recorded) -> None:
    out, _ = fleetd(["explain", "--per-process"], recorded.db)
    assert f"victim:  {printable(COMM)} pid {recorded.pid}" in out, out
    assert "\\x1b]0;X\\x07\\n[HIGH] x" in out  # the comm as the reader sees it
    assert f"(pod {printable(H.HOSTNAME)}" in out
    assert printable(THREAD) in out  # the helper thread, in the breakdown's thread column
    # 0.1 CPU throttles the loop: the quota's chain names the cgroup by its path.
    assert f"/{printable(CGROUP_LEAF)} (pod {printable(H.HOSTNAME)}" in out, out
    # Every chain the text shows says what the JSON says, escaped.
    report = json.loads(fleetd(["explain", "--format", "json"], recorded.db)[0])
    for c in report["chains"]:
        assert printable(c["summary"]) in out, c["summary"]
    # The Python function and file, as the profile's table shows them.
    table, _ = fleetd(["profile", "--top", "50"], recorded.db)
    assert printable(f"{H.FUNC} ({Path(H.FILE).name}:") in table, table


def test_folded_stacks_keep_one_line_and_their_frames(recorded: Recorded) -> None:
    for argv in (["profile", "--format", "folded"], ["stacks", "--format", "folded"]):
        out, _ = fleetd(argv, recorded.db)
        lines = out.splitlines()
        hostile = [line for line in lines if "spin\\x1b[31m" in line]
        assert hostile, (argv, out)
        for line in lines:
            stack, count = line.rsplit(" ", 1)
            assert count.isdigit(), line
        # The hostile frame is one frame: its ';' shown as ':', its newline escaped.
        frame = printable(f"{H.FUNC} ({Path(H.FILE).name}:").replace(";", ":")
        frames = [f for line in hostile for f in line.rsplit(" ", 1)[0].split(";")]
        assert any(f.startswith(frame) for f in frames), (frame, hostile[:2])


def test_json_csv_and_ndjson_keep_the_exact_names(recorded: Recorded) -> None:
    report = json.loads(fleetd(["explain", "--format", "json"], recorded.db)[0])
    victims = {(c["victim"]["comm"], c["victim"].get("pod")) for c in report["chains"]}
    assert (COMM, H.HOSTNAME) in victims, victims
    threads = {t["thread"] for p in report["processes"] for t in p["threads"]}
    assert THREAD in threads, threads

    prof = json.loads(fleetd(["profile", "--format", "json"], recorded.db)[0])
    assert any(H.FUNC in f["frame"] and Path(H.FILE).name in f["frame"]
               for f in prof["top"]), prof["top"]

    sql = f"SELECT comm, cmdline, pod, cgroup FROM processes WHERE pid = {recorded.pid}"
    rows = list(csv.reader(io.StringIO(fleetd(["query", "--format", "csv", sql],
                                              recorded.db)[0])))
    assert rows[0] == ["comm", "cmdline", "pod", "cgroup"]
    [[comm, cmdline, pod, cgroup]] = rows[1:]
    assert comm == COMM and pod == H.HOSTNAME and H.ARG in cmdline
    assert cgroup.endswith("/" + CGROUP_LEAF)
    [line] = fleetd(["query", "--format", "ndjson", sql], recorded.db)[0].splitlines()
    assert json.loads(line)["comm"] == COMM and json.loads(line)["pod"] == H.HOSTNAME
    stacks = json.loads(fleetd(["stacks", "--format", "json"], recorded.db)[0])
    frames = stacks["columns"].index("frames")
    assert any(H.FUNC in f and H.FILE in f for r in stacks["rows"] for f in r[frames]), stacks


def test_the_tracer_log_is_printable(recorded: Recorded) -> None:
    """``fleetd -v trace`` logs the library it attached to, from the directory the
    process named: escaped, no raw control character."""
    assert f"{printable(LIB_DIR)}/libcudart.so.12" in recorded.trace_err, recorded.trace_err
    bad = [line for line in recorded.trace_err.split("\n") if RAW.search(line)]
    assert not bad, bad[:3]
