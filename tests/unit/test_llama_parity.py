"""Our Llama forward and generation against transformers.LlamaForCausalLM (fp32)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import build_pool
from engine.model.loader import load_llama
from engine.runner import ContinuousRunner, forward_chunks
from tests.helpers import make_model

CONFIGS = {
    "gqa_untied": dict(),
    "gqa_tied": dict(tied=True),
    "mha": dict(heads=4, kv_heads=4),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}
PROMPTS = [
    "def add(a, b):",
    "class Point:\n    def",
    "for i in range(10):\n",
    "import os",
    "The quick brown fox jumps over the lazy dog and then",
    "x",
]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, tok_dir, name):
    hf = make_model(tmp_path, tok_dir, seed=3, **CONFIGS[name])
    ours = load_llama(tmp_path, "float32", "cpu", max_positions=512)
    cfg = EngineConfig(model=str(tmp_path), dtype="float32", max_batch_size=4, max_seq_len=256)
    runner = ContinuousRunner(ours, build_pool(cfg, ours))
    torch.manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (3, 150))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits  # [3, 150, vocab]
    slots = [runner.pool.allocate_slot([])[0] for _ in range(3)]
    # different prefill split per row: exercises chunked writes and the batched mask
    first = forward_chunks(ours, runner.pool, slots, [ids[i, :100].tolist() for i in range(3)],
                                  [0, 0, 0], all_logits=True)
    rest = forward_chunks(ours, runner.pool, slots, [ids[i, 100:].tolist() for i in range(3)],
                                 [100, 100, 100], all_logits=True)
    got = torch.cat([first, rest], dim=1)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def _hf_greedy(hf, tok, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_greedy_generation_matches_transformers(tiny_model, backend):
    from transformers import AutoTokenizer

    path, hf = tiny_model
    tok = AutoTokenizer.from_pretrained(path)
    expected = [_hf_greedy(hf, tok, p, 24) for p in PROMPTS]
    llm = LLM(model=str(path), dtype="float32", kv_cache_backend=backend, block_size=4,
              max_seq_len=128, max_batch_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert alone == expected
    assert batched == expected


@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_long_context_single_token_decode_matches_transformers(tmp_path, tok_dir, backend):
    """Decode steps over > 128 keys take the explicit-attention path; batched rows differ in length."""
    hf = make_model(tmp_path, tok_dir, seed=4)
    ours = load_llama(tmp_path, "float32", "cpu", max_positions=512)
    cfg = EngineConfig(model=str(tmp_path), dtype="float32", max_batch_size=4, max_seq_len=256,
                       kv_cache_backend=backend, block_size=8)
    pool = build_pool(cfg, ours)
    torch.manual_seed(1)
    lengths = [140, 170, 131]
    ids = torch.randint(0, hf.config.vocab_size, (3, 180))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits  # [3, 180, vocab]
    slots = [pool.allocate_slot([])[0] for _ in range(3)]
    forward_chunks(ours, pool, slots, [ids[i, :n].tolist() for i, n in enumerate(lengths)], [0, 0, 0])
    for step in range(6):
        pos = [n + step for n in lengths]
        got = forward_chunks(ours, pool, slots, [[ids[i, p].item()] for i, p in enumerate(pos)], pos)
        want = torch.stack([expected[i, p] for i, p in enumerate(pos)])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    single = forward_chunks(ours, pool, slots[:1], [[ids[0, lengths[0] + 6].item()]], [lengths[0] + 6])
    torch.testing.assert_close(single[0], expected[0, lengths[0] + 6], atol=2e-4, rtol=1e-4)


def test_bf16_weights_packed_in_float32_compute_the_same_model(tmp_path, tok_dir, monkeypatch):
    """CPUs without bf16 oneDNN kernels (AVX2 only) pack bf16 weights upcast to float32. That
    must still be the checkpoint's model: logits within bf16 rounding of a float32 forward over
    the same (bf16-valued) weights. The fallback is forced here, whatever this CPU supports."""
    from engine.model import llama as llama_module

    if llama_module.cpu_packing_dtype(torch.float32) is None:
        pytest.skip("oneDNN weight packing is not available in this torch build")
    make_model(tmp_path, tok_dir, seed=5, dtype=torch.bfloat16)
    reference = load_llama(tmp_path, "float32", "cpu", max_positions=256)  # plain F.linear
    monkeypatch.setattr(llama_module, "cpu_packing_dtype", lambda dtype: torch.float32)
    fallback = load_llama(tmp_path, "bfloat16", "cpu", max_positions=256)
    assert fallback._linear is llama_module._float32_packed_linear
    torch.manual_seed(1)
    ids = torch.randint(0, reference.shape.vocab_size, (2, 40))
    logits = []
    for model, dtype in ((reference, "float32"), (fallback, "bfloat16")):
        cfg = EngineConfig(model=str(tmp_path), dtype=dtype, max_batch_size=2, max_seq_len=128)
        pool = build_pool(cfg, model)
        slots = [pool.allocate_slot([])[0] for _ in range(2)]
        logits.append(forward_chunks(model, pool, slots, ids.tolist(), [0, 0], all_logits=True))
    expected, got = logits  # each [2, 40, vocab]
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
