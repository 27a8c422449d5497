"""A delaying TCP relay, run by bench/fanout.py inside each agent's network namespace.

Our kernels have no ``netem`` qdisc (``tc qdisc add ... netem`` answers "Specified qdisc
kind is unknown"), so a link delay is made in user space instead: this process listens on
the namespace's own address, forwards every connection to the agent on the namespace's
loopback, and holds each chunk for ``--delay-ms`` in each direction (order kept), so a
round trip through it costs twice that plus the relay's own few tens of microseconds.

    python bench/_delay.py --listen 10.232.0.10:7600 --to 127.0.0.1:7600 --delay-ms 5

It prints ``ready`` once it listens, and runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

CHUNK = 64 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                delay_s: float) -> None:
    """Copy one direction, each chunk written ``delay_s`` after it was read."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while True:
            data = await reader.read(CHUNK)
            queue.put_nowait((loop.time() + delay_s, data))
            if not data:
                return

    reading = asyncio.create_task(read())
    try:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
    finally:
        reading.cancel()


async def _serve(listen: tuple[str, int], to: tuple[str, int], delay_s: float) -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*to)
        except OSError:
            w.close()
            return
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await asyncio.gather(_pump(r, uw, delay_s), _pump(ur, w, delay_s))
        w.close()
        uw.close()

    server = await asyncio.start_server(handle, *listen, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, type=_addr)
    p.add_argument("--to", required=True, type=_addr)
    p.add_argument("--delay-ms", type=float, default=5.0)
    a = p.parse_args()
    try:
        import uvloop
        uvloop.run(_serve(a.listen, a.to, a.delay_ms / 1e3))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(_serve(a.listen, a.to, a.delay_ms / 1e3))


if __name__ == "__main__":
    main()
