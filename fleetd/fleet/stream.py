"""Reading a node's query answer as NDJSON (docs/api.md), line by line as it arrives.

The client asks ``POST /api/v1/query`` with ``Accept: application/x-ndjson``; the
answer's lines are checked as they come by :class:`fleetd.wire.query.QueryStream`,
which raises :class:`fleetd.wire.failure.BadReply` for anything that is not a whole, well
formed answer. The time bound is the request's own (aiohttp's total timeout covers the
whole body).
"""

from __future__ import annotations

import aiohttp

from fleetd.wire import paths
from fleetd.wire.query import QueryStream
from fleetd.wire.shapes import QueryReply


def is_ndjson(resp: aiohttp.ClientResponse) -> bool:
    return resp.content_type == paths.NDJSON


async def read_answer(resp: aiohttp.ClientResponse, cap: int) -> QueryReply:
    """Read a streamed query answer under ``cap`` bytes; see :class:`QueryStream`.
    A node that sends more rows than the limit is cut (its answer marked truncated)
    and the rest of its stream left unread."""
    reader = QueryStream(cap)
    async for piece in resp.content.iter_any():
        if not reader.feed(piece):
            resp.close()  # stop reading; the connection is not reused
            break
    return reader.finish()
