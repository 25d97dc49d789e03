"""serve_app.stream_batching.coalesce: the first event alone, later arrivals joined, nothing lost
or reordered, the source's error raised after what came before it, the source closed when the
consumer leaves."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.stream_batching import coalesce


def run(coro):
    return asyncio.run(coro)


class Source:
    """Yields its script: strings are events, asyncio.Events are gates it waits on, an exception
    is raised. Records whether it was closed."""

    def __init__(self, *script):
        self.script = script
        self.closed = False

    async def events(self):
        try:
            for step in self.script:
                if isinstance(step, asyncio.Event):
                    await step.wait()
                elif isinstance(step, BaseException):
                    raise step
                else:
                    yield step
        finally:
            self.closed = True


@pytest.mark.parametrize("interval_s", [0.0, 0.005])
def test_events_come_through_in_order_and_complete(interval_s):
    async def main():
        source = Source(*[f"data: {i}\n\n" for i in range(50)])
        chunks = [c async for c in coalesce(source.events(), interval_s)]
        assert "".join(chunks) == "".join(f"data: {i}\n\n" for i in range(50))
        assert chunks[0] == "data: 0\n\n"  # the first event is never held back
        assert source.closed
        return chunks

    chunks = run(main())
    if interval_s == 0:
        assert len(chunks) == 50  # 0: every event its own item
    else:
        assert len(chunks) < 50  # events that arrive together travel together


def test_arrivals_between_reads_are_joined_into_one_item():
    async def main():
        gate1, gate2 = asyncio.Event(), asyncio.Event()
        source = Source("a", gate1, "b", "c", gate2, "d")
        stream = coalesce(source.events(), 0.001)
        assert await stream.__anext__() == "a"
        gate1.set()
        assert await stream.__anext__() == "bc"
        gate2.set()
        assert [c async for c in stream] == ["d"]

    run(main())


def test_a_source_error_is_raised_after_the_events_before_it():
    async def main():
        source = Source("a", "b", RuntimeError("engine died"))
        got = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for chunk in coalesce(source.events(), 0.001):
                got.append(chunk)
        assert "".join(got) == "ab"

    run(main())


@pytest.mark.parametrize("interval_s", [0.0, 0.001])
def test_leaving_early_closes_a_blocked_source(interval_s):
    async def main():
        source = Source("a", asyncio.Event(), "never")  # blocks forever after "a"
        stream = coalesce(source.events(), interval_s)
        assert await stream.__anext__() == "a"
        await stream.aclose()
        assert source.closed

    run(main())


def test_cancelling_the_consumer_closes_the_source():
    async def main():
        source = Source("a", asyncio.Event(), "never")
        first = asyncio.Event()

        async def consume():
            async for _ in coalesce(source.events(), 0.001):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert source.closed

    run(main())


def test_a_negative_interval_is_refused():
    async def main():
        with pytest.raises(ValueError, match="interval"):
            await coalesce(Source("a").events(), -1).__anext__()

    run(main())


@pytest.mark.parametrize("bad", [-5, "20", True, 5000])
def test_the_engine_deployment_refuses_a_bad_interval_before_loading_anything(bad):
    from serve_app.deployments import EngineServer

    with pytest.raises(ValueError, match="stream_batching_interval_ms"):
        EngineServer.func_or_class(stream_batching_interval_ms=bad)


def test_the_single_topology_refuses_the_interval():
    from serve_app.server import build_app

    with pytest.raises(ValueError, match="stream_batching_interval_ms applies to topology: ingress"):
        build_app({"stream_batching_interval_ms": 10})
