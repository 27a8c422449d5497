"""The ``fleetd`` command: ``main`` (one parser, errors become one line) and one
``*_cmd`` module per command; a command module never imports another one. Shared by
commands: ``argtypes`` (argument types), ``window_args`` (the database and window
options, the analyzer they open), ``trace_args`` (the tracer options of trace and
agent), ``fleet_args`` (the fleet options), ``lake_args``, ``pod_args``, ``output``
(table, JSON, CSV, NDJSON), ``explain_render`` (explain's report as text), ``outfile``
(``-o``), ``progress``, ``questions`` (asking the registry), ``launch`` (``trace --
CMD``), ``demo_slices``.
"""
