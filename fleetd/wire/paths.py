"""The node API's paths (docs/api.md), named once for the agent's routes and the client's
requests, and the media types of its answers."""

from __future__ import annotations

PREFIX = "/api/v1/"

HEALTH = "/api/v1/health"
TIME = "/api/v1/time"
QUERY = "/api/v1/query"
EVENTS = "/api/v1/events"
CHAINS = "/api/v1/chains"
OPS = "/api/v1/ops"
OVERVIEW = "/api/v1/overview"
PROFILE = "/api/v1/profile"
STACKS = "/api/v1/stacks"
CPU_STACKS = "/api/v1/cpu_stacks"  # on-CPU samples per (thread, stack): fleetd profile
GRAPHS = "/api/v1/graphs"
GPU = "/api/v1/gpu"
COLLECTIVES = "/api/v1/collectives"
RANKS = "/api/v1/ranks"
PODS = "/api/v1/pods"  # the pods that ran on the node, with their processes: fleetd pods
RELAY = "/api/v1/relay"
DETAIL = "/api/v1/detail"  # POST: launch detail for N seconds (--mode always-on)

# Query parameters of CHAINS and OPS that select processes by where they ran (fleetd
# explain/ops --pod, --namespace): the node keeps the processes its process_data places
# there, and answers no rows when none ran there.
POD_PARAM = "pod"  # [NAMESPACE/]NAME
NAMESPACE_PARAM = "namespace"

JSON = "application/json"
NDJSON = "application/x-ndjson"  # a streamed query answer, one JSON value per line
