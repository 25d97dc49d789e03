"""Row-count invariance (engine/model/invariance.py): on the shipped target in bf16 and float32, a
multi-token pass computes bitwise what one-token steps compute (logits and the K/V written), in
both pools, at batch 1 and 8; the plan's own paths do not (the harness's teeth); the probe, the
fixed-order attention kernel and the load-time choice."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelPlan
from engine.model.invariance import check_passes, choose_invariance, linear_rows_rule
from engine.model.kernels import one_sequence
from engine.model.linears import at_least_rows, onednn_reorders
from engine.model.loader import load_model
from engine.model.passes import pool_for
from tests.helpers import REPO

needs_bf16 = pytest.mark.skipif(not onednn_reorders(torch.bfloat16), reason="this CPU has no bf16 matmul kernels")
needs_kernels = pytest.mark.skipif(one_sequence.load() is None, reason="the CPU kernels do not build here")
DTYPES = [pytest.param("bfloat16", marks=needs_bf16), pytest.param("float32", marks=needs_kernels)]


@pytest.fixture(scope="module", params=DTYPES)
def target(request):
    """The shipped target in each dtype, on the plan's own paths."""
    return load_model(REPO / "models" / "target", ModelPlan(request.param), "cpu", 1024)


@pytest.fixture
def invariant(target):
    assert choose_invariance(target, "on") == "on"
    yield target
    target.make_row_invariant(None)


@pytest.mark.parametrize("backend", ["paged", "slotted"])
@pytest.mark.parametrize("batch", [1, 8])
def test_a_pass_equals_its_steps_bitwise(invariant, backend, batch):
    pool = pool_for(invariant, 16, 1024, backend)
    for context in (40, 300):
        for tokens in (2, 5, 17):  # a verify pass, K = 4, and wider than the few-query rule
            assert check_passes(invariant, pool, context, tokens, batch) is None, (context, tokens)


@needs_kernels
def test_the_rule_attends_in_fixed_order_where_the_kernels_build(invariant):
    """Both dtypes' rules take fixed-order attention (bf16: faster than the grouped matmuls, which
    stay the rule's attention only where the kernels cannot build)."""
    assert invariant.attention_rule == "cpu_fixed_order"


def test_todays_rule_differs(target):
    """The teeth: the plan's own paths (bf16: SDPA at batch 1, oneDNN's one-row kernel; float32:
    oneDNN's rows and the batched matmuls' key blocking) give other bits."""
    assert not target.row_invariant
    pool = pool_for(target, 4, 1024, "paged")
    assert check_passes(target, pool, 300, 5, 1) is not None


@needs_kernels
def test_fixed_order_attention():
    """The float32 rule's attention: SDPA's values, and a verify row's bits = the decode step of the
    same token (its keys alone), alone or in a batch; bf16 K/V = their float32 copies; a row that
    sees no key gives zeros."""
    import torch.nn.functional as F
    kernels = one_sequence.load()
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, L, T = 3, 8, 4, 64, 300, 5
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(Hkv, B, L, D, generator=g), torch.randn(Hkv, B, L, D, generator=g)
    seen = torch.ones(B, 1, T, L, dtype=torch.bool).tril(L - T)  # [B, 1, T, L] lower-right causal
    out = kernels.attention(q, k, v, seen, 0.125)  # [B, H, T, D]
    want = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=seen, scale=0.125,
                                          enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-5)
    for t in range(T):
        n = L - T + t + 1
        assert torch.equal(kernels.attention(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], None, 0.125)[:, :, 0], out[:, :, t])
    assert torch.equal(kernels.attention(q[1:2], k[:, 1:2], v[:, 1:2], seen[1:2], 0.125), out[1:2])
    assert torch.equal(kernels.attention(q, k.bfloat16(), v.bfloat16(), seen, 0.125),
                       kernels.attention(q, k.bfloat16().float(), v.bfloat16().float(), seen, 0.125))
    seen[0, 0, 0] = False
    assert torch.equal(kernels.attention(q, k, v, seen, 0.125)[0, :, 0], torch.zeros(H, D))
    # a tree node's or a packed row's keys need not be a prefix: a row over scattered keys, garbage
    # (NaN) in the rest, = the same keys gathered in order, unmasked (sums run by a key's rank, never
    # its index); its ranks cross a lane block of 8 at several offsets
    for keys in (torch.arange(0, L, 3), torch.arange(37, 59), torch.tensor([5, 6, 90, 91, 92, 250, 299])):
        row = torch.zeros(1, 1, 1, L, dtype=torch.bool)
        row[..., keys] = True
        dirty_k, dirty_v = k[:, :1].clone(), v[:, :1].clone()
        dirty_k[:, :, ~row[0, 0, 0]] = float("nan")
        dirty_v[:, :, ~row[0, 0, 0]] = float("nan")
        scattered = kernels.attention(q[:1, :, :1], dirty_k, dirty_v, row, 0.125)
        assert torch.equal(scattered, kernels.attention(q[:1, :, :1], k[:, :1, keys], v[:, :1, keys], None, 0.125))
    with pytest.raises(ValueError, match="head_dim"):
        kernels.attention(q[..., :60], k[..., :60], v[..., :60], None, 0.125)


def test_at_least_rows_pads_one_row_only():
    seen = []

    def linear(x, w):
        seen.append(tuple(x.shape))
        return x @ w.T
    w = torch.randn(3, 4)
    padded = at_least_rows(linear, frozenset({4}))
    x = torch.randn(1, 1, 4)
    assert torch.equal(padded(x, w), x @ w.T) and seen[-1] == (2, 4)
    assert padded(torch.randn(2, 5, 4), w).shape == (2, 5, 3) and seen[-1] == (2, 5, 4)
    assert at_least_rows(linear, frozenset({8}))(x, w).shape == (1, 1, 3) and seen[-1] == (1, 1, 4)


def test_the_probe_finds_row_dependence():
    """A linear whose rows change from one row count to another is refused; one whose single row
    alone differs needs two rows; an exact one needs one."""
    w, k = [torch.randn(8, 16)], [16]
    exact = lambda x, w: (x.double() @ w.double().T).float()  # noqa: E731
    one_row = lambda x, w: exact(x, w) + (1e-3 if x.shape[0] == 1 else 0.0)  # noqa: E731
    by_count = lambda x, w: exact(x, w) + 1e-3 * x.shape[0]  # noqa: E731
    assert linear_rows_rule(exact, w, k, torch.float32, torch.device("cpu"))[0] == frozenset()
    if one_sequence.load() is not None:  # the float32 rule's column-block kernel, on the shipped target's weights
        model = load_model(REPO / "models" / "target", ModelPlan("float32", one_sequence_kernel=True), "cpu", 64)
        assert linear_rows_rule(*model.linear_probe(columns=True), torch.float32, torch.device("cpu"))[0] == frozenset()
    assert linear_rows_rule(one_row, w, k, torch.float32, torch.device("cpu"))[0] == {16}
    # oneDNN's bf16 one-row kernel differs at some alignments of the row only (1408 wide: 160 of 2048
    # offsets): one that differs off a 64-byte boundary's 20th byte alone is found
    aligned_off = lambda x, w: exact(x, w) + (1e-3 if x.shape[0] == 1 and x.data_ptr() % 64 == 20 else 0.0)  # noqa: E731
    assert linear_rows_rule(aligned_off, w, k, torch.float32, torch.device("cpu"))[0] == {16}
    rows, why = linear_rows_rule(by_count, w, k, torch.float32, torch.device("cpu"))
    assert rows is None and "differ" in why


def test_auto_backs_off_where_the_harness_fails(target, monkeypatch):
    rule = target.attention_rule
    monkeypatch.setattr("engine.model.invariance.check_passes", lambda *a, **k: "logits differ (scripted)")
    assert choose_invariance(target, "auto") == "off: logits differ (scripted)"
    assert not target.row_invariant and target.attention_rule == rule
    assert choose_invariance(target, "on") == "on" and target.row_invariant
    target.make_row_invariant(None)
    assert choose_invariance(target, "off").startswith("off")
    assert choose_invariance(target, "auto", speculative=False).startswith("off: ")  # harness or plan
    assert not target.row_invariant


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(model="x", batch_invariant="yes")
    assert EngineConfig(model="x", device="cuda", batch_invariant="on").batch_invariant == "on"  # built for CUDA now


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_speculation_equals_plain(dtype: str):
    """Every proposer, batch 1 and 3, the shipped pair in each dtype: token for token."""
    from engine import LLM, SamplingParams
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\nimport sys\n\ndef main("]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(dtype=dtype, forward_plan={"target": {"dtype": dtype}}, max_batch_size=4)

    def run(llm, batch):
        return [o.token_ids for i in range(0, len(prompts), batch) for o in llm.generate(prompts[i:i + batch], params)]
    plain = LLM(use_speculative_decoding=False, batch_invariant="on", **common)  # the speculative engines' rule
    assert plain.engine.stats()["batch_invariant"] == "on"
    want = {b: run(plain, b) for b in (1, 3)}
    assert want[1] == want[3]  # a request alone = the same request in a batch
    for method in ("eagle", "draft", "hybrid", "ngram", "suffix"):
        llm = LLM(speculative_method=method, **common)
        for b in (1, 3):
            assert run(llm, b) == want[b], (method, b)


@needs_bf16
@needs_kernels
def test_a_plain_only_bf16_engine_weighs_the_rule_too(monkeypatch):
    """bf16's rule adds no weights, so a plain-only bf16 engine measures it like float32's: the real
    measurement leaves the bf16 rule on (oneDNN's weights, padded widths, fixed-order attention);
    a scripted ratio below 1 keeps it, above 1 turns it off."""
    import engine.model.invariance as invariance

    model = load_model(REPO / "models" / "target", ModelPlan("bfloat16"), "cpu", 256)
    assert choose_invariance(model, "on") == "on"
    ratio = invariance.decode_cost_ratio(model, repeats=1)
    assert ratio > 0 and model.row_invariant and not model.columns_always
    assert model.attention_rule == "cpu_fixed_order"
    model.make_row_invariant(None)
    monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes: 0.9)
    assert choose_invariance(model, "auto", speculative=False) == "on" and model.row_invariant
    model.make_row_invariant(None)
    monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes: 1.1)
    assert choose_invariance(model, "auto", speculative=False).startswith("off: a plain-only engine's decode passes")
    assert not model.row_invariant


@needs_kernels
def test_a_pass_the_rule_cannot_run_leaves_it_off(monkeypatch):
    """A harness pass that raises (a shape the fixed-order kernels refuse) turns the rule off with
    the reason, under "on" too, instead of failing the load or every later pass."""
    model = load_model(REPO / "models" / "target", ModelPlan("float32"), "cpu", 256)

    def refuses(*args, **kwargs):
        raise ValueError("fixed-order attention takes head_dim a multiple of 8 (scripted)")
    monkeypatch.setattr("engine.model.invariance.check_passes", refuses)
    for setting in ("auto", "on"):
        verdict = choose_invariance(model, setting)
        assert verdict.startswith("off: the harness failed") and "head_dim" in verdict and not model.row_invariant


@needs_kernels
def test_a_plain_only_engine_takes_the_rule_where_its_decode_passes_run_faster_on_it(monkeypatch, tmp_path):
    """auto in a plain-only engine: float32 with the plan's one-sequence kernel is put on the rule
    when its decode passes are measured faster there (the measured ratio scripted here; timings are
    not asserted), and left on the plan's paths otherwise; a cached ratio is read, not measured
    again (a restart keeps its verdict); other plans are never measured."""
    import engine.model.invariance as invariance

    model = load_model(REPO / "models" / "target", ModelPlan("float32", one_sequence_kernel=True), "cpu", 256)
    rule = model.attention_rule
    ratio = invariance.decode_cost_ratio(model, repeats=1)  # the real measurement: leaves the rule on
    assert ratio > 0 and model.row_invariant and model.columns_always
    model.make_row_invariant(None)
    monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes: 0.8)
    assert choose_invariance(model, "auto", speculative=False) == "on" and model.row_invariant
    model.make_row_invariant(None)
    monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes: 1.2)
    verdict = choose_invariance(model, "auto", speculative=False)
    assert verdict.startswith("off: a plain-only engine's decode passes took 1.20x")
    assert not model.row_invariant and not model.columns_always and model.attention_rule == rule

    cache = tmp_path / "rule.json"
    monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes: 0.9)
    assert choose_invariance(model, "auto", speculative=False, cache=cache) == "on"
    model.make_row_invariant(None)
    monkeypatch.setattr(invariance, "decode_cost_ratio", lambda m, shapes: 1.1)  # a noisier start: the cache holds
    assert choose_invariance(model, "auto", speculative=False, cache=cache) == "on"
    model.make_row_invariant(None)

    def unmeasured(m, shapes):
        raise AssertionError("measured a plan the rule would add weights to")
    monkeypatch.setattr(invariance, "decode_cost_ratio", unmeasured)
    plain_plan = load_model(REPO / "models" / "target", ModelPlan("float32"), "cpu", 256)
    assert choose_invariance(plain_plan, "auto", speculative=False).startswith("off: a plain-only engine keeps")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_family_passes_the_harness(tmp_path, tok_dir, family, dtype):
    """Every family the engine serves (Qwen2's biases, Qwen3's q/k norms and wide heads included),
    random-init, in each dtype and both pools: on the rule a pass of 2-33 tokens equals its
    one-token steps bitwise, logits and K/V, at batch 1 (contexts 40 and 300) and 8 (40)."""
    from tests.helpers import FAMILIES, make_model

    make_model(tmp_path, tok_dir, seed=3, hidden=128, heads=4, kv_heads=2, intermediate=1408, max_pos=512,
               dtype=torch.bfloat16, **FAMILIES[family])  # 1408: a width oneDNN's one-row kernel differs at
    model = load_model(tmp_path, ModelPlan(dtype), "cpu", 512)
    assert choose_invariance(model, "on") == "on"
    for backend in ("paged", "slotted"):
        pool = pool_for(model, 16, 512, backend)
        for batch, context in ((1, 40), (1, 300), (8, 40)):
            for tokens in (2, 5, 9, 17, 33):
                assert check_passes(model, pool, context, tokens, batch) is None, (backend, batch, context, tokens)


@needs_bf16
@needs_kernels
def test_a_bf16_model_runs_its_one_sequence_passes_in_float32(caplog):
    """bf16 + the one-sequence kernel (a plain-only target's plan): a pass over one sequence runs in
    float32 on the column-block kernel, its K/V stored in the pool's bf16, its logits within bf16's
    rounding of the bf16 plan's; on the bf16 rule it takes oneDNN's passes like every other, so the
    harness holds."""
    plain = load_model(REPO / "models" / "target", ModelPlan("bfloat16"), "cpu", 256)
    kernel = load_model(REPO / "models" / "target", ModelPlan("bfloat16", one_sequence_kernel=True), "cpu", 256)
    calls = []
    few = kernel._one_sequence
    kernel._one_sequence = few._replace(kernel=lambda x, w: calls.append(x.dtype) or few.kernel(x, w))
    pools = [pool_for(m, 2, 256) for m in (plain, kernel)]
    ids = torch.randint(3, plain.shape.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    from engine.model.passes import forward_chunks
    logits = [forward_chunks(m, p, [p.allocate_slot([])[0]], [ids], [0]) for m, p in zip((plain, kernel), pools)]
    assert calls and set(calls) == {torch.float32} and pools[1].storage[0].dtype == torch.bfloat16
    torch.testing.assert_close(logits[1], logits[0], atol=0.1, rtol=0.05)
    calls.clear()
    assert choose_invariance(kernel, "on") == "on" and not calls  # the rule: oneDNN only
    assert any("one_sequence_kernel takes no pass" in r.getMessage() for r in caplog.records)  # said, not silent
