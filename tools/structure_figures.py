"""Structure figures of the tree: files over 400 lines and functions over 60 lines in engine/,
serve_app/, bench/ and tools/, and the import graph's counts that tests/test_layering.py checks.

    python -m tools.structure_figures            # a table
    python -m tools.structure_figures --json     # the same, as JSON
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIRS = ("engine", "serve_app", "bench", "tools")
FILE_LINES, FUNCTION_LINES = 400, 60


def python_files(directory: str) -> list[Path]:
    return sorted(p for p in (REPO / directory).rglob("*.py") if "results" not in p.parts)


def long_functions(path: Path, limit: int = FUNCTION_LINES) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function or method in `path` longer than `limit` lines."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    out.append((f"{prefix}{child.name}", lines))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return out


def figures() -> dict:
    from tests import test_layering as layering

    per_dir = {}
    for directory in DIRS:
        files = python_files(directory)
        long_files = [(str(p.relative_to(REPO)), n) for p in files
                      if (n := len(p.read_text().splitlines())) > FILE_LINES]
        functions = [(f"{p.relative_to(REPO)}:{name}", n) for p in files for name, n in long_functions(p)]
        per_dir[directory] = {"files": len(files), "files_over_400": sorted(long_files, key=lambda x: -x[1]),
                              "functions_over_60": sorted(functions, key=lambda x: -x[1])}
    deps = layering.graph()
    table = layering.floors()
    layers = {"modules": len(deps), "imports": sum(map(len, deps.values())),
              "floors": len(set(table.values())), "up_imports": len(layering.up_imports(deps, table)),
              "allowed": len(layering.ALLOWED), "cycles": len(layering.find_cycles(deps))}
    return {"directories": per_dir, "layering": layers}


def table(data: dict) -> str:
    rows = ["| directory | .py files | files > 400 lines | functions > 60 lines |", "| --- | --- | --- | --- |"]
    for directory, d in data["directories"].items():
        rows.append(f"| {directory}/ | {d['files']} | {len(d['files_over_400'])} | {len(d['functions_over_60'])} |")
    lines = ["\n".join(rows), "", "layering: " + ", ".join(f"{k} {v}" for k, v in data["layering"].items())]
    for d in data["directories"].values():
        for name, n in d["files_over_400"] + d["functions_over_60"]:
            lines.append(f"  {name}: {n}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    data = figures()
    print(json.dumps(data, indent=1) if args.json else table(data))


if __name__ == "__main__":
    main()
