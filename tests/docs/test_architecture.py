"""What docs/architecture.md and docs/contributing.md name exists: every path (a file or folder,
matched by its tail against the repository's), every `Class.member` and `module.function`, and
every class they name alone; every engine package appears on the architecture page."""

from __future__ import annotations

import ast
import builtins
import re
from functools import cache
from pathlib import Path

from tests.helpers import REPO

PAGES = ("docs/architecture.md", "docs/contributing.md")
CODE = ("engine", "serve_app", "bench", "tools", "tests", "dashboards")
PATH = re.compile(r"^[\w./-]+(/|\.(py|md|yaml|json|c|h))$")
MEMBER = re.compile(r"^([A-Za-z_]\w*)\.(\w+)$")  # Class.member or module.function
CLASS = re.compile(r"^[A-Z][a-z]\w*$")  # a CamelCase name alone


def spans(text: str) -> set[str]:
    """The code spans of a page, its fenced blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {s.strip() for s in re.findall(r"`([^`\n]+)`", text)}


@cache
def tree() -> tuple[frozenset[str], frozenset[str]]:
    """(every file's repository path, every folder's, each ending in '/')."""
    files = {p.relative_to(REPO).as_posix() for d in CODE + ("docs", "models") for p in (REPO / d).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    files |= {p.name for p in REPO.iterdir() if p.is_file()}
    folders = {f.rsplit("/", i)[0] + "/" for f in files for i in range(1, f.count("/") + 1)}
    return frozenset(files), frozenset(folders)


@cache
def definitions() -> dict[str, set[str]]:
    """Class or module name -> the names defined in it (methods, attributes, functions)."""
    out: dict[str, set[str]] = {}
    for package in CODE:
        for path in (REPO / package).rglob("*.py"):
            body = ast.parse(path.read_text()).body
            out.setdefault(path.stem, set()).update(_names(body))
            for node in ast.walk(ast.Module(body=body, type_ignores=[])):
                if isinstance(node, ast.ClassDef):
                    out.setdefault(node.name, set()).update(_names(node.body))
    return out


def _names(body: list[ast.stmt]) -> set[str]:
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def missing(text: str) -> list[str]:
    """The code spans of `text` that name a path, member or class the repository lacks."""
    files, folders = tree()
    defs = definitions()
    out = []
    for span in sorted(spans(text)):
        if PATH.match(span):
            pool = folders if span.endswith("/") else files
            if not any(p == span or p.endswith("/" + span) for p in pool):
                out.append(span)
        elif (m := MEMBER.match(span)) and not span.endswith((".py", ".md")):
            owner, member = m.groups()
            if owner in defs and member not in defs[owner] or owner[0].isupper() and owner not in defs:
                out.append(span)
        elif CLASS.match(span) and span not in defs and not hasattr(builtins, span):
            out.append(span)
    return out


def engine_packages() -> list[str]:
    return sorted(p.parent.relative_to(REPO / "engine").as_posix() for p in (REPO / "engine").rglob("__init__.py")
                  if p.parent != REPO / "engine")


def absent_packages(text: str) -> list[str]:
    """Engine packages (their path below engine/) the page never names as a folder or a path in one."""
    named = " ".join(spans(text)) + " " + " ".join(re.findall(r"\*\*([^*]+)\*\*", text))
    return [p for p in engine_packages() if not re.search(rf"(^|[\s`/]){re.escape(p.rsplit('/', 1)[-1])}/", named)]


def test_every_name_on_the_pages_exists():
    for page in PAGES:
        assert not missing((REPO / page).read_text()), f"{page} names what the code lacks"


def test_every_engine_package_is_on_the_architecture_page():
    assert not absent_packages((REPO / "docs/architecture.md").read_text())


def test_the_checks_have_teeth():
    assert missing("`kv/manager.py` `engine/model/moe.py` `KVManager.rollback` `AsyncLLMEngine.add_prompt`"
                   " `RoundPlanner` `NoSuchPlanner` `ValueError` `http_app.parse_request` `http_app.no_such`") \
        == ["AsyncLLMEngine.add_prompt", "NoSuchPlanner", "engine/model/moe.py", "http_app.no_such"]
    assert "model/quant" in absent_packages("**kv/** and `model/kernels/`, `speculative/verify/chain.py`")
    assert "model/kernels" not in absent_packages("`model/kernels/`")
    assert Path(REPO / "engine/model/quant/__init__.py").exists() and "model/quant" in engine_packages()
