"""How much of each CUDA call the tracer measures: one switch, read by the CLI (trace,
agent) and the tracer's configuration, so that the default is one constant.

- launch returns (``--launch-returns``): every probed call has an entry and a return
  probe: its duration, return code and anomalies are known for every call.
- entry-only launches (``--no-launch-returns``): launch-type calls (kernel launches,
  async copies: ``ProbeSpec.entry_only``) run only an entry probe, through a uprobe
  session link (Linux 6.13+); their return is taken for the 1-in-N record sample and,
  after a failure, until the error budget is spent (bpf/common.bpf.c, fl_launch_entry).
  Counts are exact; durations are a uniform sample; failures are seen from the first
  sampled one of a streak on. Blocking calls (syncs, blocking copies, allocations),
  graph launches and NCCL keep both ends. What each mode misses: docs/performance.md.

No heavy imports here: a client-only install reads this module.
"""

from __future__ import annotations

# The default for `fleetd trace`, `fleetd agent` and TraceConfig.
LAUNCH_RETURNS = False
