"""A draft restricted to frequent tokens (`draft_vocab_size`): same maths on the kept tokens,
-inf elsewhere, greedy output unchanged, clear errors for a bad ranking."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv import make_pool
from engine.model.loader import load_llama
from engine.runner import forward_chunks
from engine.spec.draft_vocab import RANKING_FILE, draft_output_ids

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "class Point:\n    def __init__(self, x, y):",
           "for i in range(10):\n    print(i * i)\n", "import os", "x", "print(os.path.join('a', 'b'))\n" * 2]


def write_ranking(model_dir, token_ids):
    (model_dir / RANKING_FILE).write_text(json.dumps({"token_ids": [int(t) for t in token_ids]}))


@pytest.fixture(scope="module")
def ranked_draft(tiny_draft):
    """The tiny draft with a ranking that puts odd ids first (an arbitrary but fixed order)."""
    path, hf = tiny_draft
    vocab = hf.config.vocab_size
    write_ranking(path, [i for i in range(vocab) if i % 2] + [i for i in range(vocab) if not i % 2])
    return path, vocab


def run_logits(model, ids):
    pool = make_pool("slotted", num_layers=model.shape.num_layers, num_kv_heads=model.shape.num_kv_heads,
                     head_dim=model.shape.head_dim, max_slots=1, max_seq_len=64, dtype=model.dtype, device="cpu")
    slot, _ = pool.allocate_slot([])
    return forward_chunks(model, pool, [slot], [ids], [0], all_logits=True)[0]  # [T, V]


def test_restricted_head_scores_kept_tokens_exactly_and_nothing_else(ranked_draft):
    path, vocab = ranked_draft
    kept = draft_output_ids(path, 40, vocab, always={1})
    assert kept.tolist() == sorted(set(range(1, 80, 2)))  # 40 odd ids; 1 is among them already
    full = run_logits(load_llama(path, "float32", "cpu", 64), [5, 9, 2, 7])
    restricted = run_logits(load_llama(path, "float32", "cpu", 64, kept), [5, 9, 2, 7])
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[kept] = False
    torch.testing.assert_close(restricted[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(restricted[:, outside]).all()


def test_eos_is_always_kept(ranked_draft):
    path, vocab = ranked_draft
    assert 0 in draft_output_ids(path, 3, vocab, always={0}).tolist()  # 0 is even: ranked last


@pytest.mark.parametrize("method", ["draft", "hybrid"])
@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_greedy_output_unchanged_with_a_restricted_draft(tiny_model, ranked_draft, method, backend):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=8,
                  kv_cache_backend=backend, block_size=4)
    reference = [o.token_ids for o in LLM(**common).generate(PROMPTS, greedy)]
    llm = LLM(**common, draft_model=str(ranked_draft[0]), use_speculative_decoding=True,
              speculative_method=method, spec_policy="fixed", spec_length=4, draft_vocab_size=64)
    assert llm.engine.runner.draft.model.lm_head.shape[0] == 64
    alone = [llm.generate(p, greedy)[0].token_ids for p in PROMPTS]
    batched = llm.generate(PROMPTS, greedy)
    assert alone == reference and [o.token_ids for o in batched] == reference
    assert sum(o.num_draft_tokens for o in batched) > 0


def test_errors_name_the_field(tiny_model, tiny_draft, tmp_path):
    common = dict(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
                  dtype="float32", max_seq_len=64)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        LLM(**common, draft_vocab_size=0)
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, "):
        LLM(**common, draft_vocab_size=10**6)
    bare = tmp_path / "bare_draft"
    bare.mkdir()
    for f in tiny_draft[0].iterdir():
        if f.name != RANKING_FILE:
            (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="draft_vocab_size=8 needs a token frequency ranking"):
        LLM(**{**common, "draft_model": str(bare)}, draft_vocab_size=8)
    write_ranking(bare, [1, 1, 2])
    with pytest.raises(ValueError, match="distinct"):
        LLM(**{**common, "draft_model": str(bare)}, draft_vocab_size=3)
