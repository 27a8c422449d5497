"""The analyzers: one node's recorded window read back and turned into answers.

Rooms, bottom to top (a room imports only the rooms below it; tests/unit/test_architecture.py):

* ``reading``: what every analyzer reads: the window, one node's slice of a database
  (``data``, ``nodeview``), cgroup samples, pods, wait reasons, on-CPU profiles, frames,
  and the answers' JSON shapes (``answers``).
* ``causes``: explain's causes and chains: slow calls and stalls (``spikes``), the
  causal chain (``chains``), the registry of root causes (``causes``) and each family
  of cause (``contention``, ``pipes``, ``io_owner``, ``memory``, ``oncpu``,
  ``throttle``, ``gpu_chains``, ``idle_frames``), the pattern ``rules``.
* ``pernode``: the per-node model every question shares (``model``: ``NodeSlice``),
  with where each thread's time went (``breakdown``) and per-op statistics (``opstats``).
* ``distributed``: distributed training: collective arrival across ranks (``align``,
  ``arrivals``, ``collectives``), failed NCCL calls, hangs, live lateness and the
  straggler ranking (``stragglers``).
* ``gpu``: the GPU side of imported traces (``device``), CUDA graphs (``graphs``), two
  timelines compared (``diff``).

On top, the questions asked of one node: :mod:`~fleetd.analyze.explain` (chains, then
where the time went), :mod:`~fleetd.analyze.overview`, :mod:`~fleetd.analyze.stacks`,
and :mod:`~fleetd.analyze.facade`, the one door (``TraceAnalysis``) the agent, the CLI
and MCP go through. Data flows up: rows -> ``reading`` -> ``causes`` -> ``pernode`` ->
``distributed`` / ``gpu`` -> the questions -> an answer (JSON-ready typed dicts).
"""
