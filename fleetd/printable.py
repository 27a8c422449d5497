"""Text a traced process controls, made safe to print.

A traced process picks its comm, its threads' names, its argv and environment
(``HOSTNAME`` names its pod), its cgroup's name and its Python functions' and files'
names; a node's answer carries them on to the client. Printed raw, an escape sequence in
one of them recolours, retitles or clears the reader's terminal, a carriage return
overwrites what fleetd wrote, and a newline starts a forged line of the report (a
``[HIGH] ...`` finding, a folded stack).

:func:`printable` shows every such character as an escape (``\\x1b``, ``\\n``, ``\\r``,
``\\u202e``), so a value stays on its line and an escape sequence arrives as plain text.
It is applied once where text is written: the table cells (fleetd.cli.output), the
explain report before it is rendered (:func:`printable_tree`), the folded stack writer
(fleetd.analyze.reading.frames), warnings, progress lines, and every log record
(:class:`PrintableFormatter`). JSON, CSV and NDJSON keep the exact values (their
encoders quote what needs quoting); the HTML report escapes for HTML itself.

It sits at the bottom of the layers (docs/architecture.md) so that every stage that
writes text can use it.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import TypeVar, cast

# C0 but tab, DEL, C1 (with ESC and CSI gone, no escape sequence can start), and the
# Unicode characters that end a line (U+2028, U+2029) or reorder what follows (the
# bidirectional marks, embeddings, overrides and isolates: a name that reads backwards).
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e"
                     "\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r"}

T = TypeVar("T")


def _escape(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: str) -> str:
    """``text`` with every control character shown escaped (``\\x1b``, ``\\n``): one line,
    no escape sequence. Tabs, spaces and every printable character stay as they are;
    a backslash too (an escape is for the eye, not meant to be read back)."""
    if _UNSAFE.search(text) is None:  # the common case: nothing to copy
        return text
    return _UNSAFE.sub(lambda m: _escape(m.group()), text)


def printable_cell(text: str) -> str:
    """A table cell: :func:`printable`, a tab as a space, and any other character that
    prints nothing (a zero-width space, an unassigned code point) escaped too, so the
    columns stay aligned."""
    text = printable(text).replace("\t", " ")
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def printable_tree(value: T) -> T:
    """A copy of a JSON-like value (dicts, lists, tuples, strings, numbers) with every
    string in it, keys too, :func:`printable`: a report made safe to render as text in
    one step, whichever of its fields the renderer prints."""
    return cast(T, _tree(value))


def _tree(value: object) -> object:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_tree(k): _tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_tree(v) for v in value)
    return value


class PrintableFormatter(logging.Formatter):
    """Log records as one line each, whatever a message quotes (a comm, a path, a
    node's error text): the message line and every line of an attached traceback
    are :func:`printable`; the traceback keeps its own line breaks."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return printable(super().formatMessage(record))

    def formatException(self, ei: logging._SysExcInfoType) -> str:  # noqa: N802
        text = super().formatException(ei)
        # The last line(s) are the exception's own message, which may quote a name: one
        # line. The frames above it are fleetd's code: their line breaks stay.
        last = "".join(traceback.format_exception_only(ei[0], ei[1])).rstrip("\n")
        if last and text.endswith(last):
            return printable_lines(text[: -len(last)]) + printable(last)
        return printable_lines(text)

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return printable_lines(super().formatStack(stack_info))


def printable_lines(text: str) -> str:
    """Text of several lines fleetd itself put together (a traceback, an error quoting
    a child's output): its line breaks kept, each line :func:`printable`."""
    return "\n".join(printable(line) for line in text.split("\n"))
