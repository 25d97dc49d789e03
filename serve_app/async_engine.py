"""AsyncLLMEngine: the engine loop on its own thread, one async token stream per request.

Every call posts a command to the engine thread and awaits its answer; outputs come back through
one asyncio.Queue per request, the tokens of one step (a speculative round) as one StreamDelta.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import traceback
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine import LLMEngine, Prompt
from engine.faults import is_device_fault
from engine.logprobs import TokenLogprob
from engine.request import FinishReason, RequestOutput, StepOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("serve_app.async_engine")


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    output: RequestOutput | None = None  # the final record, on the last delta
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the delta's tokens', when asked for


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served by this engine."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; retry later."""


class RequestStream:
    """Async iterator over one request's deltas. Closing it before the end (even before the first
    delta), or cancelling its consumer, aborts the request: its KV is freed within one step."""

    def __init__(self, owner: AsyncLLMEngine, request_id: str, queue_: asyncio.Queue):
        self._owner, self.request_id, self._queue = owner, request_id, queue_
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer is gone
            await self.aclose()
            raise
        self.finished = isinstance(item, BaseException) or item.finished
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner._abort_soon(self.request_id)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 max_waiting_requests: int | None = None):
        # a cold start leaves the largest batch's calibration to the loop's first idle moment
        self.engine = engine if engine is not None else LLMEngine(config, defer_calibration=True)
        self.max_waiting_requests = max_waiting_requests
        self.config = self.engine.config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.fatal_error: str | None = None
        self.step_observers: list[Callable[[LLMEngine, list], None]] = []
        # the prefix cache's hit rate over finished requests: prompt tokens, and those read from the cache
        self.prompt_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def check_health(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"engine loop is not running: {self.fatal_error or 'thread exited'}")

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def prefix_cache_stats(self) -> dict:
        """Prompt tokens of the finished requests, how many the prefix cache served, and their ratio."""
        total, cached = self.prompt_tokens_total, self.cached_prompt_tokens_total
        return {"prompt_tokens": total, "cached_tokens": cached, "hit_rate": cached / total if total else None}

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Runs fn(engine) on the engine thread between steps and returns its result."""
        self.check_health()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    async def add(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queues a request and returns its stream. Raises ValueError for bad input and
        EngineOverloadedError when the engine's waiting queue is full. A `ChatPrompt` is built from
        its messages (and tools) by the tokenizer's chat template, on the engine's side."""
        return (await self.add_samples(prompt, [params], request_id))[0]

    async def add_samples(self, prompt: Prompt, params: list[SamplingParams],
                          request_id: str | None = None) -> list[RequestStream]:
        """`add` for len(params) samples of one prompt (OpenAI's n), queued together or not at all:
        the first computes the prompt, the others read it from the prefix cache once it is in KV."""
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in params]

        def add(engine: LLMEngine) -> list[str]:
            if self.max_waiting_requests is not None and engine.num_waiting() + len(params) > self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"the engine has {engine.num_waiting()} requests waiting (limit {self.max_waiting_requests})")
            ids = engine.tokenize_prompt(prompt)  # once for every sample
            added: list[str] = []
            try:
                for i, p in enumerate(params):
                    rid = None if request_id is None else (request_id if i == 0 else f"{request_id}-{i}")
                    added.append(engine.add_request(ids, p, rid, shares_prompt_of=added[0] if added else None))
            except Exception:
                for rid in added:
                    engine.abort(rid)
                    engine.release(rid)
                raise
            for rid, q in zip(added, queues):
                self._streams[rid] = (loop, q)
            return added

        return [RequestStream(self, rid, q) for rid, q in zip(await self.call(add), queues)]

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncGenerator[StreamDelta, None]:
        """Streams a request's output (see `add`). Leaving the loop early aborts the request."""
        stream = await self.add(prompt, params, request_id)
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    def _abort_soon(self, request_id: str) -> None:
        self._commands.put((lambda e: self._abort(e, request_id), None))
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: self._abort(e, request_id))

    def _abort(self, engine: LLMEngine, rid: str) -> None:
        if (out := engine.abort(rid)) is not None:
            self._publish(engine, {rid: StreamDelta(rid, out.text, [], True, "abort")})

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(self.engine)
            except Exception as exc:  # bad input etc.: the caller gets the exception
                if fut is not None:
                    fut.set_exception(exc)
                else:
                    log.warning("engine command failed: %s", exc)
            else:
                if fut is not None:
                    fut.set_result(result)

    def _publish(self, engine: LLMEngine, deltas: dict[str, StreamDelta]) -> None:
        for rid, delta in deltas.items():
            if delta.finished:
                delta.output = engine.get_output(rid) if engine.request(rid) is not None else None
                if delta.output is not None:
                    self.prompt_tokens_total += len(delta.output.prompt_token_ids)
                    self.cached_prompt_tokens_total += delta.output.num_cached_prompt_tokens or 0
                engine.release(rid)
                _send(self._streams.pop(rid, None), delta)
            else:
                _send(self._streams.get(rid), delta)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            self.engine.abort(rid, error=message)
            self._publish(self.engine, {rid: StreamDelta(rid, "", [], True, "error")})

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    if engine.run_idle_work():  # start-up's leftovers (a calibration) while nothing waits
                        continue
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                try:
                    outputs = engine.step()
                except Exception as exc:
                    if is_device_fault(exc):
                        raise  # fatal: below, the loop stops and the health check fails
                    log.error("engine step failed; failing the running requests:\n%s", traceback.format_exc())
                    self._fail_all(f"internal error in the engine step: {exc}")
                    continue
                for observer in self.step_observers:
                    observer(engine, outputs)
                self._publish(engine, _deltas(outputs))
        except BaseException as exc:  # the loop itself broke, or the device faulted: health checks must fail
            self.fatal_error = f"{'device fault, replica must be replaced: ' if is_device_fault(exc) else ''}" \
                               f"{type(exc).__name__}: {exc}"
            log.critical("engine loop died:\n%s", traceback.format_exc())
            for target in list(self._streams.values()):
                _send(target, EngineDeadError(self.fatal_error))


def _deltas(outputs: list[StepOutput]) -> dict[str, StreamDelta]:
    """One step's outputs as one delta per request."""
    deltas: dict[str, StreamDelta] = {}
    for o in outputs:
        d = deltas.setdefault(o.request_id, StreamDelta(o.request_id, ""))
        d.text += o.text
        if o.token_id >= 0:
            d.token_ids.append(o.token_id)
        if o.logprob is not None:
            d.logprobs.append(o.logprob)
        if o.finished:
            d.finished, d.finish_reason = True, o.finish_reason
    return deltas


def _send(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None, item) -> None:
    """Puts item on a stream's queue from the engine thread (nothing if the stream or its loop is gone)."""
    if target is None:
        return
    loop, q = target
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # the consumer's loop is closed
        pass
