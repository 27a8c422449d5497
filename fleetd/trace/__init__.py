"""The tracer: BPF programs on the node, their records into the node store.

Rooms, bottom to top (tests/unit/test_architecture.py holds the order):

* ``host``: facts about the machine and its processes, read from the kernel:
  ``cgroups``, ``procinfo``, ``memory`` (pressure), ``libs`` (the CUDA code to probe),
  ``headers`` (kernel headers for BCC), ``clock``, ``preflight``, ``require`` and
  ``podcheck``.
* ``bpf``: the BPF programs and their attach: ``bpfsrc`` (build and compile),
  ``bpfcache`` and ``bpfload`` (the compiled-program cache), ``probes`` (the attach
  ladder), ``modes``, ``mapwatch`` (probes before the first call), ``rings`` and
  ``ringbuf`` (the ring buffers), ``decoder`` (ring records into store rows).
* ``enrich``: what is added to a row in user space: ``stacks``, ``symbols``,
  ``pyframes``, ``pydebug`` and ``pyusdt`` (Python frames and GC), ``oncpu`` (on-CPU
  samples), ``fdpeers`` (the file behind a blocked read or write).

On top, the session: ``config`` (what a session is asked to do), ``targets`` (which
processes and libraries), ``intake`` (rings -> decode -> enrich -> the writer),
``siderows``, ``accounting`` (the session row and every loss), ``dutycycle``,
:mod:`~fleetd.trace.tracer` (the ``Tracer``), ``agent_hook`` (the tracer as the agent
runs it) and ``checks`` (``fleetd check``).
"""
