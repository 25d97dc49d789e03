"""`python -m bench report` writes the benchmark tables into the documentation's results page and a
five-row headline table into the README, each figure with the host and the day it was measured."""

from __future__ import annotations

import re
import shutil

import pytest

import bench.report as report
from bench import tables
from bench.common import RESULTS


@pytest.fixture
def pages(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=shutil.ignore_patterns("tmp", "serve_runs"))
    readme, page = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text("# x\n\n<!-- headline:start -->\nSTALE-ROWS\n<!-- headline:end -->\n\nrest\n")
    page.write_text("# Results\n\n<!-- bench:start -->\nSTALE-TABLES\n<!-- bench:end -->\n")
    monkeypatch.setattr(tables, "RESULTS", results)
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "RESULTS_PAGE", page)
    return readme, page


def test_report_fills_the_results_page_and_the_readme_headline(pages):
    readme, page = pages
    report.main([])
    text = page.read_text()
    assert "STALE-TABLES" not in text and text.startswith("# Results") and "**Targets**" in text
    captions = [line for line in text.splitlines() if line.startswith("**") and "— " in line]
    assert len(captions) >= 8
    for caption in captions:  # every table names its host and day
        assert re.search(r"measured 20\d\d-\d\d-\d\d", caption), caption
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):  # plots linked from docs/benchmarks/
        assert image.startswith("../../bench/results/") and (tables.RESULTS / image.rsplit("/", 1)[1]).exists()
    head = readme.read_text()
    assert head.endswith("rest\n") and "STALE-ROWS" not in head
    rows = [line for line in head.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 5
    for row in rows:
        assert re.search(r"\| [^|]+, 20\d\d-\d\d-\d\d \|$", row), row


def test_report_refuses_a_page_without_markers(pages):
    readme, page = pages
    page.write_text("# Results\n")
    with pytest.raises(SystemExit, match="markers"):
        report.main([])


def test_every_registered_part_is_a_benchs_function_and_draws_nothing_without_results(tmp_path, monkeypatch):
    for part in (*tables.TABLES, *tables.TARGETS):
        assert callable(tables.resolve(part)) and part.target.split(":")[0] != "report", part
    monkeypatch.setattr(tables, "RESULTS", tmp_path)  # no results at all
    assert report.build() == "" and report.summary() == ""
    with pytest.raises(AttributeError):
        tables.resolve(tables.Part("sweep", "sweep:no_such_table"))
