"""The documentation's pages and their Python examples, for the docs tests.

An example is a ```python block in README.md or docs/. A comment line `<!-- example: KIND -->`
right above it says what it needs: `server` (a running `serve run`: tests/e2e/test_docs_examples.py
runs it against the suite's server) or `gpu` (a CUDA device: skipped without one). Blocks without
a marker run in-process, the blocks of one page in order in one namespace.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KINDS = {"local", "server", "gpu"}
BLOCK = re.compile(r"(?:^<!-- example: (?P<kind>[\w-]+) -->\n)?^```python[^\n]*\n(?P<code>.*?)^```", re.S | re.M)


@dataclass
class Example:
    page: str
    line: int
    kind: str
    code: str


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def examples(page: Path) -> list[Example]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in BLOCK.finditer(text):
        kind = m.group("kind") or "local"
        out.append(Example(page.relative_to(REPO).as_posix(), text.count("\n", 0, m.start("code")) + 1, kind,
                           m.group("code")))
    return out


def hooks():
    """docs/hooks.py, the generator of the reference pages."""
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._on_path()
    return module


def run(blocks: list[Example], replace: dict[str, str] | None = None) -> None:
    """Runs one page's examples in order in one module (pydantic and dataclasses look their
    annotations up in the module); each must print something. AssertionError names the block."""
    module = types.ModuleType("docs_example")
    sys.modules[module.__name__] = module
    try:
        for e in blocks:
            code = e.code
            for old, new in (replace or {}).items():
                code = code.replace(old, new)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    exec(compile(code, f"{e.page}:{e.line}", "exec"), module.__dict__)
                except Exception as exc:
                    raise AssertionError(f"{e.page}:{e.line}: the example raised {exc!r}\n{e.code}") from exc
            assert out.getvalue().strip(), f"{e.page}:{e.line}: the example printed nothing"
    finally:
        del sys.modules[module.__name__]
