"""Ray's PrefixCacheAffinityRouter, importable without vLLM or SGLang.

Ray 2.60 publishes it as `ray.serve.llm.request_router.PrefixCacheAffinityRouter`, but importing
anything under `ray.serve.llm` runs that package's `__init__`, which needs vLLM or SGLang (the
protocol models of Ray's own LLM server) and fails here. The public class is an empty subclass of
the implementation below; this is that same subclass, reached without the package's `__init__`.
`request_router_config.request_router_class: serve_app.routing.PrefixCacheAffinityRouter`.
"""

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter as _PrefixCacheAffinityRouter,
)


class PrefixCacheAffinityRouter(_PrefixCacheAffinityRouter):
    """Routes a request to the replica that served the longest prefix of its `prompt` (or
    `messages`) while the replicas' queues differ by at most `imbalanced_threshold`; by power of
    two choices otherwise. Thresholds: `request_router_config.request_router_kwargs`."""
