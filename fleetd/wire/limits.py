"""Bounds both ends of the wire hold a value or an answer to."""

from __future__ import annotations

# What SQLite stores and compares, and what a JSON answer may carry as an integer.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# A node's answer beyond this is refused as it streams in, never buffered whole. JSON
# becomes Python objects 10-30x its size, so this bounds the client's memory per node
# (an agent's own answers stay under its 16 MB query limit).
MAX_ANSWER_BYTES = 32 * 1024 * 1024
TIME_BODY_BYTES = 4 * 1024  # a /api/v1/time answer is under 100 bytes
ERROR_BODY_BYTES = 64 * 1024  # of an error answer, enough for the message

NAME_CHARS = 253  # a node's self-reported name, as at most a host name
POD_CHARS = 253  # a pod, namespace or container name asked for or answered (DNS subdomain)
COLUMN_CHARS = 1000  # a column name of a streamed answer, as printed
MAX_COLUMNS = 256  # as the agent's guard allows
# Rows one answer may hold, whatever limit the node's header claims: a row of one small
# value is about 100 bytes as Python objects, so this bounds the rows' memory to the
# order of the byte cap's.
MAX_ROWS = 1_000_000
RELAY_REQUESTS = 8  # requests one relayed call may carry (a fleet plan has one to three)
