"""One way to run fleetd's asyncio code: uvloop, with handshake noise kept quiet.

The agent, the fleet client, ``fleetd check`` and the MCP server all run their
coroutines through :func:`run_loop`, so they share the loop policy and the exception
handler below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("fleetd.runner")
T = TypeVar("T")
_LOOPS = threading.local()  # one event loop per thread, kept open (see run_loop)


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on this thread's uvloop (asyncio's own loop if uvloop
    is missing), and leave the loop open for the next call.

    Closing a uvloop loop tears down libuv's io_uring ring, and the kernel's clean-up of
    it interrupts the process's next blocking write once: a ``fleetd query --nodes ...
    | less`` then lost everything past the first 64 KiB of its output (measured: 65,536
    of 200,000 bytes reached the pipe). So each thread keeps one loop for the life of
    the process (the CLI calls this once or a few times; the MCP server from a few
    worker threads), and exiting the process is what closes it.
    """
    loop = getattr(_LOOPS, "loop", None)
    if loop is None or loop.is_closed():
        loop = _new_loop()
        loop.set_exception_handler(_tls_noise)
        _LOOPS.loop = loop
    task: asyncio.Task[T] = loop.create_task(coro)
    try:
        return loop.run_until_complete(task)
    except BaseException:
        # Ctrl-C (or any escape) while the task runs: cancel it and let it clean up
        # (close sessions and sockets) before the error goes on.
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                loop.run_until_complete(task)
        raise


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _tls_noise(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """uvloop leaves a failed handshake's future unretrieved, and asyncio would print
    its traceback; the failure itself is already reported (a node warning, a counter)."""
    exc = context.get("exception")
    if isinstance(exc, ssl.SSLError | ConnectionError):
        log.debug("%s: %r", context.get("message"), exc)
        return
    loop.default_exception_handler(context)
