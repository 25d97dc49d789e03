"""The engine deployment with its OpenAI-compatible FastAPI ingress.

One deployment, not two: each replica holds the target + draft models, both KV pools and the
engine loop (on its own thread, see AsyncLLMEngine), and serves HTTP itself. Tokens then flow
from the engine thread to the replica's event loop to Serve's proxy with no extra hop, which
matters on a 2-core machine where every process and serialisation costs decode time;
autoscaling adds whole engines, which is what a busy service needs. The proxy routes each
request to a replica below `max_ongoing_requests` and queues up to `max_queued_requests`.
"""


import hmac
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator

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

log = logging.getLogger("ray.serve")  # configured by Serve in replicas

MAX_BODY_BYTES = 1 << 20  # 1 MiB

app = FastAPI(title="specserve", description="OpenAI-compatible API with lossless speculative decoding")


@app.exception_handler(RequestValidationError)
async def _validation_handler(_request, exc: RequestValidationError):
    return from_validation_errors(exc.errors()).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error_handler(_request, exc: StarletteHTTPException):
    return APIError(exc.status_code, str(exc.detail)).response()


@app.exception_handler(APIError)
async def _api_error_handler(_request, exc: APIError):
    return exc.response()


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


def speculation_stats(out: RequestOutput, method: str | None) -> dict:
    rounds = out.num_spec_rounds
    return {
        "method": method,
        "acceptance_rate": out.acceptance_rate,
        "draft_tokens": out.num_draft_tokens,
        "accepted_tokens": out.num_accepted_tokens,
        "rounds": rounds,
        "mean_accepted_length": (out.num_accepted_tokens / rounds) if rounds else None,
        "proposers": out.proposers,
    }


def usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
            "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}


@serve.deployment(name="LLMServer")
@serve.ingress(app)
class LLMServer:
    def __init__(self, engine: dict | None = None, served_model_name: str = "specserve-default",
                 api_key_env: str = "SPECSERVE_API_KEY", max_waiting_requests: int = 64):
        bound_kernel_caches()  # before any model runs in this replica process
        engine = with_embedded_defaults(engine or {})  # no model: the embedded target and its head, speculation on
        engine["num_threads"] = _threads_for_replica(engine.get("num_threads"))
        config = EngineConfig.from_kwargs(**engine)
        self.engine = AsyncLLMEngine(config, max_waiting_requests=max_waiting_requests)
        self.config = self.engine.config
        self.model_name = served_model_name
        self.token_texts = TokenTexts(self.engine.engine.tokenizer)  # logprobs' token strings
        self.api_key = os.environ.get(api_key_env) or None
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

    # --- helpers -----------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def _parse(self, request: Request, schema):
        self._authorize(request)
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
            req = schema.model_validate(obj)
        except ValidationError as exc:
            raise from_validation_errors(exc.errors()) from None
        except RecursionError:
            raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
        if req.model is not None and req.model not in (self.model_name, self.config.model):
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")
        return req

    @property
    def _spec_method(self) -> str | None:
        settings = self.config.speculative
        return settings.speculative_method if settings.use_speculative_decoding else None

    async def _start(self, req, prompt, chat, default_max_tokens):
        request_id = None
        if self.test_hooks and req.user in (FAULT_USER, DEVICE_FAULT_USER):
            request_id = f"{FAULT_PREFIX if req.user == FAULT_USER else DEVICE_FAULT_PREFIX}{uuid.uuid4().hex}"
        try:
            params = req.sampling_params(default_max_tokens)
            return await self.engine.add(prompt, params, request_id=request_id, chat=chat)
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

    # --- routes ------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        """Liveness and start-up: `{"status": "ok", "startup_s", "calibration_pending"}`, or 503 once the engine loop has died. Needs no API key."""
        if not self.engine.is_alive:
            return JSONResponse({"status": "unhealthy", "error": self.engine.fatal_error}, status_code=503)
        engine = self.engine.engine
        calibration = engine.speculation.calibration if engine.speculation is not None else None
        return {"status": "ok", "startup_s": engine.startup,  # each start-up phase (the engine is built before Serve routes here)
                "calibration_pending": list(calibration.pending) if calibration is not None else []}

    @app.get("/v1/models")
    async def models(self, request: Request):
        """OpenAI's model list: the one model served, its name and checkpoint path (`root`)."""
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specserve", "root": self.config.model}]}

    @app.get("/v1/engine/stats")
    async def engine_stats(self, request: Request):
        """Engine state: running and waiting requests, KV slots and blocks in use, preemptions, the speculation settings, the forward plan, start-up phases, the replica's id and memory."""
        self._authorize(request)
        out = await self.engine.call(lambda engine: engine.stats())
        out["exported_counter_totals"] = dict(self.exporter.totals)
        out["replica"] = _replica_id()
        out["pid"] = os.getpid()
        out["rss_bytes"] = _rss_bytes()
        return out

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        """OpenAI completions: one prompt (text or token ids), streamed as server-sent events or not; the `speculation` stats in the response or the last chunk."""
        req = await self._parse(request, CompletionRequest)
        stream = await self._start(req, req.prompt, None, 16)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}

        def choice(text: str, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

        if req.stream:
            offset = [0]  # characters streamed so far: each chunk's text_offset continues from there

            def chunk_choice(d: StreamDelta) -> dict:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(self.token_texts, d.logprobs, offset[0])
                offset[0] += len(d.text)
                return choice(d.text, d.finish_reason if d.finished else None, logprobs)

            return self._sse(stream, base, chunk_choice, req.include_usage)
        out = await self._collect(stream)
        text, logprobs = out.text, None
        if req.logprobs is not None:
            logprobs = completion_logprobs(self.token_texts, out.logprobs or [])
        if req.echo:
            prompt = req.prompt if isinstance(req.prompt, str) else self.engine.engine.tokenizer.decode(req.prompt)
            text = prompt + text
            if logprobs is not None:
                logprobs = join(prompt_completion_logprobs(self.token_texts, out.prompt_token_ids,
                                                           (out.prompt_logprobs or [None])[1:]), logprobs)
        return {**base, "choices": [choice(text, out.finish_reason, logprobs)], "usage": usage(out),
                "speculation": speculation_stats(out, self._spec_method)}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """OpenAI chat completions: the messages through the checkpoint's chat template, streamed as server-sent events or not; the `speculation` stats in the response or the last chunk."""
        req = await self._parse(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        stream = await self._start(req, None, messages, self._default_chat_max_tokens())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        if req.stream:
            chunk_base = {**base, "object": "chat.completion.chunk"}

            def chunk_choice(d: StreamDelta) -> dict:
                return {"index": 0, "delta": {"content": d.text} if d.text else {},
                        "logprobs": chat_logprobs(self.token_texts, d.logprobs) if req.logprobs else None,
                        "finish_reason": d.finish_reason if d.finished else None}

            first = {**chunk_base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None}]}
            return self._sse(stream, chunk_base, chunk_choice, req.include_usage, first=first)
        out = await self._collect(stream)
        return {**base, "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                                     "logprobs": chat_logprobs(self.token_texts, out.logprobs or [])
                                     if req.logprobs else None,
                                     "finish_reason": out.finish_reason}],
                "usage": usage(out), "speculation": speculation_stats(out, self._spec_method)}

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

    def _sse(self, stream, base: dict, make_choice, include_usage: bool, first: dict | None = None):
        async def events() -> AsyncIterator[str]:
            try:
                if first is not None:
                    yield f"data: {json.dumps(first)}\n\n"
                async for delta in stream:
                    if delta.finished and delta.finish_reason == "error":
                        err = APIError(500, f"generation failed: {delta.output.error if delta.output else ''}")
                        yield f"data: {json.dumps(err.body())}\n\n"
                        break
                    chunk = {**base, "choices": [make_choice(delta)]}
                    if delta.finished:
                        out = delta.output
                        stats = speculation_stats(out, self._spec_method)
                        if include_usage:
                            yield f"data: {json.dumps(chunk)}\n\n"
                            chunk = {**base, "choices": [], "usage": usage(out), "speculation": stats}
                        else:
                            chunk["speculation"] = stats
                    if not delta.finished and not delta.text and not delta.logprobs:
                        continue  # nothing to say yet (e.g. half a UTF-8 character held back)
                    yield f"data: {json.dumps(chunk)}\n\n"
            except EngineDeadError as exc:
                yield f"data: {json.dumps(APIError(503, f'engine unavailable: {exc}').body())}\n\n"
            finally:
                await stream.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_app(args: dict | None = None):
    """Serve application builder (`import_path: serve_app.server:build_app`)."""
    args = dict(args or {})
    return LLMServer.bind(**args)
