"""MkDocs hook: the parts of the documentation that are generated from the code at build time.

A page asks for a generated block with a marker on a line of its own, e.g.
`<!-- gen:config EngineConfig -->`; `mkdocs build` replaces it (an unknown marker fails the
build). So a field, route, metric, panel or alert added to the code appears in the docs without
anyone editing a page, and tests/docs/test_docs.py checks that each one has a description.

Each block's source is the code itself:
- config / request: the dataclass or pydantic model's fields, typed, with their defaults, and the
  comment written on (or directly above) the field's line;
- routes: the FastAPI app's routes and each handler's docstring;
- metrics: engine/metrics.py METRICS; panels: dashboards/build.py PANELS; alerts: dashboards/alerts.yml;
- cli / bench: the argparse `--help` of `python -m serve_app.cli` and `python -m bench`'s command list;
- files: the first sentence of each module's docstring;
- include / card: a repository file verbatim (serve_config.yaml, a model card).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _on_path() -> None:
    """bench/ and dashboards/ are not installed packages (MkDocs restores sys.path after loading hooks)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"^<!-- gen:(?P<name>[a-z-]+)(?: (?P<args>[^>]*?))? -->$", re.MULTILINE)
# repository images a page links to (../bench/results/x.png, a model card's pictures) are copied into the site
ASSETS = {"bench/results": "assets/results", "models": "assets/models"}
SITE = "@site/"  # in generated links: the docs root, made relative to the page in on_page_markdown


# --- field descriptions from the source --------------------------------------------------------

@functools.cache
def _comments(path: str) -> dict[int, str]:
    """Line number -> the comment on that line (without '#')."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _class_fields_source(cls: type) -> dict[str, str]:
    """Field name -> its description: the comment lines directly above the field (no blank line
    between) and the comment at the end of its last line; walks base classes too."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__ in ("builtins", "pydantic.main"):
            continue
        try:
            path = inspect.getsourcefile(klass)
            lines, first = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        comments = _comments(path)
        source = Path(path).read_text(encoding="utf-8").splitlines()
        node = ast.parse(textwrap.dedent("".join(lines))).body[0]
        if not isinstance(node, ast.ClassDef):
            continue
        offset = first - 1
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            start, end = stmt.lineno + offset, stmt.end_lineno + offset
            above, line = [], start - 1
            while line in comments and source[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            # the comment on the field's line, else the comment lines above it
            text = comments[end] if end in comments else " ".join(above)
            docs[stmt.target.id] = text.replace("noqa", "").strip()
    return docs


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin is typing.Literal:
        return " or ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if hint is typing.Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def _cell(text: str) -> str:
    """Table-safe: pipes escaped outside code spans (inside them Python-Markdown does not split)."""
    parts = text.replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _default(value) -> str:
    return "`None`" if value is None else f"`{value!r}`"


def dataclass_fields(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) for each field of a dataclass."""
    hints, docs, rows = typing.get_type_hints(cls), _class_fields_source(cls), []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = _default(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            default = f"`{type(made).__name__}()`" if dataclasses.is_dataclass(made) else _default(made)
        else:
            default = "required"
        rows.append((f.name, _type_name(hints[f.name]), default, docs.get(f.name, "")))
    return rows


def pydantic_fields(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) for each field of a pydantic model (its JSON name)."""
    docs, rows = _class_fields_source(cls), []
    for name, info in cls.model_fields.items():
        default = "required" if info.is_required() else _default(info.default)
        bounds = [f"{sym} {getattr(m, attr)}" for m in info.metadata
                  for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if hasattr(m, attr)]
        kind = _type_name(info.annotation) + (f" ({', '.join(bounds)})" if bounds else "")
        rows.append((info.alias or name, kind, default, docs.get(name, "")))
    return rows


def _table(rows, head=("field", "type", "default", "description")) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join([f"`{r[0]}`", *(_cell(c) for c in r[1:])]) + " |" for r in rows]
    return "\n".join(out)


CONFIG_CLASSES = {"EngineConfig": "engine.config", "SpecConfig": "engine.config", "ModelPlan": "engine.config",
                  "SamplingParams": "engine.sampling_params"}
REQUEST_MODELS = ("CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TextPart", "StreamOptions",
                  "ResponseFormat", "JSONSchemaFormat")


def gen_config(name: str) -> str:
    cls = getattr(importlib.import_module(CONFIG_CLASSES[name]), name)
    return _table([(n, f"`{t}`", d, doc) for n, t, d, doc in dataclass_fields(cls)])


def gen_request(name: str) -> str:
    if name not in REQUEST_MODELS:
        raise ValueError(f"unknown request model {name!r}")
    cls = getattr(importlib.import_module("serve_app.protocol"), name)
    from engine.sampling_params import SamplingParams

    sampling = {n: doc for n, _, _, doc in dataclass_fields(SamplingParams)}  # same name, same meaning
    return _table([(n, f"`{t}`", d, doc or sampling.get(n, "")) for n, t, d, doc in pydantic_fields(cls)])


def gen_config_keys() -> str:
    """engine/model/config_keys.py's table and each family's own keys: each config.json key, its
    status, which families' published configs carry it, and what the forward does with it."""
    from engine.model.config_keys import KEYS
    from engine.model.families import FAMILIES

    names = list(FAMILIES)
    own = [k for f in FAMILIES.values() for k in f.keys]
    rows = [(k.name, k.status, *("✓" if f in k.families else "" for f in names), k.what) for k in (*KEYS, *own)]
    return _table(rows, head=("key", "status", *names, "what the forward does"))


def gen_not_served() -> str:
    """serve_app/protocol.py's NOT_SERVED: each OpenAI field the server does not serve and why."""
    from serve_app.protocol import NOT_SERVED

    return _table([(name, why) for name, (_, why) in NOT_SERVED.items()], head=("field", "refused because"))


# --- the HTTP routes ---------------------------------------------------------------------------

def _api_routes(routes_) -> list:
    """APIRoutes, looking inside included routers (Serve's ingress includes the class's routes)."""
    out = []
    for route in routes_:
        inner = getattr(route, "original_router", None) or (route if hasattr(route, "routes") else None)
        if inner is not None and not hasattr(route, "endpoint"):
            out += _api_routes(inner.routes)
        elif getattr(route, "endpoint", None) is not None and getattr(route, "methods", None):
            out.append(route)
    return out


def routes() -> list[tuple[str, str, str]]:
    """(method, path, first paragraph of the handler's docstring) for every route the server
    answers, FastAPI's own /docs and /openapi.json left out."""
    from serve_app.deployments import app  # its routes are declared with the deployments

    out = []
    for route in _api_routes(app.routes):
        if route.endpoint.__module__ != "serve_app.deployments":
            continue
        doc = inspect.getdoc(route.endpoint) or ""
        for method in sorted(route.methods - {"HEAD"}):
            out.append((method, route.path, doc.split("\n\n")[0].replace("\n", " ")))
    return out


def gen_routes() -> str:
    return _table([(f"{m} {p}", d) for m, p, d in routes()], head=("route", "what it does"))


# --- metrics, dashboard panels, alerts ---------------------------------------------------------

def gen_metrics() -> str:
    from engine.metrics import METRICS

    return _table([(f"ray_{m.name}", m.kind, ", ".join(m.labels), m.unit or "-", m.help) for m in METRICS],
                  head=("metric (as Prometheus sees it)", "type", "labels", "unit", "meaning"))


def panels() -> list[tuple[str, str, list[str]]]:
    from dashboards.build import PANELS

    return [(title, desc, [expr for expr, _ in targets]) for title, _unit, targets, desc in PANELS]


def gen_panels() -> str:
    return "\n".join(f"- **{title}**: {desc}" for title, desc, _ in panels())


def alerts() -> list[dict]:
    import yaml

    rules = yaml.safe_load((ROOT / "dashboards" / "alerts.yml").read_text())
    return [r for g in rules["groups"] for r in g["rules"]]


def gen_alerts() -> str:
    return _table([(r["alert"], r["labels"].get("severity", ""), r["for"], r["annotations"]["summary"] + ". "
                    + r["annotations"]["description"], f"`{r['expr']}`") for r in alerts()],
                  head=("alert", "severity", "for", "what it means", "expression"))


# --- command lines, files, architecture --------------------------------------------------------

def gen_cli() -> str:
    import argparse

    from serve_app.cli import build_parser

    parser = build_parser()
    parser.formatter_class = lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100)
    return "```text\n$ python -m serve_app.cli --help\n" + parser.format_help().rstrip() + "\n```"


def gen_bench() -> str:
    import bench.__main__ as bench_main

    body = bench_main.__doc__.strip().split("\n", 1)[1].strip("\n")
    return "```text\n$ python -m bench --help\n" + inspect.cleandoc(body) + "\n```"


def gen_include(path: str, lang: str = "") -> str:
    text = (ROOT / path).read_text(encoding="utf-8").rstrip()
    return f'```{lang} title="{path}"\n{text}\n```'


def gen_card(path: str) -> str:
    """A model card, its headings two levels down and its pictures copied into the site."""
    source = ROOT / path
    text = source.read_text(encoding="utf-8")
    lines, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        lines.append("##" + line if not fenced and re.match(r"#+ ", line) else line)
    text = "\n".join(lines) + "\n"
    folder = source.parent.relative_to(ROOT).as_posix()

    def image(m: re.Match) -> str:
        target = f"{folder}/{m.group(2)}"
        for repo_dir, site_dir in ASSETS.items():
            if target.startswith(repo_dir + "/"):
                return f"![{m.group(1)}]({SITE}{site_dir}/{target[len(repo_dir) + 1:]})"
        raise ValueError(f"{path}: picture {target} is outside the copied folders")

    return re.sub(r"!\[([^\]]*)\]\(([^)/:]+(?:/[^)/:]+)*)\)", image, text)


def module_summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    m = re.match(r"(.+?\.)(\s|$)", para)
    return m.group(1) if m else para


def source_files() -> list[Path]:
    files = sorted(p for d in ("engine", "serve_app") for p in (ROOT / d).rglob("*.py")
                   if p.name != "__init__.py" or p.parent.name == "kernels")
    return [p for p in files if "__pycache__" not in p.parts]


def gen_files() -> str:
    rows = [(p.relative_to(ROOT).as_posix(), module_summary(p)) for p in source_files()]
    return _table(rows, head=("file", "what it is"))


GENERATORS = {"config": gen_config, "request": gen_request, "routes": gen_routes, "metrics": gen_metrics,
              "panels": gen_panels, "alerts": gen_alerts, "cli": gen_cli, "bench": gen_bench,
              "include": gen_include, "card": gen_card, "files": gen_files, "config-keys": gen_config_keys,
              "not-served": gen_not_served}


def expand(markdown: str, where: str = "") -> str:
    _on_path()

    def one(m: re.Match) -> str:
        name, args = m.group("name"), (m.group("args") or "").split()
        if name not in GENERATORS:
            raise ValueError(f"{where}: unknown generated block {name!r} (one of {sorted(GENERATORS)})")
        return GENERATORS[name](*args)

    return MARKER.sub(one, markdown)


# --- MkDocs events -----------------------------------------------------------------------------

def on_files(files, config):
    """Repository pictures the pages show (bench plots, model cards' curves) become site files."""
    from mkdocs.structure.files import File

    for repo_dir, site_dir in ASSETS.items():
        for png in sorted((ROOT / repo_dir).rglob("*.png")):
            rel = png.relative_to(ROOT / repo_dir).as_posix()
            files.append(File.generated(config, f"{site_dir}/{rel}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    # a page written for GitHub links bench plots as ../bench/results/x.png: the site's copy instead
    markdown = re.sub(r"\]\((?:\.\./)+bench/results/", f"]({SITE}assets/results/", markdown)
    markdown = expand(markdown, page.file.src_path)
    return markdown.replace(f"]({SITE}", "](" + "../" * page.file.src_path.count("/"))
