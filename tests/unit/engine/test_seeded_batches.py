"""A seeded request's output depends on its seed, not on the requests it is batched with: its
draws come from its own counter-based stream (engine/uniforms.py), and it takes the same number
of them alone or in a batch, plain or speculative (k acceptance uniforms and one final draw for k
proposals of its own, whatever the batch's longest proposal)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model.kernels import one_sequence

PROMPTS = [[5, 9, 30, 7, 2], [11, 4], [8, 8, 8, 8, 8, 8, 8, 8, 8, 3], [40, 41, 42], [7]]


def alone_and_batched(llm: LLM, params: list[SamplingParams]) -> tuple[list, list, list]:
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(PROMPTS, params)]
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    reversed_batch = [o.token_ids for o in llm.generate(PROMPTS[::-1], params[::-1])][::-1]
    return alone, batched, reversed_batch


def sampled(spec_lengths: list[int | None] | None = None) -> list[SamplingParams]:
    lengths = spec_lengths or [None] * len(PROMPTS)
    return [SamplingParams(temperature=0.8, max_tokens=24, seed=100 + i, ignore_eos=True, spec_length=k)
            for i, k in enumerate(lengths)]


def test_plain_sampling_gives_a_seeded_request_the_same_tokens_alone_and_in_a_batch(tiny_model):
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=128, max_batch_size=8)
    alone, batched, reversed_batch = alone_and_batched(llm, sampled())
    assert batched == alone == reversed_batch
    assert len({tuple(t) for t in alone}) == len(alone)


@pytest.mark.parametrize("token_step", [False, True], ids=["torch", "token_step"])
def test_speculative_sampling_gives_a_seeded_request_the_same_tokens_alone_and_in_a_batch(tiny_model, tiny_draft,
                                                                                          token_step):
    """Rows with their own, different spec lengths: the batch's longest proposal is not theirs."""
    if token_step and one_sequence.load() is None:
        pytest.skip("the CPU kernels do not build here")
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
              spec_length=4, spec_policy="fixed", dtype="float32", max_seq_len=128, max_batch_size=8,
              forward_plan={"draft": {"dtype": "float32", "token_step": token_step}})
    params = sampled([4, 2, None, 1, 3])
    alone, batched, reversed_batch = alone_and_batched(llm, params)
    assert batched == alone == reversed_batch
    outs = llm.generate(PROMPTS, params)
    assert sum(o.num_accepted_tokens for o in outs) > 0 and sum(o.num_draft_tokens for o in outs) > 0


def test_the_same_seed_gives_the_same_tokens_in_a_new_engine(tiny_model, tiny_draft):
    def run() -> list[list[int]]:
        llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
                  spec_length=3, spec_policy="fixed", dtype="float32", max_seq_len=128, max_batch_size=8)
        return [o.token_ids for o in llm.generate(PROMPTS, sampled())]

    assert run() == run()
