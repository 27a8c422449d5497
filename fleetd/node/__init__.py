"""The agent on one node: ``agent`` (the asyncio process), ``api`` (the routes
under /api/v1), ``analysis`` (one route per question of the registry), ``readers`` (the
read-only connection pool: SQLite never on the event loop), ``conns`` (accepted and
capped connections), ``stamps`` (clock stamps on every answer), ``ranks`` (each NCCL
rank's last calls, for hangs), ``detail`` (launch detail on demand), ``metrics``
(``/metrics``), ``lake`` (segments of the Parquet lake) and ``memtrace`` (where its
memory grows, on demand; the C heap trimmed).
Requests come in through ``conns`` and ``api``; answers go out as JSON in the shapes of
:mod:`fleetd.wire`.
"""
