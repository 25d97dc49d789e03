"""The documentation: the site builds with `mkdocs build --strict` (a broken link, a missing page or
an unknown generated block fails), its reference has a described entry for every config field,
route and metric, and its Python examples run (see tests/docs/pages.py for the markers)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from tests.docs.pages import KINDS, REPO, examples, hooks, pages, run

CONFIG = ("EngineConfig", "SpecConfig", "ModelPlan", "SamplingParams")


@pytest.fixture(scope="module")
def gen():
    return hooks()


def test_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for page in ("index.html", "reference/config/index.html", "reference/metrics/index.html",
                 "benchmarks/results/index.html", "deployment/monitoring/index.html"):
        assert (tmp_path / page).exists(), page
    html = (tmp_path / "reference" / "config" / "index.html").read_text()
    assert "<!-- gen:" not in html and "kv_cache_memory_fraction" in html


@pytest.mark.parametrize("name", CONFIG)
def test_every_config_field_has_a_described_entry(gen, name):
    import importlib

    cls = getattr(importlib.import_module(gen.CONFIG_CLASSES[name]), name)
    rows = {row[0]: row for row in gen.dataclass_fields(cls)}
    table = gen.gen_config(name)
    for f in dataclasses.fields(cls):
        assert f"| `{f.name}` |" in table, f"{name}.{f.name} is missing from the configuration reference"
        assert rows[f.name][3], (f"{name}.{f.name} has no description: write a comment on its line in "
                                 f"{gen.CONFIG_CLASSES[name].replace('.', '/')}.py (the reference is generated from it)")


def test_a_field_added_to_the_code_appears_in_the_reference(gen):
    @dataclasses.dataclass
    class Extra:
        plain: int = 1  # what it does
        # why, above the field
        chosen: str | None = None

    rows = gen.dataclass_fields(Extra)
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("plain", "int", "`1`", "what it does"),
                                                       ("chosen", "str or None", "`None`", "why, above the field")]


def test_every_route_has_a_described_entry(gen):
    from serve_app.deployments import app  # its routes are declared with the deployments

    listed = {(m, p): doc for m, p, doc in gen.routes()}
    served = {(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops}
    assert served and served == set(listed), "the HTTP reference and the app's routes differ"
    for route, doc in listed.items():
        assert doc, f"{route} has no docstring in serve_app/deployments.py (the reference is generated from it)"
    page = (REPO / "docs" / "serving" / "openai-api.md").read_text()
    for method, path in served:
        assert f"`{method} {path}`" in page, f"{method} {path} is not described on the OpenAI API page"


def test_every_request_field_is_in_the_reference(gen):
    import serve_app.protocol as protocol

    for name in gen.REQUEST_MODELS:
        table = gen.gen_request(name)
        for field, info in getattr(protocol, name).model_fields.items():
            assert f"| `{info.alias or field}` |" in table, f"{name}.{field} is missing from the HTTP reference"


def test_every_metric_panel_and_alert_has_a_described_entry(gen):
    from engine.metrics import METRICS

    table = gen.gen_metrics()
    for m in METRICS:
        assert f"| `ray_{m.name}` |" in table and m.help, f"{m.name} is missing from the metrics reference"
        assert m.help.isascii(), f"{m.name}: Ray refuses a metric whose description is not ASCII"
    for title, desc, _ in gen.panels():
        assert f"**{title}**" in gen.gen_panels() and desc, title
    for rule in gen.alerts():
        assert rule["alert"] in gen.gen_alerts() and rule["annotations"]["description"], rule["alert"]


def test_cli_reference_is_the_parsers_help(gen):
    from serve_app.cli import config_fields

    text = gen.gen_cli()
    for _, f in config_fields():
        flag = "--speculative-decoding" if f.name == "use_speculative_decoding" else "--" + f.name.replace("_", "-")
        assert flag in text, f"{flag} is missing from the command-line reference"


def test_every_source_file_has_a_line_in_the_architecture(gen):
    text = gen.gen_files()
    for path in gen.source_files():
        rel = path.relative_to(REPO).as_posix()
        assert f"| `{rel}` |" in text
        assert gen.module_summary(path), f"{rel} has no module docstring (its line in docs/architecture.md)"


def test_examples_are_marked_with_known_kinds():
    found = [e for p in pages() for e in examples(p)]
    assert any(e.kind == "local" for e in found) and any(e.kind == "server" for e in found)
    for e in found:
        assert e.kind in KINDS, f"{e.page}:{e.line}: unknown example kind {e.kind!r} (one of {sorted(KINDS)})"


LOCAL = [(p, [e for e in examples(p) if e.kind == "local"]) for p in pages()]


def test_gpu_examples_compile():
    """Examples marked `gpu` need a CUDA device and checkpoints that are not shipped: they are shown,
    and checked here for syntax only."""
    for page in pages():
        for e in examples(page):
            if e.kind == "gpu":
                compile(e.code, f"{e.page}:{e.line}", "exec")


@pytest.mark.parametrize("page,blocks", [(p, b) for p, b in LOCAL if b],
                         ids=[p.relative_to(REPO).as_posix() for p, b in LOCAL if b])
def test_python_examples_run(page, blocks):
    run(blocks)


def test_each_design_decision_cites_a_figure_a_host_and_an_archive_link():
    from tests.docs.pages import REPO

    text = (REPO / "docs" / "design-decisions.md").read_text()
    sections = [s for s in text.split("\n## ")[1:]]
    assert len(sections) >= 7
    for section in sections:
        title = section.splitlines()[0]
        for part in ("**Decision.**", "**Why.**", "**Figure.**", "**Host.**", "**Archive.**"):
            assert part in section, f"design decision {title!r} lacks {part}"
        figure = section.split("**Figure.**")[1].split("**Host.**")[0]
        assert any(c.isdigit() for c in figure), f"{title!r}: its figure has no number"
        host = section.split("**Host.**")[1].split("**Archive.**")[0]
        assert any(h in host for h in ("AMD EPYC", "Intel Xeon", "NVIDIA", "Sapphire")), f"{title!r}: no host class"
        assert "](performance-notes.md#" in section.split("**Archive.**")[1], f"{title!r}: no link into the archive"
    for topic in ("forward plan", "adaptive policy", "chain or tree", "kv sizing", "graphs", "structured outputs",
                  "logprobs"):
        assert any(topic in s.splitlines()[0].lower() for s in sections), f"no design decision on {topic}"
