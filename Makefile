# Two commands on a fresh machine:  `make serve` (the main job)  and  `make test`.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install serve generate test lint

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

# The main job: the engine on the embedded default pair.
serve: $(STAMP)
	$(VENV)/bin/python -m engine.cli

generate: serve

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
