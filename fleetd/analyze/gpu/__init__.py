"""The GPU side: ``device`` (where device time went per rank, launch
latency, the host-overhead verdict), ``graphs`` (CUDA graph capture, instantiation and
replay) and ``diff`` (two GPU timelines compared). The top room of
:mod:`fleetd.analyze`.
"""
