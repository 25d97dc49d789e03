"""OpenAI's completions and chat completions over one engine: the response bodies and server-sent
events both topologies send (deployments.py), built from the engine's outputs."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator

from engine.config import EngineConfig, with_embedded_defaults
from engine.grammar import GrammarError
from engine.metrics import StepMetrics
from engine.request import RequestOutput
from engine.tokenizer import ChatPrompt
from serve_app.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, StreamDelta
from serve_app.errors import APIError
from serve_app.http_app import DONE, event
from serve_app.kernel_caches import bound_kernel_caches
from serve_app.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs, join, prompt_completion_logprobs
from serve_app.metrics import BufferedRecorder, RayMetricsExporter
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.replica import (
    DEVICE_FAULT_PREFIX,
    DEVICE_FAULT_USER,
    FAULT_PREFIX,
    FAULT_USER,
    inject_fault,
    node_id,
    replica_id,
    rss_bytes,
    threads_for_replica,
)
from serve_app.tool_parsers import format_of_template, parser_for
from serve_app.tool_rendering import render_messages

log = logging.getLogger("ray.serve")  # configured by Serve in replicas


async def interleaved(streams: list) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(choice index, delta) of every stream as each arrives; a stream's error is raised here.
    Closing it cancels the rest and closes every stream (aborting its request)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except BaseException as exc:  # an engine error reaches the client as an event
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_ = len(streams)
        while open_:
            index, item = await queue.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


def speculation_stats(outs: list[RequestOutput], method: str | None) -> dict:
    """The extension field: speculation over the request's choices, summed."""
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    rounds = sum(o.num_spec_rounds for o in outs)
    histogram: Counter[int] = Counter()  # decode steps by the K chosen for the request
    for o in outs:
        histogram.update(o.k_chosen)
    steps = sum(histogram.values())
    return {
        "method": method,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "rounds": rounds,
        "mean_accepted_length": (accepted / rounds) if rounds else None,
        "proposers": sorted({p for o in outs for p in o.proposers}),
        "mean_k": sum(k * n for k, n in histogram.items()) / steps if steps else None,
        "k_histogram": {str(k): n for k, n in sorted(histogram.items())},
    }


def engine_config(engine: dict | None) -> EngineConfig:
    """The EngineConfig of a serve config's `engine` mapping: no model is the embedded target and
    its head with speculation on; torch threads default to the replica's CPUs."""
    engine = with_embedded_defaults(engine or {})
    engine["num_threads"] = threads_for_replica(engine.get("num_threads"))
    return EngineConfig.from_kwargs(**engine)


def usage(outs: list[RequestOutput]) -> dict:
    """The prompt counted once (its samples share it), every choice's completion."""
    prompt, completion = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chunk_event(body: dict, obfuscate: bool = False) -> str:
    """A chunk's event; obfuscated: with random characters of random length, so the sizes of the
    events do not tell the lengths of the tokens (stream_options.include_obfuscation)."""
    if obfuscate:
        body = {**body, "obfuscation": secrets.token_urlsafe(secrets.randbelow(24) + 1)}
    return event(body)


def _tier(req) -> dict:
    """The service tier the response reports, where the request named one."""
    return {"service_tier": "default"} if req.service_tier is not None else {}


class OpenAIServing:
    """One engine and the OpenAI response bodies built from its outputs: the part of a replica
    both topologies share (the tokenizer lives here: logprobs' token strings, tool calls, echo)."""

    def __init__(self, engine: dict | None = None, served_model_name: str = "specserve-default",
                 max_waiting_requests: int = 64, max_n: int = 16, tool_call_format: str = "auto"):
        if tool_call_format != "auto":
            parser_for(tool_call_format)  # ValueError naming the formats
        bound_kernel_caches()  # before any model runs in this replica process
        config = engine_config(engine)
        self.engine = AsyncLLMEngine(config, max_waiting_requests=max_waiting_requests)
        self.config = self.engine.config
        self.model_name = served_model_name
        self.max_n = max_n
        self.token_texts = TokenTexts(self.engine.engine.tokenizer)  # logprobs' token strings
        found, self.template_renders_tools = format_of_template(getattr(self.engine.engine.tokenizer.hf, "chat_template", None))
        self.tool_parser = parser_for(found if tool_call_format == "auto" else tool_call_format)  # how `auto` calls are read
        self.created = int(time.time())
        self.metrics_buffer = BufferedRecorder()
        self.engine.step_observers.append(StepMetrics(self.metrics_buffer, served_model_name).on_step)
        self.exporter = RayMetricsExporter(self.metrics_buffer)
        self.test_hooks = os.environ.get("SPECSERVE_TEST_HOOKS") == "1"
        if self.test_hooks:  # fault injection for the reliability suite, never on by default
            self.engine.engine.fault_hook = inject_fault
        log.info("engine ready: model=%s draft=%s threads=%d", self.config.model, self.config.draft_model,
                 config.num_threads)

    # --- Serve hooks -------------------------------------------------------------------
    async def reconfigure(self, user_config: dict) -> None:
        """Applies speculation settings (SpecConfig's live fields, same names) between engine
        steps; streams keep going. A bad key or value raises ValueError naming it."""
        changes = dict(user_config or {})
        if changes:
            settings = await self.engine.call(lambda engine: engine.reconfigure_speculation(**changes))
            log.info("speculation reconfigured: %s", settings)

    async def check_health(self) -> None:
        self.engine.check_health()

    # --- bodies ------------------------------------------------------------------------
    def check_model(self, req) -> None:
        if req.model is not None and req.model not in (self.model_name, self.config.model):
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")

    def health_body(self) -> tuple[dict, int]:
        """(body, status) of /health."""
        if not self.engine.is_alive:
            return {"status": "unhealthy", "error": self.engine.fatal_error}, 503
        engine = self.engine.engine
        calibration = engine.speculation.planner.calibration if engine.speculation is not None else None
        return {"status": "ok", "startup_s": engine.startup,  # each start-up phase (the engine is built before Serve routes here)
                "calibration_pending": list(calibration.pending) if calibration is not None else []}, 200

    def models_body(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specserve", "root": self.config.model}]}

    async def stats_body(self) -> dict:
        out = await self.engine.call(lambda engine: engine.stats())
        out["prefix_cache"] = self.engine.prefix_cache_stats()
        out["exported_counter_totals"] = dict(self.exporter.totals)
        out["replica"] = replica_id()
        out["node_id"] = node_id()
        out["pid"] = os.getpid()
        out["rss_bytes"] = rss_bytes()
        return out

    @property
    def _spec_method(self) -> str | None:
        settings = self.config.speculative
        return settings.speculative_method if settings.use_speculative_decoding else None

    async def _start(self, req, prompt, default_max_tokens):
        request_id = None
        if self.test_hooks and req.user in (FAULT_USER, DEVICE_FAULT_USER):
            request_id = f"{FAULT_PREFIX if req.user == FAULT_USER else DEVICE_FAULT_PREFIX}{uuid.uuid4().hex}"
        try:
            params = req.sampling_params(default_max_tokens)
            if req.n > self.max_n:
                raise APIError(400, f"n: at most {self.max_n} choices per request (max_n), got {req.n}", param="n",
                               code="invalid_value")
            # each choice its own seeded stream: seed + i when a seed is given
            samples = [params if i == 0 else dataclasses.replace(
                params, seed=None if params.seed is None else (params.seed + i) % 2**63) for i in range(req.n)]
            return await self.engine.add_samples(prompt, samples, request_id=request_id)
        except GrammarError as exc:
            raise APIError(400, f"{req.grammar_param}: {exc}", param=req.grammar_param, code="invalid_value") from None
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        except EngineOverloadedError as exc:
            raise APIError(429, f"server overloaded: {exc}", code="overloaded") from None
        except EngineDeadError as exc:
            raise APIError(503, f"engine unavailable: {exc}", code="engine_dead") from None

    def _default_chat_max_tokens(self) -> int:
        return max(1, min(self.config.max_seq_len // 2, 512))

    async def completion(self, req: CompletionRequest) -> dict | AsyncIterator[str]:
        """A completion's response body, or (stream) its server-sent events; raises APIError."""
        self.check_model(req)
        streams = await self._start(req, req.prompt, 16)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name, **_tier(req)}

        def choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        if req.stream:
            offsets = [0] * len(streams)  # characters streamed so far per choice: text_offset continues there

            def chunk_choice(index: int, d: StreamDelta) -> dict:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(self.token_texts, d.logprobs, offsets[index])
                offsets[index] += len(d.text)
                return choice(index, d.text, d.finish_reason if d.finished else None, logprobs)

            return self._events(streams, base, chunk_choice, req)
        outs = await self._collect_all(streams)
        choices = []
        for index, out in enumerate(outs):
            text, logprobs = out.text, None
            if req.logprobs is not None:
                logprobs = completion_logprobs(self.token_texts, out.logprobs or [])
            if req.echo:
                prompt = req.prompt if isinstance(req.prompt, str) else self.engine.engine.tokenizer.decode(req.prompt)
                text = prompt + text
                if logprobs is not None:
                    logprobs = join(prompt_completion_logprobs(self.token_texts, out.prompt_token_ids,
                                                               (out.prompt_logprobs or [None])[1:]), logprobs)
            choices.append(choice(index, text, out.finish_reason, logprobs))
        return {**base, "choices": choices, "usage": usage(outs), "speculation": speculation_stats(outs, self._spec_method)}

    async def chat(self, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
        """A chat completion's response body, or (stream) its server-sent events; raises APIError."""
        self.check_model(req)
        tool_set = req.tool_set
        messages, tools = render_messages([m.for_template() for m in req.messages], tool_set.tools,
                                          self.template_renders_tools)
        streams = await self._start(req, ChatPrompt(messages, tools), self._default_chat_max_tokens())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name, **_tier(req)}
        parsers = [self.tool_parser(tool_set) for _ in streams]  # text and tool calls

        if req.stream:
            chunk_base = {**base, "object": "chat.completion.chunk"}

            def chunk_choice(index: int, d: StreamDelta) -> dict:
                return {"index": index, "delta": parsers[index].delta(d.text, d.finished),
                        "logprobs": chat_logprobs(self.token_texts, d.logprobs) if req.logprobs else None,
                        "finish_reason": parsers[index].finish_reason(d.finish_reason) if d.finished else None}

            first = {**chunk_base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None} for i in range(len(streams))]}
            return self._events(streams, chunk_base, chunk_choice, req, first=first)
        outs = await self._collect_all(streams)
        choices = []
        for i, out in enumerate(outs):
            choices.append({"index": i, "message": parsers[i].message(out.text),
                            "logprobs": chat_logprobs(self.token_texts, out.logprobs or []) if req.logprobs else None,
                            "finish_reason": parsers[i].finish_reason(out.finish_reason)})
        return {**base, "choices": choices, "usage": usage(outs),
                "speculation": speculation_stats(outs, self._spec_method)}

    # --- response bodies ---------------------------------------------------------------
    async def _collect(self, stream) -> RequestOutput:
        try:
            async for delta in stream:
                if delta.finished:
                    if delta.finish_reason == "error":
                        raise APIError(500, f"generation failed: {delta.output.error if delta.output else ''}")
                    return delta.output
        except EngineDeadError as exc:
            raise APIError(503, f"engine unavailable: {exc}", code="engine_dead") from None
        finally:
            await stream.aclose()
        raise APIError(500, "stream ended without a final output")

    async def _collect_all(self, streams: list) -> list[RequestOutput]:
        """Every choice's final output; the first failure is raised once all have ended."""
        results = await asyncio.gather(*(self._collect(s) for s in streams), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    def _events(self, streams: list, base: dict, make_choice, req, first: dict | None = None) -> AsyncIterator[str]:
        """Server-sent events over the choices' streams, interleaved as their deltas come:
        make_choice(index, delta); the speculation stats (and the usage, when asked) after the last;
        each chunk padded with `obfuscation` when asked."""
        include_usage = req.include_usage
        emit = functools.partial(chunk_event, obfuscate=req.obfuscate)

        async def events() -> AsyncIterator[str]:
            outs: list[RequestOutput | None] = [None] * len(streams)
            deltas = interleaved(streams)
            try:
                if first is not None:
                    yield emit(first)
                async for index, delta in deltas:
                    if delta.finished and delta.finish_reason == "error":
                        err = APIError(500, f"generation failed: {delta.output.error if delta.output else ''}")
                        yield emit(err.body())
                        break
                    if delta.finished:
                        outs[index] = delta.output
                    elif not delta.text and not delta.logprobs:
                        continue  # nothing to say yet (e.g. half a UTF-8 character held back)
                    chunk = {**base, "choices": [make_choice(index, delta)]}
                    if all(o is not None for o in outs):  # the last choice ended: the stats go with it
                        done = [o for o in outs if o is not None]
                        stats = speculation_stats(done, self._spec_method)
                        if include_usage:
                            yield emit(chunk)
                            chunk = {**base, "choices": [], "usage": usage(done), "speculation": stats}
                        else:
                            chunk["speculation"] = stats
                    yield emit(chunk)
            except EngineDeadError as exc:
                yield emit(APIError(503, f"engine unavailable: {exc}").body())
            finally:
                await deltas.aclose()  # a client gone or an error: every choice's request is aborted
            yield DONE

        return events()
