"""The attention branches a pass can take (engine/model/transformer.py `attention_branch`): each
computes the attention of the view's mask, checked against a float64 reference over the pass
shapes the engine makes; the CUDA rule, forced here on CPU, picks the expected branch and gives
the default rule's logits and greedy tokens (fp32)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelPlan
from engine.kv import make_pool, protocol
from engine.model import attention as attention_module
from engine.model.attention import attention_branch
from engine.model.loader import load_model
from engine.model.passes import forward_chunks
from engine.model.transformer import Transformer
from tests.helpers import make_model

GENERAL = ("sdpa", "grouped", "sdpa_expanded")  # branches that take any boolean mask
CAUSAL = ("sdpa_causal", "sdpa_causal_expanded")  # branches for a lower-right causal mask only


def test_the_rule_per_device_and_pass_shape():
    """CPU: SDPA for one sequence or wide passes, grouped matmuls for few rows of several (as
    before). CUDA: masked GQA passes leave SDPA's math kernel: a causal tail takes is_causal /
    the lower-right bias (K/V expanded where flash does not take GQA; few rows then stay
    grouped), other masks take grouped matmuls for few rows, else K/V expanded + the mask."""
    cpu = [attention_branch("cpu", B, T, 512, 32, 8, mask) for B, T, mask in
           [(1, 6, "general"), (1, 6, "causal_tail"), (8, 1, "none"), (8, 6, "general"), (8, 64, "general")]]
    assert cpu == ["sdpa", "sdpa", "grouped", "grouped", "sdpa"]
    cuda = {(B, T, H, Hkv, mask, flash): attention_branch("cuda", B, T, 512, H, Hkv, mask, flash)
            for B, T, H, Hkv, mask, flash in [
                (1, 512, 32, 8, "causal_tail", True),  # fresh prefill, bf16 GQA: flash, no copy
                (1, 256, 32, 8, "causal_tail", False),  # prefill chunk, flash cannot: expanded
                (1, 6, 32, 8, "causal_tail", True),  # batch-1 verify, flash
                (1, 6, 32, 8, "causal_tail", False),  # batch-1 verify, fp32: grouped, no copy
                (1, 256, 32, 32, "causal_tail", False),  # MHA: the lower-right bias as is
                (1, 256, 32, 8, "general", True),  # padded chunk
                (8, 6, 32, 8, "general", True),  # batched verify, rows of different lengths
                (8, 1, 32, 8, "general", True),  # batched decode
                (8, 1, 32, 8, "none", True),  # decode over equal lengths, no mask
                (1, 1, 32, 8, "none", True),
                (8, 64, 32, 32, "general", True),  # MHA: memory-efficient takes the mask
                (1, 600, 32, 8, "causal_tail", True),  # T > L: never lower-right
            ]}
    assert list(cuda.values()) == ["sdpa_causal", "sdpa_causal_expanded", "sdpa_causal", "grouped", "sdpa_causal",
                                   "sdpa_expanded", "grouped", "grouped", "grouped", "sdpa", "sdpa", "sdpa_expanded"]


@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "mha"])
def model(request, tmp_path_factory, tok_dir):
    path = tmp_path_factory.mktemp(f"attn_kv{request.param}")
    make_model(path, tok_dir, seed=3, heads=4, kv_heads=request.param, layers=2)
    return load_model(path, ModelPlan("float32"), "cpu", max_positions=512)


def new_pool(model: Transformer, slots: int):
    s = model.shape
    return make_pool("paged", num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                     max_slots=slots, max_seq_len=384, dtype=model.dtype, device="cpu", block_size=16,
                     num_blocks=None, enable_prefix_caching=False)


def mark_causal_tails(pool) -> None:
    """Checks the pool marks `causal_tail` on exactly the views whose mask is lower-right causal:
    every row appends a chunk of exactly the pass's width to the same length, and the view reads
    exactly its keys."""
    inner = pool.view

    def view(slots, chunk_lens, width=None, **kw):
        lengths = [pool.seq_len(s) for s in slots]
        v = inner(slots, chunk_lens, width, **kw)
        T = width or max(chunk_lens)
        expected = v.needs_mask and len(set(lengths)) == 1 and set(chunk_lens) == {T} \
            and v.key_len == lengths[0] + T and v.groups is None
        assert v.causal_tail == expected, (lengths, chunk_lens, T, v.key_len)
        return v

    pool.view = view


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt) % 300 + 3 for i in range(n)]


# each case: the sequences' lengths before the pass, the chunk each appends, whether the view's
# mask is a causal tail, the CUDA rule's branch per attention group (GQA with flash, GQA without, MHA)
CASES = {
    "fresh_prefill": ([0], [32], True, [("sdpa_causal",), ("sdpa_causal_expanded",), ("sdpa_causal",)]),
    "continued_chunk": ([40], [32], True, [("sdpa_causal",), ("sdpa_causal_expanded",), ("sdpa_causal",)]),
    "verify_batch_1": ([70], [6], True, [("sdpa_causal",), ("grouped",), ("sdpa_causal",)]),
    "padded_chunk": ([40], [20], False, [("sdpa_expanded",), ("sdpa_expanded",), ("sdpa",)]),
    "decode_batched": ([40, 70, 13], [1, 1, 1], False, [("grouped",)] * 3),
    "verify_batched": ([40, 70, 13], [6, 6, 6], False, [("grouped",)] * 3),
    "verify_key_groups": ([5, 7, 150], [6, 6, 6], False, [("grouped", "grouped")] * 2 + [("grouped", "sdpa")]),
    "prefill_batched": ([0, 9], [40, 24], False, [("sdpa_expanded",), ("sdpa_expanded",), ("sdpa",)]),
}


def run_case(model: Transformer, name: str, monkeypatch) -> tuple[torch.Tensor, object]:
    """Fills the case's sequences, then runs its pass; returns the pass's logits [B, T, V] and view."""
    lengths, chunks, _, _ = CASES[name]
    monkeypatch.setattr(protocol, "GROUPED_READ_MIN_SAVED_ROWS", 1 if name == "verify_key_groups" else 10**9)
    pool = new_pool(model, len(lengths))
    mark_causal_tails(pool)
    slots = [pool.allocate_slot([])[0] for _ in lengths]
    for i, (slot, n) in enumerate(zip(slots, lengths)):
        if n:
            forward_chunks(model, pool, [slot], [tokens(n, i)], [0])
    views = []
    inner = pool.view
    pool.view = lambda *a, **kw: views.append(inner(*a, **kw)) or views[-1]
    logits = forward_chunks(model, pool, slots, [tokens(c, 5 + i) for i, c in enumerate(chunks)], lengths,
                            all_logits=True)
    return logits, views[0]


def reference(q, k, v, mask, scale):
    """Attention in float64, K/V repeated to every query head: q [B, H, T, D], k/v [Hkv, B, L, D]."""
    H, Hkv = q.shape[1], k.shape[0]
    keys = k.transpose(0, 1).repeat_interleave(H // Hkv, dim=1).double()  # [B, H, L, D]
    values = v.transpose(0, 1).repeat_interleave(H // Hkv, dim=1).double()
    scores = q.double() @ keys.transpose(-1, -2) * scale  # [B, H, T, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values).float()


@pytest.mark.parametrize("case", list(CASES))
def test_every_branch_gives_the_reference_attention(model, case, monkeypatch):
    """Every attention call of the pass, recomputed by each branch that may take its mask, equals
    the float64 reference (1e-5); a view marked as a causal tail has the lower-right mask."""
    calls = []
    inner = model._attention
    monkeypatch.setattr(model, "_attention", lambda q, k, v, mask, branch=None: calls.append((q, k, v, mask))
                        or inner(q, k, v, mask, branch))
    _, view = run_case(model, case, monkeypatch)
    causal_tail = CASES[case][2]
    assert getattr(view, "causal_tail", False) == causal_tail
    for q, k, v, mask in calls[-model.shape.num_layers * (1 if view.groups is None else len(view.groups)):]:
        want = reference(q, k, v, mask, model.scale)
        if causal_tail:
            T, L = mask.shape[-2:]
            assert torch.equal(mask, torch.ones(T, L, dtype=torch.bool).tril(L - T).expand_as(mask))
        for branch in GENERAL + (CAUSAL if causal_tail else ()):
            torch.testing.assert_close(inner(q, k, v, mask, branch), want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, b=branch: f"{case} {b}: {m}")


@pytest.mark.parametrize("flash", [True, False], ids=["flash_gqa", "no_flash_gqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_cuda_rule_picks_its_branch_and_keeps_the_logits(model, case, flash, monkeypatch):
    """The CUDA rule (forced on CPU) takes the branch the rule names for each pass shape and gives
    the default rule's logits (1e-5)."""
    gqa = model.shape.num_kv_heads != model.shape.num_heads  # (MHA: flash_gqa changes nothing)
    want, _ = run_case(model, case, monkeypatch)
    monkeypatch.setattr(model, "attention_rule", "cuda", raising=False)
    monkeypatch.setattr(model, "flash_gqa", flash, raising=False)
    got, _ = run_case(model, case, monkeypatch)
    assert model.last_attention_branches == CASES[case][3][0 if gqa and flash else 1 if gqa else 2]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_flash_probe_says_no_off_cuda(model):
    """Where torch's flash attention cannot run (here: a CPU), the probe says so, once."""
    fresh = Transformer.__new__(Transformer)
    q, k = torch.zeros(1, 4, 2, 16), torch.zeros(model.shape.num_kv_heads, 1, 5, 16)
    assert fresh._flash_takes_gqa(q, k) is False and fresh.flash_gqa is False
    assert attention_module._CAUSAL_BIAS_TAKES_GQA  # torch's CausalBias forwards enable_gqa


@pytest.mark.parametrize("flash", [True, False], ids=["flash_gqa", "no_flash_gqa"])
def test_greedy_tokens_under_the_cuda_rule_equal_the_default(tiny_model, tiny_draft, flash, monkeypatch):
    """A whole engine (draft-model speculation, batched and alone, fp32) under the CUDA rule, its
    pools marking causal tails, generates the default rule's greedy tokens."""
    from engine import LLM, SamplingParams
    from engine.kv.paged import PagedKVPool

    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "class Point:\n    def __init__(self, x, y):",
               "import os", "for i in range(10):\n    print(i * i)\n" * 3]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def generate() -> list[list[int]]:
        llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
                  speculative_method="draft", spec_policy="fixed", spec_length=4, dtype="float32",
                  max_seq_len=160, max_batch_size=4, block_size=16, forward_plan="torch")
        batched = [o.token_ids for o in llm.generate(prompts, params)]
        return batched + [llm.generate(p, params)[0].token_ids for p in prompts[:2]]

    want = generate()
    inner = PagedKVPool.view
    seen = set()

    def view(self, slots, chunk_lens, width=None, **kw):
        lengths = [self.seq_len(s) for s in slots]
        v = inner(self, slots, chunk_lens, width, **kw)
        T = width or max(chunk_lens)
        v.causal_tail = v.needs_mask and len(set(lengths)) == 1 and set(chunk_lens) == {T} \
            and v.key_len == lengths[0] + T
        seen.add(v.causal_tail)
        return v

    branches = set()
    attention = Transformer._attention

    def recorded(self, q, k, v, mask, branch=None):
        branches.add(branch)
        return attention(self, q, k, v, mask, branch)

    monkeypatch.setattr(PagedKVPool, "view", view)
    monkeypatch.setattr(Transformer, "_attention", recorded)
    monkeypatch.setattr(Transformer, "attention_rule", "cuda")
    monkeypatch.setattr(Transformer, "flash_gqa", flash)
    assert generate() == want
    assert seen == {True, False}  # both kinds of masks were met
    assert {"sdpa_expanded", "grouped", "sdpa"} | ({"sdpa_causal"} if flash else set()) <= branches
