"""Every supported family (Llama, Mistral, Qwen2, Qwen3) against its transformers implementation,
on random-init tiny checkpoints in float32, over both KV backends; speculation within and across
families; the errors a checkpoint we cannot run gets."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelPlan
from engine.model.loader import load_model
from engine.model.passes import forward_chunks
from tests.helpers import FAMILIES, make_model, make_tokenizer, pool_for

VARIANTS = {  # more of what configs carry: tied embeddings, MHA, RoPE scaling (llama3, yarn, linear), attention_bias
    "llama_tied": dict(tied=True),
    "llama_mha": dict(heads=4, kv_heads=4),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2_tied_yarn": dict(FAMILIES["qwen2"], tied=True, max_pos=256,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3_tied": dict(FAMILIES["qwen3"], tied=True),
    "qwen3_wide_heads": dict(FAMILIES["qwen3"], head_dim=32),  # q wider than hidden, as in Qwen3-8B
    "llama_attention_bias_linear_rope": dict(model_type="llama", attention_bias=True,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
F32 = ModelPlan("float32")
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):\n", "x"]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, tok_dir):
    """name -> (path, hf model) for every family and variant, built once."""
    out = {}
    for name, kw in {**FAMILIES, **VARIANTS}.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = path, make_model(path, tok_dir, seed=3, **kw)
    return out


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("name", sorted({**FAMILIES, **VARIANTS}))
def test_logits_match_transformers(family_models, name, backend):
    path, hf = family_models[name]
    ours = load_model(path, F32, "cpu", max_positions=256)
    pool = pool_for(ours, backend, block_size=8)
    torch.manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (3, 150))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits  # [3, 150, vocab]
    slots = [pool.allocate_slot([])[0] for _ in range(3)]
    first = forward_chunks(ours, pool, slots, [ids[i, :100].tolist() for i in range(3)], [0, 0, 0], all_logits=True)
    steps = [forward_chunks(ours, pool, slots, [[ids[i, p].item()] for i in range(3)], [p] * 3) for p in range(100, 150)]
    torch.testing.assert_close(first, expected[:, :100], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(steps, dim=1), expected[:, 100:], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen2_tied_yarn", "qwen3"])
def test_the_one_sequence_kernel_applies_biases_and_qk_norms(family_models, name):
    from engine.model.kernels import one_sequence

    if one_sequence.load() is None:
        pytest.skip("the one-sequence CPU kernel does not build on this machine")
    path, hf = family_models[name]
    ours = load_model(path, ModelPlan("float32", one_sequence_kernel=True), "cpu", max_positions=256)
    ids = torch.randint(0, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[0]  # [40, vocab]
    pool = pool_for(ours)
    slot = pool.allocate_slot([])[0]
    got = forward_chunks(ours, pool, [slot], [ids[0, :34].tolist()], [0], all_logits=True)[0]  # the kernel's widths
    verify = forward_chunks(ours, pool, [slot], [ids[0, 34:].tolist()], [34], all_logits=True)[0]
    torch.testing.assert_close(torch.cat([got, verify]), expected, atol=2e-4, rtol=1e-4)


def _hf_greedy(hf, tok, prompt: str) -> list[int]:
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_generation_matches_transformers(family_models, tok_dir, name, backend):
    from transformers import AutoTokenizer

    path, hf = family_models[name]
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(model=str(path), dtype="float32", kv_cache_backend=backend, block_size=4, max_seq_len=128,
              max_batch_size=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [_hf_greedy(hf, tok, p) for p in PROMPTS]


def _pair_outputs(target, draft, **spec) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of PROMPTS with `draft` speculating for `target` at K = 4, and what was drafted
    and accepted."""
    llm = LLM(model=str(target), draft_model=str(draft), use_speculative_decoding=True, spec_policy="fixed",
              spec_length=4, dtype="float32", max_seq_len=128, max_batch_size=4, **spec)
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs], sum(o.num_draft_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)


def _perturbed_copy(src: Path, dest: Path, scale: float, seed: int = 0) -> Path:
    """The checkpoint at src with noise of `scale` x each tensor's spread added: a draft that agrees
    with its target often, not always."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    g = torch.Generator().manual_seed(seed)
    for file in dest.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({k: v + scale * (v.std() if v.numel() > 1 else 0) * torch.randn(v.shape, generator=g)
                   for k, v in tensors.items()}, file, metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_speculation_within_a_family_is_exact(family_models, tmp_path, name):
    """A same-family draft (the target with noise): greedy speculative output equals plain, with
    both accepted and rejected proposals on the way."""
    path, _ = family_models[name]
    draft = _perturbed_copy(path, tmp_path / "draft", scale=0.5)
    plain = [o.token_ids for o in LLM(model=str(path), dtype="float32", max_seq_len=128).generate(PROMPTS, GREEDY)]
    tokens, drafted, accepted = _pair_outputs(path, draft, kv_cache_backend="paged", block_size=4)
    assert tokens == plain and drafted > 0 and 0 < accepted < drafted


def test_a_draft_from_another_family_sharing_the_tokenizer_works(family_models):
    """A Llama draft and a Qwen2 draft (tied, yarn RoPE) for a Qwen3 target: exact greedy output
    (independent random models: their proposals are rejected, which is the path that must stay exact)."""
    target, _ = family_models["qwen3_wide_heads"]
    plain = [o.token_ids for o in LLM(model=str(target), dtype="float32", max_seq_len=128).generate(PROMPTS, GREEDY)]
    for draft in ("llama", "qwen2_tied_yarn"):
        tokens, drafted, accepted = _pair_outputs(target, family_models[draft][0])
        assert tokens == plain and drafted > 0 and accepted < drafted


def test_an_embedding_padded_beyond_the_tokenizer_is_fine_on_either_side(tmp_path, tok_dir, family_models):
    """Embeddings with rows of padding past the tokenizer (Qwen2.5-7B has 152,064 rows, 0.5B
    151,936): a padded draft's extra ids are cut, a padded target's get q = 0 from the draft."""
    from transformers import AutoTokenizer

    target, _ = family_models["qwen2"]
    make_model(tmp_path / "padded", tok_dir, seed=8, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
               vocab_size=len(AutoTokenizer.from_pretrained(tok_dir)) + 24, **FAMILIES["qwen2"])
    plain = [o.token_ids for o in LLM(model=str(target), dtype="float32", max_seq_len=128).generate(PROMPTS, GREEDY)]
    tokens, drafted, _ = _pair_outputs(target, tmp_path / "padded")
    assert tokens == plain and drafted > 0
    llm = LLM(model=str(tmp_path / "padded"), draft_model=str(target), use_speculative_decoding=True,
              spec_policy="fixed", spec_length=3, dtype="float32", max_seq_len=128)
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=0))
    assert all(len(o.token_ids) == 12 for o in sampled) and sum(o.num_draft_tokens for o in sampled) > 0


def test_a_draft_with_another_tokenizer_is_a_clear_error(tmp_path, family_models):
    make_tokenizer(tmp_path / "tok", vocab_size=300)
    make_model(tmp_path / "draft", tmp_path / "tok", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
               **FAMILIES["qwen3"])
    with pytest.raises(ValueError, match="not compatible with target model.*tokenizers differ"):
        _pair_outputs(family_models["qwen2"][0], tmp_path / "draft")


def test_a_sliding_window_shorter_than_max_seq_len_is_rejected_and_bounds_the_default(tmp_path, tok_dir):
    """Mistral v0.1 attends over a 4,096-token window; within it that is full attention, which the
    engine computes, so sequences are kept within the window rather than attended to wrongly."""
    hf = make_model(tmp_path, tok_dir, seed=4, model_type="mistral", sliding_window=48, max_pos=256)
    with pytest.raises(ValueError, match="max_seq_len 64 exceeds the model's sliding_window 48: sliding-window "
                                         "attention is not implemented"):
        LLM(model=str(tmp_path), dtype="float32", max_seq_len=64)
    llm = LLM(model=str(tmp_path), dtype="float32")
    assert llm.engine.config.max_seq_len == 48
    prompt = list(range(3, 30))
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=21, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True))[0].token_ids == expected
    qwen = make_model(tmp_path / "qwen", tok_dir, **dict(FAMILIES["qwen2"], use_sliding_window=True, sliding_window=48,
                                                         max_window_layers=1))
    assert qwen.config.layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="sliding_window 48"):
        LLM(model=str(tmp_path / "qwen"), dtype="float32", max_seq_len=64)
