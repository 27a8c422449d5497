"""The per-node model: ``model`` (``NodeSlice``, one node over one
window, loaded once and shared by every question), ``breakdown`` (where each traced
thread's wall time went) and ``opstats`` (per-op latency statistics). Built on
``reading`` and ``causes``; ``preload`` (explain's first reads, on two CPUs where it pays).
"""
