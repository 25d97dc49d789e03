"""Row-count invariance on CUDA (engine/model/kernels/invariant.py, invariance.triton_rule), checked
on CPU under Triton's interpreter in float32 and float16 (the interpreter's bf16 dots are wrong):
the dense linear's rows and the fixed-order attention's rows equal whatever shares their pass; every
family's multi-token pass equals its one-token steps bitwise on the rule, in both pools, where the
plan's paths differ (the teeth); auto's cost bar on CUDA; graph replay held to bitwise under the rule.
The GPU's own verdict comes from `bench gpu` (its correctness section)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelPlan
from engine.model import invariance, transformer
from engine.model.cuda_graphs import self_check
from engine.model.invariance import CUDA_AUTO_COST, check_passes, choose_invariance, triton_rule
from engine.model.kernels import invariant, quant
from engine.model.loader import load_model
from tests.helpers import FAMILIES, make_model, pool_for

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dense_linears_rows_do_not_depend_on_the_rows_beside_them(dtype):
    g = torch.Generator().manual_seed(0)
    N, K = 200, 384
    assert quant.splits(N, K, quant.TILES[dtype][0], 32, quant.INTERPRETER_SMS)[0] > 1  # K splits too
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(48, K, generator=g).to(dtype)
    wide = invariant.dense_linear(x, w)  # [48, N]
    torch.testing.assert_close(wide.float(), F.linear(x.float(), w.float()), atol=2e-2 if dtype == torch.float16 else 1e-4,
                               rtol=1e-2 if dtype == torch.float16 else 1e-5)
    for m in (1, 2, 5, 9, 16, 17, 33):
        for r in (0, 3):
            assert torch.equal(invariant.dense_linear(x[r:r + m], w), wide[r:r + m]), (m, r)
    assert torch.equal(invariant.dense_linear(x[:6].view(2, 3, K), w), wide[:6].view(2, 3, N))
    with pytest.raises(ValueError, match="dense"):
        invariant.dense_linear(x, w.to_sparse())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_order_attention_rows_are_their_own(dtype):
    """SDPA's values; a verify row = the decode step of its token (its keys alone), alone or in a
    batch; a row over scattered keys = the same keys gathered, whatever the masked keys hold; a
    row that sees no key gives zeros; strided K/V (a pool's slice) read in place."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, L, T = 3, 4, 2, 16, 150, 5
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    pool_k, pool_v = (torch.randn(2, Hkv, B, L, D, generator=g).to(dtype) for _ in range(2))
    k, v = pool_k[1], pool_v[0]  # strided views
    seen = torch.ones(B, 1, T, L, dtype=torch.bool).tril(L - T)  # [B, 1, T, L] lower-right causal
    out = invariant.fixed_order_attention(q, k, v, seen, D ** -0.5)  # [B, H, T, D]
    want = F.scaled_dot_product_attention(q.float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
                                          attn_mask=seen, scale=D ** -0.5, enable_gqa=True)
    torch.testing.assert_close(out.float(), want, atol=2e-3 if dtype == torch.float16 else 1e-5, rtol=1e-3)
    for t in range(T):
        n = L - T + t + 1
        step = invariant.fixed_order_attention(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], None, D ** -0.5)
        assert torch.equal(step[:, :, 0], out[:, :, t]), t
    assert torch.equal(invariant.fixed_order_attention(q[1:2], k[:, 1:2], v[:, 1:2], seen[1:2], D ** -0.5), out[1:2])
    keep = torch.zeros(L, dtype=torch.bool)
    keep[torch.randperm(L, generator=g)[:70]] = True
    noisy_k, noisy_v = k[:, :1].clone(), v[:, :1].clone()
    noisy_k[:, :, ~keep], noisy_v[:, :, ~keep] = float("nan"), float("nan")
    scattered = invariant.fixed_order_attention(q[:1, :, :1], noisy_k, noisy_v, keep.view(1, 1, 1, L), D ** -0.5)
    gathered = invariant.fixed_order_attention(q[:1, :, :1], k[:, :1, keep], v[:, :1, keep], None, D ** -0.5)
    assert torch.equal(scattered, gathered)
    blind = invariant.fixed_order_attention(q[:1, :, :1], k[:, :1], v[:, :1], torch.zeros(1, 1, 1, L, dtype=torch.bool), 1.0)
    assert torch.equal(blind, torch.zeros_like(blind))
    with pytest.raises(ValueError, match="head_dim"):
        invariant.fixed_order_attention(q[..., :12], k[..., :12], v[..., :12], None, 1.0)


@pytest.fixture(scope="module")
def dense_models(tmp_path_factory, tok_dir):
    """Each family's toy target as CUDA holds it: plain dense weights (no oneDNN reorder), fused kernels on."""
    saved = transformer.onednn_reorders
    transformer.onednn_reorders = lambda dtype: False
    models = {}
    try:
        for name, kw in FAMILIES.items():
            path = tmp_path_factory.mktemp(f"cuda_rule_{name}")
            make_model(path, tok_dir, seed=3, vocab_size=512, hidden=32, heads=2, kv_heads=1, intermediate=64,
                       **{**kw, "head_dim": 16})  # small: every kernel runs interpreted
            for dtype in ("float32", "float16") if name == "llama" else ("float32",):
                model = load_model(path, ModelPlan(dtype), "cpu", 256)
                model.fused = True  # the fused kernels, as the load-time check leaves them on CUDA
                models[name, dtype] = model
    finally:
        transformer.onednn_reorders = saved
    return models


SHAPES = ((1, 70, 3), (3, 12, 2), (2, 9, 17))  # (batch, context, tokens): past one key block; ragged; > 16 rows
CASES = [("llama", "float32", "paged", SHAPES), ("llama", "float32", "slotted", SHAPES[1:2]),
         ("llama", "float16", "paged", SHAPES[:1]), ("qwen3", "float32", "paged", SHAPES[2:]),
         ("qwen2", "float32", "slotted", SHAPES[:1]), ("mistral", "float32", "paged", SHAPES[1:2])]


@pytest.mark.parametrize(("name", "dtype", "backend", "shapes"), CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_the_cuda_rule_makes_a_pass_equal_its_steps_bitwise(dense_models, name, dtype, backend, shapes):
    """Each family (qwen3: q/k norms in the fused kernel; qwen2: biases) and both pools, a few
    shapes each: the interpreter takes seconds a pass."""
    model = dense_models[name, dtype]
    assert triton_rule(model) is None
    try:
        assert model.attention_rule == "cuda_fixed_order" and model.row_invariant
        pool = pool_for(model, backend, max_slots=8, max_seq_len=256, block_size=16)
        for batch, context, tokens in shapes:
            assert check_passes(model, pool, context, tokens, batch) is None, (batch, context, tokens)
    finally:
        model.make_row_invariant(None)


def test_the_plan_paths_differ_where_the_cuda_rule_agrees(dense_models):
    """The teeth: the same toy target off the rule (F.linear, SDPA) gives other bits at a verify pass."""
    model = dense_models["llama", "float32"]
    assert not model.row_invariant
    pool = pool_for(model, "paged", max_slots=8, max_seq_len=256)
    assert check_passes(model, pool, 70, 5, 1) is not None


def test_the_cuda_rule_needs_the_fused_kernels_and_plain_weights(dense_models, tiny_model):
    model = dense_models["qwen3", "float32"]
    model.fused = False
    try:
        assert "fused_kernels" in triton_rule(model) and not model.row_invariant
    finally:
        model.fused = True
    reordered = load_model(tiny_model[0], ModelPlan("float32"), "cpu", 256)  # oneDNN's weights on this CPU
    reordered.fused = True
    if transformer.onednn_reorders(torch.float32):
        assert "oneDNN" in triton_rule(reordered) and not reordered.row_invariant


def test_auto_on_cuda_keeps_the_rule_only_within_its_cost(dense_models, monkeypatch, tmp_path):
    """auto on CUDA: the harness passes, then the rule stays only where its passes cost at most
    CUDA_AUTO_COST the plan's; the ratio is cached, so a restart measures nothing."""
    model = dense_models["llama", "float32"]
    monkeypatch.setattr(model, "device", torch.device("cuda"))  # no tensor is made here: the rule and timing are scripted
    monkeypatch.setattr(invariance, "_rule_checked", lambda m: triton_rule(m))
    for ratio, verdict in ((CUDA_AUTO_COST + 0.1, "off"), (CUDA_AUTO_COST - 0.01, "on")):
        cache = tmp_path / f"{ratio}.json"
        monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes, r=ratio: r)
        state = choose_invariance(model, "auto", True, cache)
        assert state.startswith(verdict) and model.row_invariant == (verdict == "on"), state
        monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes: pytest.fail("measured again"))
        assert choose_invariance(model, "auto", True, cache).startswith(verdict)
    model.make_row_invariant(None)
    monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes: pytest.fail("on is not measured"))
    assert choose_invariance(model, "on", True, tmp_path / "on.json") == "on"
    model.make_row_invariant(None)


def test_graph_replay_is_held_to_bitwise_under_the_rule(dense_models):
    """self_check: a replay one ulp off eager passes as rounding on the plan's paths, and fails
    under row-count invariance."""
    model = dense_models["llama", "float32"]

    class Nudged:  # a CapturedPasses whose replays are eager's logits, one ulp up
        kinds = [type("Kind", (), {"width": 1, "extra": None, "tree": False})()]
        batches, keys, extra_dtype = [2], [64], torch.float32

        def fn(self, ids, positions, view, extra):
            return (model.forward(ids, positions, view),)

        def run(self, ids, positions, view, extra, keys):
            return tuple(torch.nextafter(t, torch.full_like(t, float("inf"))) for t in self.fn(ids, positions, view, extra))

    pool = pool_for(model, "paged", max_slots=4, max_seq_len=128)
    assert self_check(Nudged(), model, pool) is None
    assert triton_rule(model) is None
    try:
        assert "replay differs" in self_check(Nudged(), model, pool)
    finally:
        model.make_row_invariant(None)
