"""The documentation's examples that talk to a server (marked `<!-- example: server -->`, see
tests/docs/pages.py) run against the suite's real `serve run serve_config.yaml`: its address in
place of 127.0.0.1:8000, its API key in SPECSERVE_API_KEY."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.docs.pages import REPO, examples, pages
from tests.serve_fixture import API_KEY

SERVER = [(p, [e for e in examples(p) if e.kind == "server"]) for p in pages()]


@pytest.mark.parametrize("page,blocks", [(p, b) for p, b in SERVER if b],
                         ids=[p.relative_to(REPO).as_posix() for p, b in SERVER if b])
def test_server_examples_run(server, monkeypatch, page, blocks):
    monkeypatch.setenv("SPECSERVE_API_KEY", API_KEY)
    namespace: dict = {"__name__": "__docs_example__"}
    for e in blocks:
        assert "http://127.0.0.1:8000" in e.code, f"{e.page}:{e.line}: a server example names the default address"
        code = e.code.replace("http://127.0.0.1:8000", server.url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                exec(compile(code, f"{e.page}:{e.line}", "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"{e.page}:{e.line}: the example raised {exc!r}\n{e.code}")
        assert out.getvalue().strip(), f"{e.page}:{e.line}: the example printed nothing"
