"""A process's place in a torchrun job, read from its environment: the ``rank``,
``local_rank``, ``world_size`` and ``job`` of its processes row.

Pure functions over a NAME -> value mapping, with no /proc read: the tracer
(:mod:`fleetd.trace.host.procinfo`, when it writes a processes row) and the agent's rank
book (:mod:`fleetd.node.ranks`, when it first sees a rank's NCCL call) read the
environment each their own way and must agree on what it says, so the reading lives
here, below both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


class TorchrunRanks(TypedDict):
    """A process's place in a torchrun job (each None when its variable is unset)."""

    rank: int | None
    local_rank: int | None
    world_size: int | None


def ranks_of(env: Mapping[str, str]) -> TorchrunRanks:
    """rank, local_rank and world_size from torchrun's environment (None: unset)."""
    return {
        "rank": _int(env.get("RANK")),
        "local_rank": _int(env.get("LOCAL_RANK")),
        "world_size": _int(env.get("WORLD_SIZE")),
    }


def job_of(env: Mapping[str, str]) -> str | None:
    """The torchrun job a process belongs to: TORCHELASTIC_RUN_ID (torchrun's
    ``--rdzv-id``; its default ``none`` names no job), else ``MASTER_ADDR:MASTER_PORT``
    when both are set, else None. Ranks of one job share it on every node."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id.lower() != "none":
        return run_id
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    return f"{addr}:{port}" if addr and port else None
