"""Coalesces a stream of server-sent events into fewer, larger items for a handle's stream.

Every item a streaming deployment handle carries is one Ray object with its own messages and
scheduling, paid by both replicas' event loops; one token per item makes that hop cost more
than the engine's step at small batches. So the engine deployment sends the first event at once
(time to first token untouched) and after it everything that arrived in each `interval_s`,
joined into one string (concatenated SSE events are still SSE events). Ray Serve LLM does the
same between its engine and ingress deployments (`stream_batching_interval_ms`, 50 ms there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def coalesce(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """Yields the first event alone, then each interval's arrivals joined; 0 passes every event
    through as it comes. Closing this generator (the caller went away) closes `events`."""
    if interval_s < 0:
        raise ValueError(f"stream batching interval must be >= 0, got {interval_s}")
    if interval_s == 0:
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
        return
    pending: list[str] = []
    arrived = asyncio.Event()

    async def read() -> None:
        async for event in events:
            pending.append(event)
            arrived.set()

    reader = asyncio.create_task(read())
    try:
        first = True
        while True:
            if not pending and not reader.done():  # nothing yet: wait for the next arrival
                arrived.clear()
                waiter = asyncio.ensure_future(arrived.wait())
                try:
                    await asyncio.wait([reader, waiter], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
            if not first and not reader.done():  # let the rest of this interval arrive
                await asyncio.wait([reader], timeout=interval_s)
            if pending:
                taken = 1 if first else len(pending)
                chunk = "".join(pending[:taken])
                del pending[:taken]
                first = False
                yield chunk
            elif reader.done():
                reader.result()  # the source's error, if it ended with one
                return
    finally:
        if not reader.done():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        await events.aclose()
