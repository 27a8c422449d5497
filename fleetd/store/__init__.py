"""The node database: the bottom stage every other one reads or writes.

* the file: ``schema`` (tables, versions, migrations), ``sparse`` (the rare ops' index),
  ``summaries`` (per-second sums made while the writer is idle),
  ``db`` (open, create, refuse), ``files`` (no symlinks, owner-only), ``writer`` (the one
  writer thread),
  ``pruning`` and ``sizecap`` (the oldest events deleted to keep the files under a cap),
  ``taskrefs`` (then the thread and process rows nothing kept names),
  ``losses`` (what a crash or a full disk cost), ``health`` (the agent's
  report of its tracer and store), ``checks``;
* the rows: ``catalog`` (one code per traced op, and the op families), ``chainrow``
  (a stored causal chain), ``caps``, ``cuda_errors``, ``syscalls``, ``clockinfo``,
  ``torchrun`` (a process's rank and job, from its environment);
* reading safely: ``guard`` (untrusted SQL), ``foreign`` (files fleetd did not write),
  ``bounds`` and ``timeparse`` (a window and a duration, parsed once);
* other files: ``imports`` (profiler files), ``merge`` and ``mergeplan`` (air-gapped
  databases into one), ``lake``, ``lakefs`` and ``lakesql`` (the Parquet lake).
"""
