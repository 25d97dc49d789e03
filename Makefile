# Two commands on a fresh machine:  `make serve` (the main job)  and  `make test`.  `make docs`: the documentation site.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install serve generate test lint docs

$(STAMP): pyproject.toml
	command -v prometheus >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[serve,test,bench]'
	touch $(STAMP)

install: $(STAMP)

# The main job: the OpenAI-compatible server on the embedded default pair (Ray Serve).
serve: $(STAMP)
	RAY_USAGE_STATS_ENABLED=0 $(VENV)/bin/serve run serve_config.yaml

# The engine in-process, no Ray: a few completions on the embedded pair.
generate: $(STAMP)
	$(VENV)/bin/python -m serve_app.cli

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=30 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The documentation site on http://127.0.0.1:8001, rebuilt on every edit (8000 is the server's port).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --no-strict --dev-addr 127.0.0.1:8001  # strict: mkdocs build (tests/docs)
