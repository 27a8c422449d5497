"""``--pod`` and ``--namespace``: select processes by the Kubernetes pod they ran in, as
the tracer recorded it per process (fleetd.analyze.reading.pods), where ``--pid`` selects one;
with ``--nodes`` every node selects its own (fleet_selection)."""

from __future__ import annotations

import argparse
import sqlite3

from fleetd.analyze.reading import pods
from fleetd.errors import UsageError
from fleetd.wire.pods import params, read_params


def add_pod_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pod", metavar="[NAMESPACE/]NAME",
                   help="only processes of this Kubernetes pod (as recorded by fleetd trace "
                   "or the agent; docs/deploy.md)")
    p.add_argument("--namespace", metavar="NAMESPACE",
                   help="only processes of pods in this Kubernetes namespace")


def selected_pids(args: argparse.Namespace, conn: sqlite3.Connection) -> set[int] | None:
    """The pids ``--pod`` / ``--namespace`` select (None: neither given); a UsageError
    with the pods the file names when they select nothing."""
    return pods.selected(conn, getattr(args, "pid", None), getattr(args, "pod", None),
                         getattr(args, "namespace", None))


def fleet_selection(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(pod, namespace) to ask every node for (fleetd.wire.pods: each node selects its
    own processes of them); checked here first, so that a mistake is one usage error
    and not one failed request per node."""
    pod, ns = getattr(args, "pod", None) or None, getattr(args, "namespace", None) or None
    if not pod and not ns:
        return None, None
    if getattr(args, "pid", None):
        raise UsageError("--pid and --pod/--namespace both select processes",
                         "give one of them")
    try:
        read_params(params(pod, ns))
    except ValueError as exc:
        raise UsageError(str(exc).replace("pod=", "--pod ").replace("namespace=",
                                                                    "--namespace "),
                         "give a pod as NAME or NAMESPACE/NAME") from exc
    return pod, ns
