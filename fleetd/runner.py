"""One way to run fleetd's asyncio code: uvloop, with handshake noise kept quiet.

The agent, the fleet client, ``fleetd check`` and the MCP server all run their
coroutines through :func:`run_loop`, so they share the loop policy and the exception
handler below.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("fleetd.runner")
T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on uvloop (asyncio's own loop if uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_quietly(coro))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_quietly(coro))


async def _quietly(coro: Coroutine[Any, Any, T]) -> T:
    asyncio.get_running_loop().set_exception_handler(_tls_noise)
    return await coro


def _tls_noise(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """uvloop leaves a failed handshake's future unretrieved, and asyncio would print
    its traceback; the failure itself is already reported (a node warning, a counter)."""
    exc = context.get("exception")
    if isinstance(exc, ssl.SSLError | ConnectionError):
        log.debug("%s: %r", context.get("message"), exc)
        return
    loop.default_exception_handler(context)
