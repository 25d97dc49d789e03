"""The documentation's examples that talk to a server (marked `<!-- example: server -->`, see
tests/docs/pages.py) run against the suite's real `serve run serve_config.yaml`: its address in
place of 127.0.0.1:8000, its API key in SPECSERVE_API_KEY."""

from __future__ import annotations

import pytest

from tests.docs.pages import REPO, examples, pages, run
from tests.serve_fixture import API_KEY

SERVER = [(p, [e for e in examples(p) if e.kind == "server"]) for p in pages()]


@pytest.mark.parametrize("page,blocks", [(p, b) for p, b in SERVER if b],
                         ids=[p.relative_to(REPO).as_posix() for p, b in SERVER if b])
def test_server_examples_run(server, monkeypatch, page, blocks):
    monkeypatch.setenv("SPECSERVE_API_KEY", API_KEY)
    for e in blocks:
        assert "http://127.0.0.1:8000" in e.code, f"{e.page}:{e.line}: a server example names the default address"
    run(blocks, {"http://127.0.0.1:8000": server.url})
