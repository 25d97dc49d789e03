"""The Ray Serve application (`import_path: serve_app.server:build_app`, as every serve config
names it): the engine deployment and its OpenAI-compatible ingress, in two topologies
(deployments.py; the HTTP layer: http_app.py; the OpenAI bodies: openai_serving.py).

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

from __future__ import annotations

from serve_app.deployments import EngineServer, LLMServer, OpenAIIngress

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
