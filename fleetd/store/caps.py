"""How long a name a traced process chose may be when it is stored.

A traced process names a great deal of what the node database keeps: its comm and its
threads' names, its argv and environment (the torchrun job), its cgroup path and, through
them, the pod, container and namespace, its Python functions and files, the kernels it
launches. Any of them can be made a megabyte long, and every copy is kept, served to
every client and rendered. Each is cut here, once, where the writer takes it: the caps
below are by what the value is (a column or an event-args key), generous for what the
thing legitimately is (a comm is 16 bytes, a namespace 63 characters, a demangled C++
kernel name a few kB), and a value cut ends in :data:`MARK` so a reader sees that it was.

Only lengths: control characters are left as they are, for the output layer to show
escaped (machine formats keep the stored value exact).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MARK = "…"  # ends a value that was cut
# characters, by column or args key
CAPS: dict[str, int] = {
    "comm": 64,  # the kernel's TASK_COMM_LEN is 16
    "exe": 4096,  # PATH_MAX
    "cmdline": 4096,
    "job": 256,  # TORCHELASTIC_RUN_ID, or MASTER_ADDR:MASTER_PORT
    "cgroup": 4096,
    "runtime": 32,
    "container": 64,  # a container id (12 hex shown)
    "container_name": 253,  # Kubernetes names: DNS subdomains of at most 253
    "pod": 253,
    "namespace": 63,  # a DNS label
    "pod_uid": 64,
    "qos": 32,
    "kernel": 4096,  # a demangled template kernel's name
    "frame": 1024,  # one stack frame: a Python function (file:line), a native symbol
}
DEFAULT_CAP = 1024  # any other text an event's args carry

def cap(what: str, value: str) -> str:
    """``value`` cut to the cap of ``what`` (:data:`CAPS`, else :data:`DEFAULT_CAP`)."""
    limit = CAPS.get(what, DEFAULT_CAP)
    return value if len(value) <= limit else value[: limit - len(MARK)] + MARK


def capped(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row or an event's args with each text value (and each text in a list) cut to
    its key's cap; other values as they are."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, str):
            value = cap(key, value)
        elif isinstance(value, list):
            value = [cap(key, v) if isinstance(v, str) else v for v in value]
        out[key] = value
    return out
