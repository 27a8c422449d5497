"""What keeps a cold compile of the BPF programs cheap (#41.1; bench/compile_cost.py
measures it): the start compiles the module without the per-op programs where the
kernel has uprobe_multi, the sources include no kernel header beyond the one BCC's
macros need, and no call site sends BCC's rewriter to /proc/kallsyms. Each of these
cost a cold start seconds of CPU; the live side (the left-out programs compiled when
first loaded, sharing the start's maps) is tests/integration/test_bpf_lean_live.py."""

from __future__ import annotations

import re

import pytest

from fleetd.trace.bpf import probes
from fleetd.trace.bpf.bpfsrc import LAYERS, MULTI_SINCE, per_symbol_first, source_text


@pytest.mark.parametrize(("release", "first"), [
    ("6.18.44-fc-v669", False), ("6.6.0", False), ("7.0.1-arch1", False),
    ("6.5.13-generic", True), ("5.15.0-91-generic", True), ("4.18.0-513.el8.x86_64", True),
    ("unknown", True), ("6", True),
])
def test_the_per_op_programs_go_into_the_start_only_before_uprobe_multi(
        release: str, first: bool) -> None:
    assert per_symbol_first(release) is first
    assert MULTI_SINCE == (6, 6)  # the kernel that brought uprobe_multi links


def _per_op_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"int fl_(in|out)_[A-Z0-9_]+\(",
                                                           line)
            and not line.startswith(("int fl_in_multi(", "int fl_out_multi("))]


def test_the_lean_program_is_the_complete_one_less_its_per_op_programs() -> None:
    complete = source_text(LAYERS, oncpu=True)
    lean = source_text(LAYERS, oncpu=True, per_symbol=False)
    per_op = _per_op_lines(complete)
    # Two per op (entry and return), each a program the per-symbol ladder attaches.
    assert len(per_op) == 2 * len(probes.SPECS)
    for spec in probes.SPECS:
        assert any(line.startswith(f"int {spec.entry_fn}(") for line in per_op)
        assert any(line.startswith(f"int {spec.return_fn}(") for line in per_op)
    assert not _per_op_lines(lean)
    # Nothing else differs: the maps and every other program are the same source.
    kept = [line for line in complete.splitlines() if line not in set(per_op)]
    assert kept == lean.splitlines()
    for dispatcher in ("int fl_in_multi(", "int fl_out_multi(", "int fl_sess_multi("):
        assert dispatcher in lean


def test_the_sources_include_no_kernel_header_but_ptrace() -> None:
    """Each kernel header is parsed three times per compile (BCC's tracepoint pass, its
    rewriter, the code generator): uapi/linux/bpf_perf_event.h alone brought some 400
    through linux/sched.h, over a second of a cold start's CPU."""
    text = source_text(LAYERS, oncpu=True)
    assert re.findall(r"^\s*#\s*include\s*<([^>]+)>", text, re.M) == ["uapi/linux/ptrace.h"]


def test_no_call_site_makes_bccs_rewriter_scan_the_kernel_symbols() -> None:
    """BCC 0.26 looks /proc/kallsyms up (~60 ms of CPU) at every call of
    bpf_probe_read_user(_str): the sources read user memory through fl_read_user."""
    text = source_text(LAYERS, oncpu=True)
    code = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    assert not re.findall(r"\bbpf_probe_read_user(_str)?\s*\(", code)
    assert "fl_read_user(" in code and "fl_read_user_str(" in code
