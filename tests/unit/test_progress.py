"""Progress on stderr as a user sees it (#44.3): plain lines in a pipe, one live line on
a terminal, nothing with --quiet, never on stdout; through the commands a user types.

FLEETD_PROGRESS_FIRST_S=0 makes a pipe show its lines from the start (the shipped
recordings are explained in well under the default 2 s)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import FLEETD, REPO

SCENARIO = REPO / "tests" / "data" / "scenarios" / "cpu_hog.db"
NOW = {"FLEETD_PROGRESS_FIRST_S": "0"}


def fleetd(*args: str, env: dict[str, str] | None = None,
           cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("FLEETD_DB", "FLEETD_PROGRESS_FIRST_S")}
    return subprocess.run([FLEETD, *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, cwd=cwd, timeout=300)


def on_terminal(*args: str) -> tuple[str, str]:
    """stdout (a pipe) and stderr (a pseudo-terminal) of ``fleetd ARGS``."""
    import pty

    main, sub = pty.openpty()
    base = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    proc = subprocess.Popen([FLEETD, *args], stdout=subprocess.PIPE, stderr=sub,
                            env={**base, "TERM": "xterm"}, cwd=REPO)
    os.close(sub)
    err = bytearray()
    try:
        while chunk := os.read(main, 65536):
            err += chunk
    except OSError:  # EIO: every writer of the terminal has closed it
        pass
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    assert proc.wait(300) == 0
    os.close(main)
    return out, err.decode()


def test_explain_in_a_pipe_prints_plain_lines_per_step() -> None:
    done = fleetd("explain", "--db", str(SCENARIO), env=NOW)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    steps = [ln for ln in lines if ln.startswith(f"fleetd: explaining {SCENARIO}")]
    for step in ("reading", "chains", "analysing", "rendering"):
        assert any(f": {step}..." in ln for ln in steps), done.stderr
    assert "\r" not in done.stderr and "\x1b" not in done.stderr
    # The answer alone on stdout, as before.
    assert done.stdout.startswith("fleetd explain: ") and "explaining" not in done.stdout
    assert "[HIGH] cpu_contention" in done.stdout


def test_quiet_silences_progress_wherever_it_is_typed() -> None:
    plain = fleetd("explain", "--db", str(SCENARIO), env=NOW)
    for args in (["--quiet", "explain", "--db", str(SCENARIO)],
                 ["explain", "-q", "--db", str(SCENARIO)]):
        done = fleetd(*args, env=NOW)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout == plain.stdout


def test_explain_on_a_terminal_draws_one_live_line_and_erases_it() -> None:
    out, err = on_terminal("explain", "--db", str(SCENARIO))
    assert f"\r\x1b[Kfleetd: explaining {SCENARIO}" in err
    assert err.endswith("\r\x1b[K"), repr(err[-200:])  # gone before the report is read
    assert "\n" not in err.replace("\r\n", "")  # rewritten in place, never a new line
    assert out.startswith("fleetd explain: ") and "\x1b[K" not in out


def test_check_names_each_group_as_it_runs(tmp_path: Path) -> None:
    done = fleetd("check", "--only", "db", "--db", str(SCENARIO), env=NOW)
    assert "fleetd: checking: the database (an integrity check of its pages)..." in \
        done.stderr, done.stderr
    assert "checking" not in done.stdout
    quiet = fleetd("check", "-q", "--only", "db", "--db", str(SCENARIO), env=NOW)
    assert quiet.stderr == "" and quiet.returncode == done.returncode


def test_export_import_and_merge_show_progress_in_a_pipe(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    done = fleetd("export", "--db", str(SCENARIO), "-o", str(out), env=NOW)
    assert done.returncode == 0, done.stderr
    assert f"fleetd: exporting {SCENARIO}..." in done.stderr
    assert fleetd("export", "-q", "--db", str(SCENARIO), "-o", str(tmp_path / "q.json"),
                  env=NOW).stderr == ""
    kineto = REPO / "tests" / "data" / "gpu" / "sampled_rank-0.json.gz"
    imp = fleetd("import", str(kineto), "--db", str(tmp_path / "i.db"), env=NOW)
    assert imp.returncode == 0 and "fleetd: importing 1 file(s)" in imp.stderr, imp.stderr
    # merge: a line per input in a pipe by default (its end always), none with --quiet.
    merged = fleetd("merge", str(SCENARIO), "-o", str(tmp_path / "m.db"))
    assert merged.returncode == 0, merged.stderr
    assert f"merge [1/1] {SCENARIO.name}: done 100%" in merged.stderr
    assert "\r" not in merged.stderr
    silent = fleetd("merge", "--quiet", str(SCENARIO), "-o", str(tmp_path / "n.db"))
    assert silent.returncode == 0 and silent.stderr == "", silent.stderr
