"""What every analyzer reads: the window (``window``), one node's slice of a
database (``data``, ``nodeview``, the rules' walks of a span in ``spanreads``; its timed
events summed per thread, op and wait in
``sums``), per-cgroup samples (``cgroup_samples``), where each
process ran (``pods``), why a thread slept (``waits``), on-CPU samples folded into stacks
(``profile``), stack frames as text (``frames``) and the answers' shapes (``answers``,
the NCCL collectives' in ``answers_collectives``, ``fleetd diff``'s in ``answers_diff``,
a chain's victim, culprits, detail and evidence in ``answers_chain``;
the rows they hold, op and process rows, a process's placement and the pods answer, in
``rows``). The bottom room of :mod:`fleetd.analyze`: it imports no other room.
"""
