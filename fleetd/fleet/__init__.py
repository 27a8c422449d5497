"""The fleet client: ask every node's agent at once, over mTLS, and merge the answers.

* :mod:`~fleetd.fleet.targets`: which agents (``--nodes``, the config's fleet list);
* :mod:`~fleetd.fleet.client`: one aiohttp session, the concurrency cap, the deadline,
  retries of idempotent reads, and every node failure as a reason with a fix;
* :mod:`~fleetd.fleet.skew`: NTP-style clock offsets per node, and timestamp correction;
* :mod:`~fleetd.fleet.fanout`: one task per node (request + clock samples) under the
  deadline, each answer checked once by its wire reader, naming, warnings, the answer's
  status and exit code; :mod:`~fleetd.fleet.relayed` the same through peer relays, and
  :mod:`~fleetd.fleet.dispatch` the entry that picks one of the two;
* :mod:`~fleetd.fleet.combine`: rows led by ``node``, column mismatches, ``--reduce``;
* :mod:`~fleetd.fleet.queries`: query, explain (with stragglers ranked by
  :mod:`fleetd.analyze.distributed.stragglers`), ops, overview, stacks and graphs, each a
  :class:`~fleetd.fleet.result.FleetResult`;
* :mod:`~fleetd.fleet.stream`: a query answer read as NDJSON, line by line;
* :mod:`~fleetd.fleet.collectives`: every node's collective arrivals in this clock;
* ``fleetd watch``'s side: :mod:`~fleetd.fleet.hang` (hang verdicts over every node's
  ranks), :mod:`~fleetd.fleet.straggle` (stragglers seen live, their cause the one that
  changed: :mod:`~fleetd.fleet.cause_change`), :mod:`~fleetd.fleet.chains` (a process's
  chains over a window, asked of its node) and :mod:`~fleetd.fleet.notify` (each finding
  and its recovery to a webhook or a command);
* :mod:`~fleetd.fleet.checks`: ``fleetd check --only nodes``, each node's reachability.

What the client and the agents agree on (paths, headers, limits, answer shapes and
their checked readers) is :mod:`fleetd.wire`. docs/fleet.md explains the methods;
docs/json.md the output shapes and exit codes.
"""
