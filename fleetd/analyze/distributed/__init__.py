"""Distributed training across nodes and ranks: ``align`` (which
collective call of one rank is which of another), ``arrivals`` (a node's NCCL calls as
it hands them over), ``collectives`` (who the others waited for), ``nccl_failures``,
``hangs`` (judged from each rank's last calls), ``lateness`` (the live rule of
``fleetd watch``) and ``stragglers`` (which node's comparable work is slower, and why).
"""
