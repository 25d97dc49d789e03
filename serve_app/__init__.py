"""Entry points over the engine: the Ray Serve application (OpenAI-compatible HTTP, `serve run
serve_config.yaml`) and the command line (`python -m serve_app.cli`, no Ray)."""
