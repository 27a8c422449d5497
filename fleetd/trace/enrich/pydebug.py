"""CPython 3.13+'s own description of its structures: ``_Py_DebugOffsets``.

From 3.13 on, ``_PyRuntime`` starts with a table of offsets kept for out-of-process
tools (debuggers, profilers): a cookie, the interpreter's ``PY_VERSION_HEX``, whether
the build is free-threaded, then per structure its size and the offsets of the fields
such a tool reads. fleetd reads it instead of a table measured per release, so a
patch release (or a build with other options) that moves a field is followed without
a new fleetd.

The table itself is laid out differently from one minor version to the next (3.14
added fields in the middle of several sections), so its own layout is listed here per
minor version: :data:`SECTIONS`. A version whose table layout is not listed is refused
with the reason, rather than read at guessed positions.

The table is statically initialised, so it can be read from the file (``fleetd
check``, no process needed) as well as from a running process's memory.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

COOKIE = b"xdebugpy"

# The table's fields after the cookie, the version and free_threaded, all uint64_t, in
# declaration order: Include/internal/pycore_runtime.h of CPython 3.13.0 (typedef struct
# _Py_DebugOffsets), checked against the 3.13.0 build installed here.
_S313: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
    ("interpreter_state", ("size", "id", "next", "threads_head", "gc", "imports_modules",
                           "sysdict", "builtins", "ceval_gil", "gil_runtime_state",
                           "gil_runtime_state_enabled", "gil_runtime_state_locked",
                           "gil_runtime_state_holder")),
    ("thread_state", ("size", "prev", "next", "interp", "current_frame", "thread_id",
                      "native_thread_id", "datastack_chunk", "status")),
    ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus",
                           "owner")),
    ("code_object", ("size", "filename", "name", "qualname", "linetable", "firstlineno",
                     "argcount", "localsplusnames", "localspluskinds", "co_code_adaptive")),
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags")),
    ("tuple_object", ("size", "ob_item", "ob_size")),
    ("list_object", ("size", "ob_item", "ob_size")),
    ("dict_object", ("size", "ma_keys", "ma_values")),
    ("float_object", ("size", "ob_fval")),
    ("long_object", ("size", "lv_tag", "ob_digit")),
    ("bytes_object", ("size", "ob_size", "ob_sval")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size")),
    ("gc", ("size", "collecting")),
)
SECTIONS: dict[tuple[int, int], tuple[tuple[str, tuple[str, ...]], ...]] = {(3, 13): _S313}
HEAD = 24  # cookie[8], version, free_threaded


class DebugOffsetsError(ValueError):
    """The bytes at _PyRuntime are not a debug-offsets table fleetd can read."""


def table_size(version: tuple[int, int]) -> int:
    sections = SECTIONS.get(version)
    return HEAD + 8 * sum(len(f) for _, f in sections) if sections else HEAD


def version_of(hexversion: int) -> tuple[int, int]:
    return (hexversion >> 24) & 0xFF, (hexversion >> 16) & 0xFF


def parse(read: Callable[[int], bytes]) -> tuple[int, bool, dict[str, int]]:
    """(PY_VERSION_HEX, free-threaded, {"section.field": offset}) from the start of
    _PyRuntime; ``read(n)`` returns its first n bytes."""
    head = read(HEAD)
    if head[:8] != COOKIE:
        raise DebugOffsetsError(f"no _Py_DebugOffsets cookie at _PyRuntime ({head[:8]!r})")
    hexversion, free = struct.unpack_from("<QQ", head, 8)
    version = version_of(hexversion)
    sections = SECTIONS.get(version)
    if sections is None:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(SECTIONS))
        raise DebugOffsetsError(
            f"_Py_DebugOffsets of CPython {version[0]}.{version[1]} (version field "
            f"{hexversion:#x}) is laid out differently from the tables fleetd reads "
            f"({known})")
    data = read(table_size(version))
    values = iter(struct.unpack_from(f"<{(len(data) - HEAD) // 8}Q", data, HEAD))
    out = {f"{sec}.{name}": next(values) for sec, names in sections for name in names}
    return hexversion, bool(free), out
