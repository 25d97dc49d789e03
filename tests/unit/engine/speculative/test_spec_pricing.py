"""What the adaptive policy prices is what will run: the proposer declares which rows a model
drafts (`Proposer.model_rows`, overridden by hybrid), and the step reads that, never its type."""

from __future__ import annotations

import re
from types import SimpleNamespace

from engine.request import SpecStats
from engine.speculative.proposers.base import Proposer
from engine.speculative.proposers.hybrid import HybridProposer
from engine.speculative.proposers.ngram import NgramProposer
from tests.helpers import REPO


class Model(Proposer):
    """A model proposer's declarations, no passes."""

    name = "model"
    runs_model = True


def _request(last_proposer: str | None) -> SimpleNamespace:
    return SimpleNamespace(spec=SpecStats(last_proposer=last_proposer))


def test_the_proposer_declares_the_rows_a_model_drafts():
    reqs = [_request(p) for p in (None, "ngram", "model", "ngram")]
    lookup = NgramProposer(16, "cpu", 4, 1, 2)
    assert Model().model_rows(reqs) == [True] * 4
    assert lookup.model_rows(reqs) == [False] * 4
    # hybrid: the rows whose last round its lookup did not propose (a new request's too)
    assert HybridProposer(lookup, Model()).model_rows(reqs) == [True, False, True, False]


def test_the_step_reads_no_proposer_by_its_type():
    found = [f"{path.relative_to(REPO)}:{n}" for path in (REPO / "engine" / "speculative").rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"getattr\([^)]*proposer|isinstance\([^)]*Proposer\)", line)]
    assert not found, found
