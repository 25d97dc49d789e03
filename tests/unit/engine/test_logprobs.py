"""Logprobs are the target's, at every emitted position, whatever proposes: equal (float32, 1e-4)
to transformers' log_softmax over the same sequence, for plain decoding and every proposer, greedy
and sampled; prompt logprobs likewise (a prefix-cache hit recomputes them); the processed mode
reports the distribution sampled from; penalties and logit_bias change what is sampled."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [[5, 9, 30, 7, 5, 9, 30, 7, 5, 9], [11, 12, 13, 14, 11, 12], [40, 41, 42]]
K = 3  # top alternatives asked for




def reference_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each output position [len(output), V] (float32, teacher-forced)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) + len(output) - 1].float()
    return logits.log_softmax(dim=-1)


def assert_matches(hf, out, k: int = K) -> None:
    assert len(out.logprobs) == len(out.token_ids)
    ref = reference_logprobs(hf, out.prompt_token_ids, out.token_ids)
    for j, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(ref[j, token]), abs=1e-4)
        top = ref[j].topk(k + 1)
        assert [lp for _, lp in entry.top] == pytest.approx(top.values[:k].tolist(), abs=1e-4)
        if (top.values[:-1] - top.values[1:]).min() > 1e-4:  # no near-tie: the same ids in the same order
            assert [t for t, _ in entry.top] == top.indices[:k].tolist()


def engine(tiny_model, tiny_draft, tiny_head, method: str | None, **kw) -> LLM:
    spec = {} if method is None else dict(
        use_speculative_decoding=True, speculative_method=method, spec_length=3, spec_policy="fixed",
        **({} if method == "ngram" else {"draft_model": str(tiny_head if method == "eagle" else tiny_draft[0])}))
    return LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=4, **spec, **kw)


@pytest.mark.parametrize("method", [None, "ngram", "draft", "eagle", "hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_at_every_emitted_position(tiny_model, tiny_draft, tiny_head, method, temperature):
    llm = engine(tiny_model, tiny_draft, tiny_head, method)
    params = [SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=i, logprobs=K)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    if method is not None:
        assert sum(o.num_draft_tokens for o in outs) > 0
    for out in outs:
        assert_matches(tiny_model[1], out)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_token_tree_rounds_give_the_targets_logprobs(tiny_model, tiny_draft, tiny_head, monkeypatch, temperature, mode):
    """n-gram trees (a prompt whose suffix was followed by two continuations): the emitted tokens'
    logprobs come from the root's and the accepted nodes' positions of the tree pass."""
    import engine.speculative.step as step_module

    branched = []
    real = step_module.tree_logprobs

    def spy(reqs, trees, *args):
        branched.extend(len(t) > t.depth for t in trees if t is not None)
        return real(reqs, trees, *args)

    monkeypatch.setattr(step_module, "tree_logprobs", spy)
    llm = engine(tiny_model, tiny_draft, tiny_head, "ngram", tree_width=3, tree_tokens=8, logprobs_mode=mode)
    prompts = [[5, 9, 30, 7, 5, 9, 31, 8, 5, 9], *PROMPTS]
    params = [SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=i, logprobs=K)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert any(branched)
    for out in outs:
        if mode == "raw":
            assert_matches(tiny_model[1], out)
            continue
        raw = reference_logprobs(tiny_model[1], out.prompt_token_ids, out.token_ids)
        for j, entry in enumerate(out.logprobs):
            if temperature == 0.0:  # processed greedy: the one-hot distribution sampled from
                assert entry.logprob == pytest.approx(0.0, abs=1e-6)
            else:
                ref = (raw[j] / temperature).log_softmax(dim=-1)
                assert entry.logprob == pytest.approx(float(ref[entry.token_id]), abs=1e-4)


def test_speculative_greedy_logprobs_equal_plain_decodings(tiny_model, tiny_draft, tiny_head):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = engine(tiny_model, tiny_draft, tiny_head, None).generate(PROMPTS, params)
    spec = engine(tiny_model, tiny_draft, tiny_head, "draft").generate(PROMPTS, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)
        assert [[t for t, _ in e.top] for e in a.logprobs] == [[t for t, _ in e.top] for e in b.logprobs]


def test_requests_without_logprobs_get_none_and_the_same_tokens(tiny_model, tiny_draft, tiny_head):
    llm = engine(tiny_model, tiny_draft, tiny_head, "draft")
    with_lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    without = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a, b = llm.generate(PROMPTS[:2], [with_lp, without])
    assert b.logprobs is None and len(a.logprobs) == 12 and all(e.top == () for e in a.logprobs)
    assert llm.generate(PROMPTS[1], without)[0].token_ids == b.token_ids


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(tiny_model, tiny_draft, tiny_head):
    llm = engine(tiny_model, tiny_draft, tiny_head, "draft", logprobs_mode="processed")
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.5, max_tokens=12, ignore_eos=True, seed=3,
                                                  logprobs=1))[0]
    raw = reference_logprobs(tiny_model[1], out.prompt_token_ids, out.token_ids)  # log_softmax(z): z up to a shift
    ref = (raw / 0.5).log_softmax(dim=-1)  # log softmax(z / 0.5)
    for j, entry in enumerate(out.logprobs):
        assert entry.logprob == pytest.approx(float(ref[j, entry.token_id]), abs=1e-4)


def test_prompt_logprobs_are_transformers_even_after_a_prefix_cache_hit(tiny_model, tiny_draft, tiny_head):
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, block_size=4, enable_prefix_caching=True)
    prompt = list(range(5, 25))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = tiny_model[1](input_ids=ids).logits[0, :-1].float().log_softmax(dim=-1)  # position p scores p + 1
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt, plain)  # fills the prefix cache
    for max_tokens in (2, 0):
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=2))[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p, entry in enumerate(out.prompt_logprobs[1:]):
            assert entry.token_id == prompt[p + 1]
            assert entry.logprob == pytest.approx(float(ref[p, prompt[p + 1]]), abs=1e-4)
            assert [t for t, _ in entry.top] == ref[p].topk(2).indices.tolist()
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length"


def test_logit_bias_and_penalties_change_what_is_sampled(tiny_model, tiny_draft, tiny_head):
    llm = engine(tiny_model, tiny_draft, tiny_head, "draft")
    base = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    forced = llm.generate(PROMPTS[0], SamplingParams(**base, logit_bias={77: 100.0}))[0]
    assert set(forced.token_ids) == {77}
    plain = llm.generate(PROMPTS[0], SamplingParams(**base))[0].token_ids
    banned = llm.generate(PROMPTS[0], SamplingParams(**base, logit_bias={plain[0]: -100.0}))[0].token_ids
    assert plain[0] not in banned
    repeated = max(set(plain), key=plain.count)
    assert plain.count(repeated) > 2  # random tiny models fall into cycles
    penalised = llm.generate(PROMPTS[0], SamplingParams(**base, frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert max(penalised.token_ids.count(t) for t in set(penalised.token_ids)) < plain.count(repeated)
    with pytest.raises(ValueError, match="logit_bias keys"):
        llm.engine.add_request([1, 2], SamplingParams(logit_bias={10**6: 1.0}))


def test_logprobs_cost_no_extra_read_back(tiny_model, tiny_draft, tiny_head, monkeypatch):
    import engine.host_sync as host_sync

    reads = [0]
    original = host_sync.read

    def counted(t):
        reads[0] += 1
        return original(t)

    monkeypatch.setattr(host_sync, "read", counted)
    for method in (None, "draft"):
        eng = engine(tiny_model, tiny_draft, tiny_head, method).engine
        for lp in (None, 2):
            rid = eng.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                              logprobs=lp))
            eng.step()  # prefill and the first token
            per_step = []
            for _ in range(3):
                before = reads[0]
                eng.step()
                per_step.append(reads[0] - before)
            eng.abort(rid)
            if lp is None:
                expected = per_step
            assert per_step == expected, (method, lp, per_step)


def test_logprob_entries_serialise(tiny_model, tiny_draft, tiny_head):
    out = engine(tiny_model, tiny_draft, tiny_head, None).generate(PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=3, logprobs=1))[0]
    assert json.loads(json.dumps([[e.token_id, e.logprob, e.top] for e in out.logprobs]))


def test_penalties_and_bias_shift_the_logits_as_openai_defines():
    """logit -= frequency * count + presence * (count > 0) over the output; logit_bias is added;
    the repetition penalty sees prompt and output; all before temperature."""
    from engine.sampling import Adjustments, SamplingRows, adjusted_logits

    params = [SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={1: 3.0}),
              SamplingParams(temperature=1.0)]
    rows = SamplingRows.build(params, "cpu")
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    adjust = Adjustments.build(rows, params, [[0, 2, 2, 3], [0, 2]], [[2, 2, 3], [2]], 4, "cpu")
    out = adjusted_logits(logits, rows, adjust)
    assert out[0].tolist() == pytest.approx([1.0, 5.0, 3.0 - 0.5 - 0.5, 4.0 - 0.5 - 0.25])
    assert out[1].tolist() == [1.0, 2.0, 3.0, 4.0]  # a row asking for none is untouched
    grown = adjust.grown(torch.tensor([[3, 1], [0, 0]]), torch.tensor([2, 0]))  # rows 0..2: request 0's positions
    counts = grown.counts.view(2, 3, 4)
    assert counts[0, :, 3].tolist() == [1.0, 2.0, 2.0] and counts[0, :, 1].tolist() == [0.0, 0.0, 1.0]
    assert counts[1].sum(dim=-1).tolist() == [1.0, 1.0, 1.0]  # nothing proposed: the output's counts throughout
