"""Explain's causes and chains. ``spikes`` finds the slow calls and
stalls and what overlapped them; ``chains`` groups them into causal chains per thread
and cause; ``causes`` is the registry of root causes (words, fixes, evidence) and
``wait_words`` their texts for waits; ``rules`` turns patterns into chains. Each family
of cause has its module: ``contention`` (locks, data), ``pipes`` (a slow peer),
``io_owner`` (whose I/O a D-state wait was), ``memory`` (reclaim), ``oncpu`` (GC,
host-bound), ``throttle`` (CPU quota), ``gpu_chains`` and ``idle_frames`` (the GPU
idle while its feeder could not run). Imports only :mod:`fleetd.analyze.reading`.
"""
