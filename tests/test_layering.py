"""The floors of docs/architecture.md, enforced: every import in engine/, serve_app/ and bench/ (inside
functions and under TYPE_CHECKING too; `from pkg import submodule` counts as the submodule) goes to
the importer's own floor or any floor below it, unless listed by name in ALLOWED, and no import cycle
exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import REPO

PACKAGES = ("engine", "serve_app", "bench")
ALLOWED: set[tuple[str, str]] = set()  # (importer, imported) that may run up a floor: keep it short


def floors() -> dict[str, int]:
    """Module prefix -> floor, from the fenced list in docs/architecture.md."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layers:start -->")[1].split("<!-- layers:end -->")[0]
    out = {}
    for line in block.splitlines():
        m = re.match(r"\s*(\d+)\.\s+(.+)", line)
        if m:
            out.update(dict.fromkeys(m.group(2).split(), int(m.group(1))))
    return out


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known}


def floor_of(module: str, table: dict[str, int]) -> int | None:
    while module:
        if module in table:
            return table[module]
        module = module.rpartition(".")[0]
    return None


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_every_module_has_a_floor():
    table = floors()
    missing = [m for m in modules() if floor_of(m, table) is None]
    assert not missing, f"modules on no floor of docs/architecture.md: {missing}"


def up_imports(deps: dict[str, set[str]], table: dict[str, int]) -> list[tuple]:
    return sorted((a, b, floor_of(a, table), floor_of(b, table)) for a, bs in deps.items() for b in bs
                  if floor_of(b, table) > floor_of(a, table) and (a, b) not in ALLOWED)


def find_cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(deps.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(deps):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_runs_up_a_floor():
    up = up_imports(graph(), floors())
    assert not up, "imports up the floors of docs/architecture.md (importer, imported, floors):\n" + \
        "\n".join(map(str, up))


def test_no_import_cycle():
    cycles = find_cycles(graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_engine_never_imports_ray_or_the_serving_layer():
    offenders = []
    for module, path in modules().items():
        if module.startswith("engine"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                offenders += [(module, n) for n in names if n.split(".")[0] in ("ray", "serve_app", "bench")]
    assert not offenders, offenders


def test_the_checks_have_teeth(tmp_path):
    """An import up a floor (in a function, type-only), a cycle, and `from pkg import submodule`
    read as the submodule, in made-up modules."""
    (tmp_path / "low.py").write_text("def f():\n    from pkg import high\n")
    (tmp_path / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.high\n")
    known = {"low", "typed", "pkg", "pkg.high"}
    assert imports(tmp_path / "low.py", known) == {"pkg.high"} and imports(tmp_path / "typed.py", known) == {"pkg.high"}
    table = {"low": 1, "typed": 1, "pkg": 2}
    assert up_imports({"low": {"pkg.high"}, "pkg.high": {"low"}}, table) == [("low", "pkg.high", 1, 2)]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
