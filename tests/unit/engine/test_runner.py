"""The model runner (engine/runner.py) over a real pool and the tiny model, against transformers:
a prompt prefilled in chunks gives its first token only once complete, and the same one as in
one chunk; a batched decode step gives each row its own greedy token; a verify pass gives every
position's logits, also when split into groups."""

from __future__ import annotations

import torch

from engine.config import ModelPlan
from engine.kv import KVManager
from engine.model.loader import load_model
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.uniforms import RandomStream
from tests.helpers import pool_for

PROMPTS = [[5, 9, 2, 17, 3, 8, 11, 4, 30], [7, 7, 21, 6], [40, 2, 9, 13, 13, 5]]


def setup(tiny_model) -> ModelRunner:
    model = load_model(tiny_model[0], ModelPlan("float32"), "cpu", 256)
    return ModelRunner(model, KVManager(pool_for(model, "paged", max_slots=4, block_size=4)))


def admitted(runner: ModelRunner, prompt: list[int], name: str) -> Request:
    req = Request(name, list(prompt), SamplingParams(temperature=0.0, max_tokens=8), RandomStream(0), None)
    assert runner.kv.allocate(req) == 0
    return req


def hf_logits(tiny_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny_model[1](input_ids=torch.tensor([ids])).logits[0]  # [T, V]


def test_a_chunked_prefill_gives_the_first_token_once_the_prompt_is_complete(tiny_model):
    runner = setup(tiny_model)
    whole, parts = admitted(runner, PROMPTS[0], "whole"), admitted(runner, PROMPTS[0], "parts")
    first = runner.prefill([(whole, 9), (parts, 5)])
    assert [(r.request_id, t) for r, t in first] == [("whole", [int(hf_logits(tiny_model, PROMPTS[0])[-1].argmax())])]
    assert runner.kv.computed(parts) == 5
    second = runner.prefill([(parts, 4)])
    assert [(r.request_id, t) for r, t in second] == [("parts", first[0][1])]


def test_a_decode_step_gives_each_row_its_own_greedy_token(tiny_model):
    runner = setup(tiny_model)
    reqs = [admitted(runner, p, f"r{i}") for i, p in enumerate(PROMPTS)]
    for r, tokens in runner.prefill([(r, len(p)) for r, p in zip(reqs, PROMPTS)]):
        r.output_token_ids += tokens
    for _ in range(3):
        result = runner.decode(reqs)
        for r, tokens in result.tokens:
            want = int(hf_logits(tiny_model, r.prompt_token_ids + r.output_token_ids)[-1].argmax())
            assert tokens == [want], r.request_id
            r.output_token_ids += tokens
    assert result.stats.batch_size == 3 and result.stats.num_tokens == 3


def test_a_verify_pass_gives_every_positions_logits_whole_or_in_groups(tiny_model):
    for groups in ([[0, 1, 2]], [[0, 2], [1]]):
        runner = setup(tiny_model)
        reqs = [admitted(runner, p, f"r{i}") for i, p in enumerate(PROMPTS)]
        runner.prefill([(r, len(p)) for r, p in zip(reqs, PROMPTS)])
        chunks = [[1, 2, 3], [4], [5, 6]]
        logits = runner.verify(reqs, chunks, groups)  # [3, 3, V]
        for i, (p, c) in enumerate(zip(PROMPTS, chunks)):
            torch.testing.assert_close(logits[i, :len(c)], hf_logits(tiny_model, p + c)[len(p):], atol=1e-4, rtol=1e-4)
            assert runner.kv.computed(reqs[i]) == len(p) + len(c)
