"""fleetd.printable, and the text writers that use it: a value a traced process chose
(an escape sequence, a carriage return, a forged ``[HIGH]`` line) is shown escaped in
every text output and never starts a line of its own."""

from __future__ import annotations

import io
import logging
import os
import re
import select
import sys
from typing import Any

import pytest

from fleetd.analyze.reading.frames import folded
from fleetd.cli import output
from fleetd.cli.progress import stage
from fleetd.printable import (
    PrintableFormatter,
    printable,
    printable_cell,
    printable_lines,
    printable_tree,
)

HOSTILE = "evil\x1b]0;title\x07\x1b[31mred\r\n[HIGH] cpu_contention\x9b2J\x00\x7f\u202egnp.exe"
# What may never reach a terminal from a value: C0 but tab (and the writer's own
# newline), DEL, C1, the Unicode line ends and bidi controls.
UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def test_each_control_character_is_shown_escaped() -> None:
    assert printable(HOSTILE) == (
        "evil\\x1b]0;title\\x07\\x1b[31mred\\r\\n[HIGH] cpu_contention\\x9b2J\\x00\\x7f"
        "\\u202egnp.exe")


def test_no_code_point_comes_out_unsafe() -> None:
    for code in [*range(0x3000), 0xFEFF, 0x10FFFF]:
        out = printable(chr(code))
        assert UNSAFE.search(out) is None, (hex(code), out)
        assert out == chr(code) or out.startswith("\\"), (hex(code), out)


def test_printable_text_is_kept_as_it_is() -> None:
    text = "train_loop.py:304 ≥ 5.01 ms … µs naïve 中文 tab\there back\\slash"
    assert printable(text) is text  # nothing to copy
    assert printable_lines("a\nb\x1b") == "a\nb\\x1b"


def test_a_cell_is_one_aligned_line() -> None:
    assert printable_cell("a\tb\u200bc\nd") == "a b\\u200bc\\nd"
    assert printable_cell("comm") == "comm"


def test_a_tree_is_printable_everywhere_and_the_original_kept() -> None:
    chain = {"summary": HOSTILE, "n": 3, "ok": None, "ids": (HOSTILE, 1.5)}
    report: dict[str, Any] = {"chains": [chain], HOSTILE: [HOSTILE]}
    safe = printable_tree(report)
    assert safe == {"chains": [{"summary": printable(HOSTILE), "n": 3, "ok": None,
                                "ids": (printable(HOSTILE), 1.5)}],
                    printable(HOSTILE): [printable(HOSTILE)]}
    assert report["chains"][0]["summary"] == HOSTILE  # JSON output still has it exact


def test_a_log_record_is_one_line_and_a_traceback_keeps_its_lines() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("fleetd.test_printable")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("attached to %s", HOSTILE)
        try:
            raise ValueError(HOSTILE)
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == f"WARNING fleetd.test_printable: attached to {printable(HOSTILE)}"
    assert lines[1] == "ERROR fleetd.test_printable: failed"
    assert lines[2].startswith("Traceback") and lines[-1] == f"ValueError: {printable(HOSTILE)}"
    assert not any(UNSAFE.search(line) for line in lines)


def test_a_folded_frame_neither_splits_nor_adds_a_line() -> None:
    frames = [f"{HOSTILE} (/tmp/x;y\n[HIGH] z.py:4)", "main (train.py:10)"]  # innermost first
    line = folded(frames, 7)
    assert "\n" not in line and UNSAFE.search(line) is None
    assert line.count(";") == 1  # two frames, one separator
    assert line.startswith("main (train.py:10);") and line.endswith(" 7")
    assert "\\n[HIGH] cpu_contention" in line


def test_a_table_has_one_line_per_row_and_shows_the_escapes() -> None:
    text = output.table(["pid", "comm", "thread"], [[1, HOSTILE, "ok"], [2, "python", HOSTILE]])
    lines = text.splitlines()
    assert len(lines) == 2 + 2 + 1  # header, rule, two rows, the count
    assert UNSAFE.search(text.replace("\n", "")) is None
    assert "\\x1b]0;title\\x07" in lines[2] and "\\n[HIGH] cpu_contention" in lines[3]


def test_the_wrapper_escapes_what_a_writer_let_through_and_keeps_our_colours() -> None:
    """A second net under the values' own escaping: on the terminal's text stream only
    colour (SGR) sequences, which fleetd's tables draw, pass raw."""
    inner = io.StringIO()
    wrapped = output.Wrapped(inner, 200)
    wrapped.write("\x1b[1;31mHIGH\x1b[0m evil\x1b]0;title\x07\x1b[2J\r\x9b2J\u202ex\n")
    wrapped.flush()
    assert inner.getvalue() == ("\x1b[1;31mHIGH\x1b[0m evil\\x1b]0;title\\x07\\x1b[2J\\r"
                                "\\x9b2J\\u202ex\n")


def test_warnings_and_notes_are_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    output.print_notes({"note": HOSTILE, "warnings": [HOSTILE, "plain"]}, False, "table")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"fleetd: note: {printable(HOSTILE)}",
                   f"fleetd: warning: {printable(HOSTILE)}", "fleetd: warning: plain"]


def _drain(fd: int) -> bytes:
    """All a pty holds: one read returns what the line discipline has passed on so far,
    which on a loaded machine can be the first write without the erase behind it."""
    got = b""
    while select.select([fd], [], [], 0.5)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        got += chunk
    return got


def test_a_progress_line_on_a_terminal_escapes_the_name() -> None:
    """On a real terminal (a pty), the live line carries its own erase and nothing of
    the file name's."""
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            assert tty.isatty()
            with stage(f"importing {HOSTILE}", out=tty, count=lambda: HOSTILE):
                pass
        got = _drain(master).decode()
    finally:
        os.close(master)
        os.close(slave)
    # The terminal's line discipline turns our "\n"-free writes into what we wrote.
    assert got.startswith("\r\x1b[Kfleetd: importing evil\\x1b]0;title\\x07"), got
    assert got.count("\x1b") == 2 and got.count("\r") == 2, got  # the line's, and the erase
    assert "\n" not in got



def test_the_cli_logs_through_the_printable_formatter() -> None:
    from fleetd.cli.main import _setup_logging

    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        _setup_logging(1)
        [handler] = root.handlers
        assert isinstance(handler.formatter, PrintableFormatter)
        assert isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr
    finally:
        root.handlers[:] = saved
