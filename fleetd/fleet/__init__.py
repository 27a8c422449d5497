"""The fleet client: ask every node's agent at once, over mTLS, and merge the answers.

* :mod:`~fleetd.fleet.targets`: which agents (``--nodes``, the config's fleet list);
* :mod:`~fleetd.fleet.client`: one aiohttp session, the concurrency cap, the deadline,
  retries of idempotent reads, and every node failure as a reason with a fix;
* :mod:`~fleetd.fleet.skew`: NTP-style clock offsets per node, and timestamp correction;
* :mod:`~fleetd.fleet.fanout`: one task per node (request + clock samples) under the
  deadline, naming, warnings, the answer's status and exit code;
* :mod:`~fleetd.fleet.combine`: rows led by ``node``, column mismatches, ``--reduce``;
* :mod:`~fleetd.fleet.queries`: query, explain (with stragglers ranked by
  :mod:`fleetd.analyze.stragglers`), ops, overview, stacks and graphs;
* :mod:`~fleetd.fleet.checks`: ``fleetd check --only nodes``, each node's reachability.

docs/fleet.md explains the methods; docs/json.md the output shapes and exit codes.
"""
