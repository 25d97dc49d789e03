"""The Ray Serve deployments of the two topologies (server.py's docstring): `single`, LLMServer
serving HTTP and holding the engine; `ingress`, OpenAIIngress (HTTP, no model) calling the engine
deployment EngineServer through a handle with a typed request."""

# no `from __future__ import annotations`: FastAPI reads the route handlers' annotations (Request) as objects
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from ray import serve

from serve_app.errors import APIError
from serve_app.http_app import DONE, app, authorize, ingress_app, parse_request, respond, sse
from serve_app.openai_serving import OpenAIServing
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.stream_batching import coalesce

log = logging.getLogger("ray.serve")  # configured by Serve in replicas


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
        return respond(await self.completion(await parse_request(request, CompletionRequest, self.api_key)))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """OpenAI chat completions: the messages through the checkpoint's chat template, streamed as server-sent events or not; the `speculation` stats in the response or the last chunk."""
        return respond(await self.chat(await parse_request(request, ChatCompletionRequest, self.api_key)))


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
                yield event(APIError(503, f"engine unavailable mid-stream: {type(exc).__name__}: {str(exc)[:300]}",
                                      code="engine_unavailable").body())
                yield DONE
            finally:
                if not ended:  # the client went away: the engine aborts the request
                    gen.cancel()

        return sse(events())

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
