"""The ``X-Fleetd-*`` headers (docs/api.md, "Clock stamps" and "POST /api/v1/relay")."""

from __future__ import annotations

# On every answer: the agent's wall clock (UTC ns) when the request reached the
# application (NTP's t1) and when the answer's headers were written (t2).
RECV_NS = "X-Fleetd-Recv-Ns"
SEND_NS = "X-Fleetd-Send-Ns"

# Set by a relay on every request it forwards: who asked it (as the relay saw the
# client's certificate) and the limits it forwards. Peers log both, and refuse to relay
# a request that carries them.
RELAYED_FOR = "X-Fleetd-Relayed-For"
RELAY_LIMITS = "X-Fleetd-Relay-Limits"

# On each message fleetd watch posts to a webhook (docs/fleet.md, "Telling someone"):
# when it was sent (Unix seconds) and sha256=HMAC(secret, timestamp '.' body).
WEBHOOK_TIMESTAMP = "X-Fleetd-Timestamp"
WEBHOOK_SIGNATURE = "X-Fleetd-Signature"
