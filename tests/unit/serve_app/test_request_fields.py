"""docs/contributing.md's recipe "Add an OpenAI request field" run as written on a subclass: a field
the schema does not declare is a 400 naming it; declared with a comment it is parsed, documented
by the generated reference, and carried into SamplingParams."""

from __future__ import annotations

import sys

import pytest

from serve_app.errors import APIError
from serve_app.protocol import CompletionRequest
from tests.helpers import REPO


class WithSeedOffset(CompletionRequest):
    seed_offset: int = 0  # added to the request's seed (a toy field: the recipe's step 1)

    def sampling_params(self, default_max_tokens: int):  # the recipe's step 2
        params = super().sampling_params(default_max_tokens)
        params.seed = None if params.seed is None else params.seed + self.seed_offset
        return params


def test_a_field_follows_the_recipe_from_refused_to_carried():
    body = {"prompt": "x", "seed": 5, "seed_offset": 2}
    with pytest.raises(APIError) as refused:
        CompletionRequest.model_validate(body)
    assert refused.value.status == 400 and refused.value.param == "seed_offset"
    assert WithSeedOffset.model_validate(body).sampling_params(16).seed == 7
    sys.path.insert(0, str(REPO / "docs"))
    import hooks

    described = {name: doc for name, _, _, doc in hooks.pydantic_fields(WithSeedOffset)}
    assert described["seed_offset"].startswith("added to the request's seed")
