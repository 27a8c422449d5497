"""Facts about the machine and the traced processes, read from the kernel
and /proc: ``cgroups`` (container, pod, CPU limit), ``procinfo``, ``memory`` (reclaim
and PSI), ``libs`` (the CUDA libraries and their entry points), ``headers`` (kernel
headers for BCC), ``clock`` (monotonic to wall clock), ``preflight`` and ``require``
(what tracing needs) and ``podcheck``. The bottom room of :mod:`fleetd.trace`.
"""
