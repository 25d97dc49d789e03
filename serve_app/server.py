"""The engine deployment and its OpenAI-compatible FastAPI ingress, in two topologies.

`single` (serve_config.yaml, the default): one deployment, LLMServer. Each replica holds the
target + draft models, both KV pools and the engine loop (on its own thread, see AsyncLLMEngine),
and serves HTTP itself. Tokens then flow from the engine thread to the replica's event loop to
Serve's proxy with no extra hop, which matters on a 2-core machine where every process and
serialisation costs decode time; autoscaling adds whole engines. The proxy routes each request
to a replica below `max_ongoing_requests` (by queue length: it routes raw HTTP before the body
is read) and queues up to `max_queued_requests`.

`ingress` (serve_config.ingress.yaml): an OpenAIIngress deployment (HTTP, API key, JSON and
schema validation; no tokenizer, no model) calls the engine deployment, LLMServer, through a
deployment handle with a typed request: CompletionCall (`prompt`) or ChatCall (`messages`). The
engine answers with a Reply, then (streaming) the server-sent events one by one through the
handle. Because the handle's router sees the prompt, the engine deployment can use a
prefix-aware router (`request_router_config`, Ray's PrefixCacheAffinityRouter): a conversation's
next turn and a shared system prompt go to the replica whose prefix cache holds them.
"""


import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import EngineConfig, with_embedded_defaults
from engine.grammar import GrammarError
from engine.metrics import StepMetrics
from engine.request import RequestOutput
from serve_app.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, StreamDelta
from serve_app.errors import APIError, from_validation_errors
from serve_app.kernel_caches import bound_kernel_caches
from serve_app.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs, join, prompt_completion_logprobs
from serve_app.metrics import BufferedRecorder, RayMetricsExporter
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.stream_batching import coalesce
from serve_app.tools import FORMATS, ToolCallReader, render_messages, tool_format

log = logging.getLogger("ray.serve")  # configured by Serve in replicas

MAX_BODY_BYTES = 1 << 20  # 1 MiB



async def _validation_handler(_request, exc: RequestValidationError):
    return from_validation_errors(exc.errors()).response()


async def _http_error_handler(_request, exc: StarletteHTTPException):
    return APIError(exc.status_code, str(exc.detail)).response()


async def _api_error_handler(_request, exc: APIError):
    return exc.response()


def _openai_app() -> FastAPI:
    """A FastAPI app whose errors are OpenAI-shaped."""
    out = FastAPI(title="specserve", description="OpenAI-compatible API with lossless speculative decoding")
    out.add_exception_handler(RequestValidationError, _validation_handler)
    out.add_exception_handler(StarletteHTTPException, _http_error_handler)
    out.add_exception_handler(APIError, _api_error_handler)
    return out


app = _openai_app()  # the single deployment's routes (LLMServer)
ingress_app = _openai_app()  # the ingress topology's routes (OpenAIIngress)


FAULT_USER = "specserve-test-fault"  # with SPECSERVE_TEST_HOOKS=1: this request fails mid-generation
FAULT_PREFIX = "fault-"
DEVICE_FAULT_USER = "specserve-test-device-fault"  # ... this one raises a (simulated) sticky CUDA error
DEVICE_FAULT_PREFIX = "devicefault-"


def _inject_fault(request) -> None:
    if request.request_id.startswith(FAULT_PREFIX) and len(request.output_token_ids) >= 2:
        raise RuntimeError("injected fault (SPECSERVE_TEST_HOOKS)")
    if request.request_id.startswith(DEVICE_FAULT_PREFIX) and len(request.output_token_ids) >= 2:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected, SPECSERVE_TEST_HOOKS)")


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "unknown"


def _rss_bytes() -> int:
    """Resident memory of this replica process (Linux /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _threads_for_replica(requested: int | None) -> int:
    """Torch threads = the CPUs Ray assigned to this replica (rounded up), unless set."""
    if requested:
        return requested
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    except Exception:
        cpus = 1.0
    return max(1, math.ceil(cpus))


def speculation_stats(outs: list[RequestOutput], method: str | None) -> dict:
    """The extension field: speculation over the request's choices, summed."""
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    rounds = sum(o.num_spec_rounds for o in outs)
    return {
        "method": method,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "rounds": rounds,
        "mean_accepted_length": (accepted / rounds) if rounds else None,
        "proposers": sorted({p for o in outs for p in o.proposers}),
    }


def engine_config(engine: dict | None) -> EngineConfig:
    """The EngineConfig of a serve config's `engine` mapping: no model is the embedded target and
    its head with speculation on; torch threads default to the replica's CPUs."""
    engine = with_embedded_defaults(engine or {})
    engine["num_threads"] = _threads_for_replica(engine.get("num_threads"))
    return EngineConfig.from_kwargs(**engine)


def usage(outs: list[RequestOutput]) -> dict:
    """The prompt counted once (its samples share it), every choice's completion."""
    prompt, completion = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def authorize(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (no key configured: open)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key")


async def parse_request(request: Request, schema, api_key: str | None):
    """The authorised, size-checked, JSON-parsed and schema-validated request body (no tokenizer)."""
    authorize(request, api_key)
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(obj)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _chunk_event(body: dict, obfuscate: bool = False) -> str:
    """A chunk's event; obfuscated: with random characters of random length, so the sizes of the
    events do not tell the lengths of the tokens (stream_options.include_obfuscation)."""
    if obfuscate:
        body = {**body, "obfuscation": secrets.token_urlsafe(secrets.randbelow(24) + 1)}
    return _event(body)


def _tier(req) -> dict:
    """The service tier the response reports, where the request named one."""
    return {"service_tier": "default"} if req.service_tier is not None else {}


class OpenAIServing:
    """One engine and the OpenAI response bodies built from its outputs: the part of a replica
    both topologies share (the tokenizer lives here: logprobs' token strings, tool calls, echo)."""

    def __init__(self, engine: dict | None = None, served_model_name: str = "specserve-default",
                 max_waiting_requests: int = 64, max_n: int = 16, tool_call_format: str = "auto"):
        if tool_call_format not in ("auto", *FORMATS):
            raise ValueError(f"tool_call_format must be 'auto' or one of {list(FORMATS)}, got {tool_call_format!r}")
        bound_kernel_caches()  # before any model runs in this replica process
        config = engine_config(engine)
        self.engine = AsyncLLMEngine(config, max_waiting_requests=max_waiting_requests)
        self.config = self.engine.config
        self.model_name = served_model_name
        self.max_n = max_n
        self.token_texts = TokenTexts(self.engine.engine.tokenizer)  # logprobs' token strings
        found, self.template_renders_tools = tool_format(getattr(self.engine.engine.tokenizer.hf, "chat_template", None))
        self.tool_format = found if tool_call_format == "auto" else tool_call_format  # how `auto` calls are read
        self.created = int(time.time())
        self.metrics_buffer = BufferedRecorder()
        self.engine.step_observers.append(StepMetrics(self.metrics_buffer, served_model_name).on_step)
        self.exporter = RayMetricsExporter(self.metrics_buffer)
        self.test_hooks = os.environ.get("SPECSERVE_TEST_HOOKS") == "1"
        if self.test_hooks:  # fault injection for the reliability suite, never on by default
            self.engine.engine.fault_hook = _inject_fault
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
        calibration = engine.speculation.calibration if engine.speculation is not None else None
        return {"status": "ok", "startup_s": engine.startup,  # each start-up phase (the engine is built before Serve routes here)
                "calibration_pending": list(calibration.pending) if calibration is not None else []}, 200

    def models_body(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specserve", "root": self.config.model}]}

    async def stats_body(self) -> dict:
        out = await self.engine.call(lambda engine: engine.stats())
        out["prefix_cache"] = self.engine.prefix_cache_stats()
        out["exported_counter_totals"] = dict(self.exporter.totals)
        out["replica"] = _replica_id()
        out["node_id"] = _node_id()
        out["pid"] = os.getpid()
        out["rss_bytes"] = _rss_bytes()
        return out

    @property
    def _spec_method(self) -> str | None:
        settings = self.config.speculative
        return settings.speculative_method if settings.use_speculative_decoding else None

    async def _start(self, req, prompt, chat, default_max_tokens, tools=None):
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
            return await self.engine.add_samples(prompt, samples, request_id=request_id, chat=chat, tools=tools)
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
        streams = await self._start(req, req.prompt, None, 16)
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
        streams = await self._start(req, None, messages, self._default_chat_max_tokens(), tools)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name, **_tier(req)}
        readers = [ToolCallReader(tool_set, self.tool_format) for _ in streams]  # text and tool calls

        def finish_reason(index: int, reason: str | None) -> str | None:
            return "tool_calls" if reason == "stop" and readers[index].calls else reason

        if req.stream:
            chunk_base = {**base, "object": "chat.completion.chunk"}

            def chunk_choice(index: int, d: StreamDelta) -> dict:
                delta = readers[index].feed(d.text)
                if d.finished:
                    last = readers[index].finish()
                    if "content" in last:
                        delta["content"] = delta.get("content", "") + last["content"]
                    if "tool_calls" in last:
                        delta["tool_calls"] = delta.get("tool_calls", []) + last["tool_calls"]
                return {"index": index, "delta": delta,
                        "logprobs": chat_logprobs(self.token_texts, d.logprobs) if req.logprobs else None,
                        "finish_reason": finish_reason(index, d.finish_reason) if d.finished else None}

            first = {**chunk_base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None} for i in range(len(streams))]}
            return self._events(streams, chunk_base, chunk_choice, req, first=first)
        outs = await self._collect_all(streams)
        choices = []
        for i, out in enumerate(outs):
            reader = readers[i]
            reader.feed(out.text)
            reader.finish()
            message = {"role": "assistant", "content": reader.content}
            if reader.calls:
                message = {"role": "assistant", "content": reader.content or None, "tool_calls": reader.calls}
            choices.append({"index": i, "message": message,
                            "logprobs": chat_logprobs(self.token_texts, out.logprobs or []) if req.logprobs else None,
                            "finish_reason": finish_reason(i, out.finish_reason)})
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
        _event = functools.partial(_chunk_event, obfuscate=req.obfuscate)

        async def merged() -> AsyncIterator[tuple[int, StreamDelta]]:
            queue_: asyncio.Queue = asyncio.Queue()

            async def pump(index: int, stream) -> None:
                try:
                    async for delta in stream:
                        await queue_.put((index, delta))
                except BaseException as exc:  # an engine error reaches the client as an event
                    await queue_.put((index, exc))
                finally:
                    await queue_.put((index, None))

            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
            try:
                open_ = len(streams)
                while open_:
                    index, item = await queue_.get()
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

        async def events() -> AsyncIterator[str]:
            outs: list[RequestOutput | None] = [None] * len(streams)
            deltas = merged()
            try:
                if first is not None:
                    yield _event(first)
                async for index, delta in deltas:
                    if delta.finished and delta.finish_reason == "error":
                        err = APIError(500, f"generation failed: {delta.output.error if delta.output else ''}")
                        yield _event(err.body())
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
                            yield _event(chunk)
                            chunk = {**base, "choices": [], "usage": usage(done), "speculation": stats}
                        else:
                            chunk["speculation"] = stats
                    yield _event(chunk)
            except EngineDeadError as exc:
                yield _event(APIError(503, f"engine unavailable: {exc}").body())
            finally:
                await deltas.aclose()  # a client gone or an error: every choice's request is aborted
            yield DONE

        return events()


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def _respond(result: dict | AsyncIterator[str]):
    return result if isinstance(result, dict) else _sse(result)


# --- topology `single`: one deployment serves HTTP and holds the engine ---------------------
@serve.deployment(name="LLMServer")
@serve.ingress(app)
class LLMServer(OpenAIServing):
    def __init__(self, engine: dict | None = None, served_model_name: str = "specserve-default",
                 api_key_env: str = "SPECSERVE_API_KEY", max_waiting_requests: int = 64, max_n: int = 16,
                 tool_call_format: str = "auto"):
        super().__init__(engine, served_model_name, max_waiting_requests, max_n, tool_call_format)
        self.api_key = os.environ.get(api_key_env) or None

    @app.get("/health")
    async def health(self):
        """Liveness and start-up: `{"status": "ok", "startup_s", "calibration_pending"}`, or 503 once the engine loop has died. Needs no API key."""
        body, status = self.health_body()
        return body if status == 200 else JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models(self, request: Request):
        """OpenAI's model list: the one model served, its name and checkpoint path (`root`)."""
        authorize(request, self.api_key)
        return self.models_body()

    @app.get("/v1/engine/stats")
    async def engine_stats(self, request: Request):
        """Engine state: running and waiting requests, KV slots and blocks in use, the prefix cache's hit rate, preemptions, the speculation settings, the forward plan, start-up phases, the replica's id, node and memory."""
        authorize(request, self.api_key)
        return await self.stats_body()

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        """OpenAI completions: one prompt (text or token ids), streamed as server-sent events or not; the `speculation` stats in the response or the last chunk."""
        return _respond(await self.completion(await parse_request(request, CompletionRequest, self.api_key)))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """OpenAI chat completions: the messages through the checkpoint's chat template, streamed as server-sent events or not; the `speculation` stats in the response or the last chunk."""
        return _respond(await self.chat(await parse_request(request, ChatCompletionRequest, self.api_key)))


# --- topology `ingress`: OpenAIIngress -> handle -> the engine deployment ---------------------
STREAM_BATCHING_INTERVAL_MS = 50.0  # Ray Serve LLM's default; measured: docs/deployment/scale-out.md
@dataclass
class CompletionCall:
    """A validated completion request for the engine deployment. `prompt` is the prompt as text
    (token ids written as numbers): what a prefix-aware router matches replicas' history on."""
    request: CompletionRequest
    prompt: str

    @classmethod
    def of(cls, req: CompletionRequest) -> "CompletionCall":
        p = req.prompt
        return cls(req, p if isinstance(p, str) else " ".join(map(str, p)))


@dataclass
class ChatCall:
    """A validated chat request for the engine deployment. `messages` is the conversation as
    `{"role", "content"}` text (the role leads each content, so none is empty): what a
    prefix-aware router matches on; a conversation's next turn extends the previous one's."""
    request: ChatCompletionRequest
    messages: list[dict]

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> "ChatCall":
        return cls(req, [{"role": m.role, "content": f"<{m.role}>{m.text()}"} for m in req.messages])


@dataclass
class Reply:
    """The engine deployment's first item for a call: an error (status, body), a whole response
    body (200), or (200, None): the server-sent events follow, one string per item."""
    status: int
    body: dict | None


@serve.deployment(name="LLMServer")
class EngineServer(OpenAIServing):
    """The engine deployment of the `ingress` topology, called through a handle (no HTTP).
    `stream_batching_interval_ms`: after a stream's first event, the events of each interval go
    back as one item (serve_app/stream_batching.py); 0 sends every event alone."""

    def __init__(self, engine: dict | None = None, served_model_name: str = "specserve-default",
                 max_waiting_requests: int = 64, max_n: int = 16, tool_call_format: str = "auto",
                 stream_batching_interval_ms: float = STREAM_BATCHING_INTERVAL_MS):
        if (isinstance(stream_batching_interval_ms, bool) or not isinstance(stream_batching_interval_ms, (int, float))
                or not 0 <= stream_batching_interval_ms <= 1000):
            raise ValueError(f"stream_batching_interval_ms must be a number in [0, 1000], "
                             f"got {stream_batching_interval_ms!r}")
        super().__init__(engine, served_model_name, max_waiting_requests, max_n, tool_call_format)
        self.stream_batching_s = stream_batching_interval_ms / 1000

    async def generate(self, call: CompletionCall | ChatCall):
        """A streaming handle method: a Reply, then (streaming) the events. Cancelling the call
        (the client went away) aborts the request within one engine step."""
        try:
            result = await (self.completion(call.request) if isinstance(call, CompletionCall)
                            else self.chat(call.request))
        except APIError as exc:
            yield Reply(exc.status, exc.body())
            return
        if isinstance(result, dict):
            yield Reply(200, result)
            return
        yield Reply(200, None)
        async for chunk in coalesce(result, self.stream_batching_s):
            yield chunk

    async def health(self) -> tuple[dict, int]:
        return self.health_body()

    async def models(self) -> dict:
        return self.models_body()

    async def stats(self) -> dict:
        return await self.stats_body()


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


@serve.deployment(name="OpenAIIngress")
@serve.ingress(ingress_app)
class OpenAIIngress:
    """HTTP in front of the engine deployment: API key, body size, JSON and schema validation
    here (no tokenizer, no model); the engine's replica is chosen by the handle's router."""

    def __init__(self, engine, api_key_env: str = "SPECSERVE_API_KEY"):
        self.engine = engine  # DeploymentHandle of EngineServer
        self.streaming = engine.options(stream=True)
        self.api_key = os.environ.get(api_key_env) or None

    async def _call(self, call: CompletionCall | ChatCall):
        gen = self.streaming.generate.remote(call)
        try:
            first = await gen.__anext__()
        except Exception as exc:  # the replica died, or none is reachable
            gen.cancel()
            raise APIError(503, f"engine unavailable: {type(exc).__name__}: {str(exc)[:300]}",
                           code="engine_unavailable") from None
        if first.status != 200:
            return JSONResponse(first.body, status_code=first.status)
        if first.body is not None:
            return first.body

        async def events() -> AsyncIterator[str]:
            ended = False
            try:
                async for event in gen:
                    yield event
                ended = True
            except Exception as exc:  # the engine's replica (or its node) died mid-stream
                ended = True
                log.warning("stream from the engine deployment broke: %s", exc)
                yield _event(APIError(503, f"engine unavailable mid-stream: {type(exc).__name__}: {str(exc)[:300]}",
                                      code="engine_unavailable").body())
                yield DONE
            finally:
                if not ended:  # the client went away: the engine aborts the request
                    gen.cancel()

        return _sse(events())

    @ingress_app.get("/health")
    async def health(self):
        """Liveness of the engine deployment (one replica asked), as LLMServer's /health answers."""
        try:
            body, status = await self.engine.health.remote()
        except Exception as exc:
            body, status = {"status": "unhealthy", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}, 503
        return body if status == 200 else JSONResponse(body, status_code=status)

    @ingress_app.get("/v1/models")
    async def models(self, request: Request):
        """OpenAI's model list: the one model served, its name and checkpoint path (`root`)."""
        authorize(request, self.api_key)
        return await self.engine.models.remote()

    @ingress_app.get("/v1/engine/stats")
    async def engine_stats(self, request: Request):
        """One engine replica's state (as LLMServer's /v1/engine/stats)."""
        authorize(request, self.api_key)
        return await self.engine.stats.remote()

    @ingress_app.post("/v1/completions")
    async def completions(self, request: Request):
        """OpenAI completions, served by the engine deployment through the handle."""
        return await self._call(CompletionCall.of(await parse_request(request, CompletionRequest, self.api_key)))

    @ingress_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """OpenAI chat completions, served by the engine deployment through the handle."""
        return await self._call(ChatCall.of(await parse_request(request, ChatCompletionRequest, self.api_key)))


TOPOLOGIES = ("single", "ingress")


def build_app(args: dict | None = None):
    """Serve application builder (`import_path: serve_app.server:build_app`).

    `topology: single` (the default): LLMServer alone. `topology: ingress`: OpenAIIngress calling
    the engine deployment (named LLMServer too, so its settings keep their place in the config)
    through a handle; `api_key_env` goes to the ingress, the rest to the engine."""
    args = dict(args or {})
    topology = args.pop("topology", "single")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {list(TOPOLOGIES)}, got {topology!r}")
    if topology == "single":
        if "stream_batching_interval_ms" in args:
            raise ValueError("stream_batching_interval_ms applies to topology: ingress only (the engine "
                             "deployment's stream to the ingress)")
        return LLMServer.bind(**args)
    api_key_env = args.pop("api_key_env", "SPECSERVE_API_KEY")
    return OpenAIIngress.bind(EngineServer.bind(**args), api_key_env=api_key_env)
