"""The Ray Serve layer: OpenAI-compatible HTTP ingress over the engine (`serve run serve_config.yaml`)."""
