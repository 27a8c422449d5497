"""The wire between a node's agent and the fleet client: what both ends must agree on.

* :mod:`~fleetd.wire.paths`: the API's paths and media types;
* :mod:`~fleetd.wire.headers`: the ``X-Fleetd-*`` headers;
* :mod:`~fleetd.wire.limits`: the bounds of a value and of an answer;
* :mod:`~fleetd.wire.shapes`: the answers' JSON shapes as ``TypedDict`` (docs/api.md),
  written by the agent and read by the client;
* :mod:`~fleetd.wire.failure`: why a node gave no usable answer (``Failure``), and
  ``BadReply``, the one error a bad answer becomes;
* :mod:`~fleetd.wire.values`: checked readers for one untrusted value;
* :mod:`~fleetd.wire.query`: the query answer, as JSON or streamed NDJSON, checked once
  where it is read; :mod:`~fleetd.wire.replies`: the small answers (``time``);
* :mod:`~fleetd.wire.chains`, :mod:`~fleetd.wire.gpu`, :mod:`~fleetd.wire.collectives`,
  :mod:`~fleetd.wire.ranks`: the analysis answers, checked (or rebuilt from checked
  values) into the analyzers' own types;
  :mod:`~fleetd.wire.answers`: the analyzers' answers as typed dictionaries;
* :mod:`~fleetd.wire.pods`: selecting processes by Kubernetes pod across the wire.

It sits below ``fleetd.node`` and ``fleetd.fleet`` (docs/architecture.md) and imports
only the base, the op catalogue's families and the analyzers' types, so both ends read
the same definitions and neither imports the other.
"""
