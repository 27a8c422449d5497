"""The ``fleetd`` command: ``main`` (one parser, errors become one line) and one
``*_cmd`` module per command. Shared by commands: ``argtypes`` (argument types),
``fleet_args`` (the fleet options), ``lake_args``, ``pod_args``, ``output`` (table,
JSON, CSV, NDJSON), ``outfile`` (``-o``), ``progress``, ``questions`` (asking the
registry), ``launch`` (``trace -- CMD``), ``demo_slices``.
"""
