"""Issue #19: the rough edges a new user hit, each checked through the CLI as they run it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FLEETD, REPO, assert_one_line_error

sys.path.insert(0, str(REPO / "tests"))

import perfetto_check  # noqa: E402

SCENARIOS = REPO / "investigations" / "scenarios"
CLUSTER = REPO / "investigations" / "fleet" / "cluster.db"


def fleetd(*args: str, env: dict[str, str] | None = None,
           cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("FLEETD_DB", "FLEETD_CONFIG", "NO_COLOR")}
    return subprocess.run([FLEETD, *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, cwd=cwd, timeout=120)


# ---- 1: a local file is the user's own: no network ceilings -------------------------


def test_local_query_is_not_capped_like_a_network_one() -> None:
    total = fleetd("query", "--db", str(CLUSTER), "SELECT count(*) FROM events",
                   "--format", "csv").stdout.splitlines()[1]
    assert int(total) > 10_000
    for limit in (str(int(total) + 1000), "0"):
        proc = fleetd("query", "--db", str(CLUSTER), "--limit", limit, "--timeout", "60s",
                      "SELECT * FROM events", "--format", "ndjson")
        assert proc.returncode == 0, proc.stderr
        assert len(proc.stdout.splitlines()) == int(total) and "truncated" not in proc.stderr


# ---- 2: the timeline shows the headline cause ---------------------------------------


def test_timeline_draws_the_culprit_of_every_chain(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    proc = fleetd("export", "--db", str(SCENARIOS / "cpu_hog.db"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    trace = perfetto_check.load(out)
    s = perfetto_check.validate(trace)
    events = trace["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    starts = {e["id"]: tracks[(e["pid"], e["tid"])] for e in events if e["ph"] == "s"}
    ends = {e["id"]: tracks[(e["pid"], e["tid"])] for e in events if e["ph"] == "f"}
    # The HIGH cpu-hog chain: arrows from the hog's own track to the victim's thread
    # (the pids are the recording's: read them from explain, as a user would).
    [chain] = json.loads(fleetd("explain", "--db", str(SCENARIOS / "cpu_hog.db"), "--format",
                                "json").stdout)["chains"]
    hog = f"cpu-hog[{chain['culprit']['pid']}]"
    victim = f"python[{chain['victim']['pid']}]"
    assert s.flows >= 1
    assert {(starts[i], ends[i]) for i in starts} == {(hog, victim)}
    # Syscalls by name; every task named comm[pid]; the clock error in its own unit.
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert "syscall" not in names and "clock_nanosleep" in names
    labels = [e["args"]["labels"] for e in events if e["name"] == "process_labels"]
    assert labels == ["clock: none ±16 s"]
    queued = [e for e in events if e["ph"] == "X" and e["name"] == "run queue"]
    assert queued and {e["args"]["woken_by"] for e in queued} >= {hog}


# ---- 3: numbers that agree with each other ------------------------------------------


def test_ops_table_says_what_its_numbers_are() -> None:
    proc = fleetd("ops", "--db", str(SCENARIOS / "dataloader.db"))
    assert proc.returncode == 0, proc.stderr
    header, _, *rows = proc.stdout.splitlines()
    assert "_ns" not in header and " max " in f" {header} "
    hardirq = next(r for r in rows if r.split()[1] == "hardirq")
    # A histogram's max is a lower bound (its highest bucket's mean), and says so; the
    # percentiles scaled from the buckets never pass it.
    assert re.search(r"  ≥ \d+\.\d us  ", hardirq), hardirq
    ops = [r.split()[1] for r in rows[:-1]]
    sources = {r.split()[1]: r.split()[2] for r in rows[:-1]}
    # Syscalls by name, one row each, no lump (this recording has wait4; block_io.db has
    # fsync, write and others).
    named = [op for op, src in sources.items() if src == "syscall"]
    assert "syscall" not in ops and "wait4" in named
    io = fleetd("ops", "--db", str(SCENARIOS / "block_io.db"), "--format", "csv").stdout
    io_named = [r.split(",")[1] for r in io.splitlines()[1:] if r.split(",")[2] == "syscall"]
    assert "syscall" not in io_named and {"fsync", "write"} <= set(io_named)
    assert ops[-1] == "clock_nanosleep"  # sleeps the program asked for sort last
    js = json.loads(fleetd("ops", "--db", str(SCENARIOS / "dataloader.db"), "--format",
                           "json").stdout)
    row = dict(zip(js["columns"], next(r for r in js["rows"] if r[1] == "hardirq"),
                   strict=True))
    assert row["max_exact"] is False and isinstance(row["max_ns"], int)
    sync = fleetd("query", "--db", str(SCENARIOS / "dataloader.db"), "--op",
                  "cudaStreamSynchronize", "--limit", "1").stdout
    assert "35 cudaErrorInsufficientDriver" in sync
    floats = fleetd("query", "--db", str(SCENARIOS / "dataloader.db"),
                    "SELECT 4065520.5 AS big, 0.0000153 AS small").stdout
    assert "4065520" in floats and "0.0000153" in floats and "e+" not in floats


# ---- 4: the config found where users keep it ----------------------------------------


def test_fleet_config_is_found_and_certificates_come_from_the_environment(
        tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    for cmd in (["init-ca"], ["issue-client", "me"]):
        assert fleetd("certs", "--dir", str(certs), *cmd).returncode == 0
    home = tmp_path / "xdg"
    (home / "fleetd").mkdir(parents=True)
    # Plain host:port entries; no certificate in the file, they come from the environment.
    (home / "fleetd" / "fleetd.yaml").write_text(
        "fleet:\n  nodes: ['127.0.0.1:9', 'gpu-02=127.0.0.1:10']\n  timeout_s: 2\n")
    env = {"XDG_CONFIG_HOME": str(home), "FLEETD_CA_CERT": str(certs / "ca.pem"),
           "FLEETD_CLIENT_CERT": str(certs / "me.pem"),
           "FLEETD_CLIENT_KEY": str(certs / "me.key")}
    proc = fleetd("overview", env=env, cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr  # asked both nodes: neither runs an agent
    assert "node 127.0.0.1:9" in proc.stderr and "node gpu-02" in proc.stderr
    assert "--ca-cert" not in proc.stderr
    # $FLEETD_CONFIG wins, and must name a file.
    bad = fleetd("overview", env={**env, "FLEETD_CONFIG": str(tmp_path / "none.yaml")},
                 cwd=tmp_path)
    assert_one_line_error(bad, "FLEETD_CONFIG")


# ---- 5: tables that fit the terminal --------------------------------------------------


def _on_terminal(*args: str, env: dict[str, str]) -> str:
    import pty

    main, sub = pty.openpty()
    base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FLEETD_DB")}
    proc = subprocess.Popen([FLEETD, *args], stdout=sub, stderr=subprocess.DEVNULL,
                            env={**base, "COLUMNS": "100", "TERM": "xterm", **env}, cwd=REPO)
    os.close(sub)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(60)
    os.close(main)
    return b"".join(chunks).decode()


def test_tables_use_the_terminal_and_stay_plain_in_pipes() -> None:
    piped = fleetd("overview", "--db", str(CLUSTER)).stdout
    assert "…" not in piped and "\x1b[" not in piped
    assert re.search(r"\(\d+\.\d% of wall time preempted or queued for a CPU\)", piped)
    shown = _on_terminal("overview", "--db", str(CLUSTER), env={})
    assert "\x1b[1;31m" in shown  # HIGH in red
    assert all(len(line) <= 100 for line in shown.replace("\x1b", "").splitlines()
               if "[" not in line)
    # Long text is shortened with an ellipsis at a word (--wide or json for all of it),
    # never wrapped into a second line nor cut inside a number.
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown)
    assert "…" in text and "(3 rows)" in text
    assert not re.search(r"\d…", text)
    plain = _on_terminal("overview", "--db", str(CLUSTER), env={"NO_COLOR": "1"})
    assert "\x1b[1;31m" not in plain and "\x1b[31m" not in plain


def test_every_command_draws_one_table_style_and_colours_severities() -> None:
    """#44.6: query drew rich's bold box tables on a terminal where every other command
    drew plain rules; the explain text's [HIGH] was never coloured."""
    sql = ("SELECT 'rec-01:2ee284497fd6' AS id, 'HIGH' AS severity, "
           "'python (pid 28898) stalled 245 times between CUDA calls, worst 3.8 ms' AS summary")
    shown = _on_terminal("query", "--db", str(SCENARIOS / "cpu_hog.db"), sql,
                         env={"COLUMNS": "60"})
    assert "─" not in shown and "\x1b[1m" not in shown  # no box, no bold header
    lines = re.sub(r"\x1b\[[0-9;]*m", "", shown).splitlines()
    assert lines[0].split() == ["id", "severity", "summary"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert "rec-01:2ee284497fd6" in lines[2]  # an id is never cut, even at 60 columns
    assert "\x1b[1;31mHIGH\x1b[0m" in shown
    explained = _on_terminal("explain", "--db", str(SCENARIOS / "cpu_hog.db"), env={})
    assert "\x1b[1;31m[HIGH]\x1b[0m cpu_contention" in explained
    for env in ({"NO_COLOR": "1"}, {"TERM": "dumb"}):
        assert "\x1b[" not in _on_terminal("explain", "--db", str(SCENARIOS / "cpu_hog.db"),
                                            env=env)
    piped = fleetd("explain", "--db", str(SCENARIOS / "cpu_hog.db")).stdout
    assert "\x1b[" not in piped and "[HIGH] cpu_contention" in piped


@pytest.mark.parametrize("cmd", [
    ["profile", "--db", str(REPO / "investigations" / "showcase" / "profile.db")],
    ["stacks", "--db", str(SCENARIOS / "cpu_hog.db")],
])
def test_flame_graph_writers_take_o_like_every_writer(tmp_path: Path, cmd: list[str]) -> None:
    """#44.6: profile refused -o; folded stacks go to a file as every other writer's."""
    out = tmp_path / "stacks.folded"
    first = fleetd(*cmd, "--format", "folded", "-o", str(out))
    assert first.returncode == 0, first.stderr
    assert first.stdout == "" and f"wrote {out}" in first.stderr
    lines = out.read_text().splitlines()
    assert lines and all(re.search(r";?.+ \d+$", line) for line in lines)
    again = fleetd(*cmd, "--format", "folded", "-o", str(out))
    assert_one_line_error(again, "stacks.folded' exists")
    assert fleetd(*cmd, "--format", "folded", "-o", str(out), "--force").returncode == 0


# ---- 7: one name per meaning; sizes with units; -v anywhere; --fail-on ----------------


def test_flags_have_one_name_and_old_names_still_work(tmp_path: Path) -> None:
    help_text = fleetd("merge", "--help").stdout
    assert "--clock-skew-threshold" in help_text and "--clock-threshold" not in help_text
    assert "--no-skew-correct" not in fleetd("export", "--help").stdout
    assert "-o DIR, --output DIR" in fleetd("demo", "--help").stdout
    assert "CONFIG" in fleetd("query", "--help").stdout
    out = tmp_path / "m.db"
    for flag in ("--clock-skew-threshold", "--clock-threshold"):
        proc = fleetd("merge", str(SCENARIOS / "quiet.db"), "-o", str(out), flag, "20ms")
        assert proc.returncode == 0, proc.stderr
    for flag in ("--no-clock-correction", "--no-skew-correct"):
        proc = fleetd("export", "--db", str(SCENARIOS / "quiet.db"), "-o",
                      str(tmp_path / "t.json"), flag, "--force")
        assert proc.returncode == 0, proc.stderr
    # Every -o file output is refused when it exists, unless --force (explain's html too).
    again = fleetd("export", "--db", str(SCENARIOS / "quiet.db"), "-o", str(tmp_path / "t.json"))
    assert_one_line_error(again, "t.json' exists")
    assert "--force" in again.stderr
    sized = fleetd("trace", "--pid", "1", "--max-db-bytes", "10x")
    assert_one_line_error(sized, "invalid size '10x'")
    assert "--max-db-bytes" not in fleetd("trace", "--pid", "1", "--max-db-bytes", "10G",
                                          "--duration", "bogus").stderr
    verbose = fleetd("query", "--db", str(SCENARIOS / "quiet.db"), "SELECT 1", "-vv")
    assert verbose.returncode == 0, verbose.stderr
    high = fleetd("explain", "--db", str(SCENARIOS / "cpu_hog.db"), "--fail-on", "HIGH")
    assert high.returncode == 5 and "--fail-on HIGH" in high.stderr
    quiet = fleetd("explain", "--db", str(SCENARIOS / "quiet.db"), "--fail-on", "HIGH")
    assert quiet.returncode == 0, quiet.stderr


# ---- 8: hints that fit what the user did ----------------------------------------------


def test_hints_name_what_was_really_wrong(tmp_path: Path) -> None:
    proc = fleetd("explain", "--db", str(SCENARIOS / "cpu_hog.db"), "--pid", "1")
    assert "verdict: no events for pid 1" in proc.stdout and "quiet" not in proc.stdout
    window = fleetd("query", "--db", str(SCENARIOS / "cpu_hog.db"),
                    "--from", "2026-11-23T03:00:00Z", "--to", "2026-11-23T02:00:00Z")
    assert_one_line_error(window, "is not before --to")
    missing = fleetd("merge", str(tmp_path / "gone.db"), "-o", str(tmp_path / "m.db"))
    assert_one_line_error(missing, "merge input")
    assert "--db" not in missing.stderr
    certs = tmp_path / "certs"
    fleetd("certs", "--dir", str(certs), "init-ca")
    key = fleetd("certs", "show", "--dir", str(certs), "ca.key")
    assert_one_line_error(key, "is a private key")
    assert "swapped" not in key.stderr and "ca.pem" in key.stderr


# ---- 12: completion and exit codes ---------------------------------------------------


def test_completion_scripts_and_exit_codes_in_help() -> None:
    for shell, marker in (("bash", "complete"), ("zsh", "#compdef")):
        proc = fleetd("completion", shell)
        assert proc.returncode == 0 and marker in proc.stdout
        assert "--clock-skew-threshold" in proc.stdout
    bash = subprocess.run(["bash", "-n"], input=fleetd("completion", "bash").stdout,
                          text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr
    help_text = fleetd("--help").stdout
    assert "exit status:" in help_text and "partial answer" in help_text


# ---- 13: libcuda through the machine's own apt sources --------------------------------


def test_fetch_libcuda_uses_the_configured_apt_sources(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list").write_text("deb http://mirror.corp.example/debian bookworm main\n")
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: https://repo.corp.example/debian\nSuites: bookworm\n"
        "Components: main contrib\n")
    seen = tmp_path / "seen"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A stand-in apt-get: it keeps the sources it was given, then fails like an
    # offline machine (the script then skips, as it does offline).
    (bin_dir / "apt-get").write_text(
        "#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in Dir::Etc::SourceParts=*) "
        f"cat \"${{a#*=}}\"/* > {seen};; esac; done\nexit 1\n")
    (bin_dir / "apt-get").chmod(0o755)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch-libcuda.sh")], capture_output=True, text=True,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
             "FLEETD_APT_DIR": str(apt), "FLEETD_LIBCUDA_DIR": str(tmp_path / "lib")},
        timeout=60)
    assert proc.returncode == 0 and "skipped: apt-get update failed" in proc.stdout
    sources = seen.read_text()
    assert "deb http://mirror.corp.example/debian bookworm main non-free" in sources
    assert "URIs: https://repo.corp.example/debian" in sources
    assert "Components: main contrib non-free" in sources
    assert "debian.org" not in (REPO / "scripts" / "fetch-libcuda.sh").read_text()


# ---- 6: long work says what it is doing -----------------------------------------------


def test_export_counts_its_events_on_a_terminal(tmp_path: Path) -> None:
    """The live line of a long export carries the trace events written so far, and the
    count it reads is the file's own."""
    import io
    import time as _time

    from fleetd.cli.progress import stage
    from fleetd.export.perfetto import Written

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    shown, written = Tty(), Written()
    with stage("exporting x", shown, count=lambda: f"{written.events:,} trace events written"):
        written.events = 12345
        _time.sleep(1.3)
    assert "fleetd: exporting x... 1 s, 12,345 trace events written" in shown.getvalue()
    out = tmp_path / "q.json"
    proc = fleetd("export", "--db", str(SCENARIOS / "quiet.db"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    import argparse

    from fleetd.cli.export_cmd import export_db  # the count the line reads, on the file
    args = argparse.Namespace(db=SCENARIOS / "quiet.db", since=None, from_=None, to=None,
                              pid=None, limit_per_node=None, chains="auto",
                              no_skew_correct=False, offset=[])
    counted = Written()
    export_db(args, tmp_path / "again.json", counted)
    assert counted.events == len(json.loads(out.read_text())["traceEvents"])


def test_long_work_logs_its_stages_in_pipes(tmp_path: Path) -> None:
    """In a pipe or a log: plain progress lines (here from the start:
    FLEETD_PROGRESS_FIRST_S=0), no carriage returns; none with --quiet; on a terminal the
    same task is a live line (fleetd/cli/progress.py)."""
    os.environ["FLEETD_PROGRESS_FIRST_S"] = "0"
    try:
        db = tmp_path / "gpu.db"
        imported = fleetd("import", str(REPO / "tests" / "data" / "gpu" /
                                        "sampled_rank-1.json.gz"), "--db", str(db))
        assert imported.returncode == 0, imported.stderr
        assert "fleetd: importing 1 file(s)" in imported.stderr
        exported = fleetd("export", "--db", str(SCENARIOS / "quiet.db"), "-o",
                          str(tmp_path / "q.json"))
        assert exported.returncode == 0, exported.stderr
        assert "fleetd: export" in exported.stderr, exported.stderr
        assert "\r" not in imported.stderr + exported.stderr
        quiet = fleetd("-q", "import", str(REPO / "tests" / "data" / "gpu" /
                                           "sampled_rank-1.json.gz"),
                       "--db", str(tmp_path / "again.db"))
        assert quiet.returncode == 0 and "importing" not in quiet.stderr, quiet.stderr
    finally:
        del os.environ["FLEETD_PROGRESS_FIRST_S"]
