"""What the data becomes outside fleetd. Input: ``local`` (a database) or
``fleet`` and ``pull`` (a live fleet), as the rows of ``model``, with ``clockfix``
correcting each node's clock. Timelines: ``perfetto`` (streamed trace JSON), ``lanes``,
``flows`` (chains as arrows), ``gpu``, ``tracejson``; ``output`` writes a file only
when complete. Reports: ``html`` with ``html_chains``, ``html_frames``, ``html_gpu``
and ``svg``. The lake: ``parquet``.
"""
