"""The forward's paths against transformers and each other: long-context decode, bf16 checkpoints on
CPUs without bf16 kernels, row invariance of the kernels exact greedy speculation rests on (fp32).
Every family's logits and greedy output against transformers: test_model_families.py."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelPlan
from engine.model import linears
from engine.model.loader import load_model, read_shape
from engine.model.passes import forward_chunks
from tests.helpers import make_model, pool_for

F32 = ModelPlan("float32")

@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_long_context_single_token_decode_matches_transformers(tmp_path, tok_dir, backend):
    """Decode steps over > 128 keys take the explicit-attention path; batched rows differ in length."""
    hf = make_model(tmp_path, tok_dir, seed=4)
    ours = load_model(tmp_path, F32, "cpu", max_positions=512)
    pool = pool_for(ours, backend, block_size=8)
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


def test_a_cpu_without_bf16_kernels_plans_float32_for_a_bf16_model(tmp_path, tok_dir, monkeypatch):
    """Where oneDNN cannot reorder bf16 (AVX2-only CPUs, simulated here), every candidate plan of a
    bf16 model computes in float32: the checkpoint's bf16 weights upcast exactly, a float32 KV
    pool, bit for bit what a float32 load computes."""
    from engine.model import plan as plan_module

    if not linears.onednn_reorders(torch.float32):
        pytest.skip("oneDNN weight reordering is not available in this torch build")
    monkeypatch.setattr(plan_module, "onednn_reorders", lambda dtype: dtype == torch.float32)
    make_model(tmp_path, tok_dir, seed=5, dtype=torch.bfloat16)
    shape = read_shape(tmp_path)
    for role in ("target", "draft"):
        assert {p.dtype for p in plan_module.candidates(role, "bfloat16", "cpu", shape)} == {"float32"}
    assert {p.dtype for p in plan_module.candidates("target", "bfloat16", "cuda", shape)} == {"bfloat16"}
    model = load_model(tmp_path, plan_module.candidates("target", "bfloat16", "cpu", shape)[0], "cpu", max_positions=256)
    reference = load_model(tmp_path, F32, "cpu", max_positions=256)
    torch.manual_seed(1)
    ids = torch.randint(0, reference.shape.vocab_size, (2, 40))
    logits = []
    for m in (reference, model):
        pool = pool_for(m, max_slots=2, max_seq_len=128)
        assert pool.storage.dtype == torch.float32
        slots = [pool.allocate_slot([])[0] for _ in range(2)]
        logits.append(forward_chunks(m, pool, slots, ids.tolist(), [0, 0], all_logits=True))
    assert torch.equal(logits[0], logits[1])


def test_reordered_float32_rows_do_not_depend_on_the_batch():
    """The property exact greedy speculation rests on: a row's result is bit-identical whether
    it is computed alone, in a verify pass of a few rows, or in a large batch."""

    if not linears.onednn_reorders(torch.float32):
        pytest.skip("oneDNN weight reordering is not available in this torch build")
    torch.manual_seed(0)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1024, 512))  # [out, in]
    x = torch.randn(64, 512)  # [rows, in]
    full = linears.reordered_linear(x, packed)  # [64, out]
    for rows in (1, 2, 5, 6, 9, 33):
        assert torch.equal(linears.reordered_linear(x[:rows], packed), full[:rows])


def _prefill_then_steps(model_dir, m) -> tuple[torch.Tensor, torch.Tensor]:
    """The same 40 random tokens through `m`: a 30-token prefill pass (all its logits,
    [1, 30, vocab]) and then ten one-row decode steps ([10, vocab])."""
    torch.manual_seed(2)
    ids = torch.randint(0, m.shape.vocab_size, (40,)).tolist()
    pool = pool_for(m, max_slots=1, max_seq_len=128)
    slot = pool.allocate_slot([])[0]
    prefill = forward_chunks(m, pool, [slot], [ids[:30]], [0], all_logits=True)  # [1, 30, vocab]
    steps = [forward_chunks(m, pool, [slot], [[t]], [30 + i]) for i, t in enumerate(ids[30:])]
    return prefill, torch.cat(steps)  # [10, vocab]


@pytest.mark.parametrize("hidden", [256, 512])
def test_float32_rms_norm_matches_torch_and_rows_do_not_depend_on_the_batch(tmp_path, tok_dir, hidden):
    """The hand-written float32 RMSNorm agrees with F.rms_norm, and a row's bits do not depend on
    how many rows share the call (what exact greedy speculation needs from every op)."""
    import torch.nn.functional as F

    make_model(tmp_path, tok_dir, seed=4)
    model = load_model(tmp_path, F32, "cpu", max_positions=64)
    torch.manual_seed(0)
    x = torch.randn(64, 7, hidden) * 3  # [B, T, hidden]
    w = torch.randn(hidden)
    full = model._rms_norm(x, w)
    torch.testing.assert_close(full, F.rms_norm(x, (hidden,), w, eps=model.shape.rms_norm_eps), atol=1e-6, rtol=1e-6)
    for b, t in ((1, 1), (1, 6), (5, 1), (33, 7)):
        assert torch.equal(model._rms_norm(x[:b, :t], w), full[:b, :t])


@pytest.mark.parametrize("checkpoint_dtype", [torch.float32, torch.bfloat16])
def test_a_target_runs_one_sequence_passes_on_the_cpu_kernel_row_invariantly(tmp_path, tok_dir, checkpoint_dtype):
    """A target's passes over one sequence take the one-sequence CPU kernel, on bf16 weights when
    the checkpoint holds bf16 values: its logits are close to oneDNN's, a 10-token pass (a verify
    pass) agrees with ten one-token steps to float32 rounding (the matmuls are bit-identical, see
    the next test; attention at 10 queries and at 1 rounds differently) and picks the same greedy
    tokens; passes over two sequences keep oneDNN's kernels, bit-identical to a load without it."""
    from engine.model.kernels import one_sequence

    if one_sequence.load() is None:
        pytest.skip("the one-sequence CPU kernel does not build on this machine")
    make_model(tmp_path, tok_dir, seed=5, dtype=checkpoint_dtype)
    target = load_model(tmp_path, ModelPlan("float32", one_sequence_kernel=True), "cpu", max_positions=256)
    onednn = load_model(tmp_path, F32, "cpu", max_positions=256)
    few = target._one_sequence
    assert few is not None and onednn._one_sequence is None
    assert {lw.gate_up.blocks.dtype for lw in few.layers} == {checkpoint_dtype}
    assert few.lm_head.blocks.dtype == checkpoint_dtype
    calls = []

    def counted(x, w):
        calls.append(x.shape[:-1])
        return few.kernel(x, w)

    target._one_sequence = few._replace(kernel=counted)
    prefill, steps = _prefill_then_steps(tmp_path, target)  # [1, 30, vocab], [10, vocab]
    _, reference_steps = _prefill_then_steps(tmp_path, onednn)
    # the 30-token prefill and the ten steps each ran every layer's four matmuls and the output layer
    assert len(calls) == 11 * (4 * target.shape.num_layers + 1)
    torch.testing.assert_close(steps, reference_steps, atol=1e-4, rtol=1e-4)
    # the same ten tokens again, as one pass (a verify pass of K = 9)
    torch.manual_seed(2)
    ids = torch.randint(0, target.shape.vocab_size, (40,)).tolist()
    pool = pool_for(target, max_slots=2, max_seq_len=128)
    slot = pool.allocate_slot([])[0]
    forward_chunks(target, pool, [slot], [ids[:30]], [0])
    verify = forward_chunks(target, pool, [slot], [ids[30:]], [30], all_logits=True)[0]  # [10, vocab]
    torch.testing.assert_close(verify, steps, atol=1e-5, rtol=1e-5)
    assert torch.equal(verify.argmax(-1), steps.argmax(-1))
    # two sequences: oneDNN's kernels, as without the one-sequence kernel
    calls.clear()
    two = {}
    for name, m in (("target", target), ("onednn", onednn)):
        pool = pool_for(m, max_slots=2, max_seq_len=128)
        slots = [pool.allocate_slot([])[0] for _ in range(2)]
        two[name] = forward_chunks(m, pool, slots, [ids[:12], ids[12:24]], [0, 0])  # [2, vocab]
    assert torch.equal(two["target"], two["onednn"]) and not calls


def test_the_one_sequence_kernels_rows_do_not_depend_on_the_pass():
    """Each output row is the same bits whatever the number of rows in the call (1 to 30, across
    the kernels' groups of up to 12, split evenly) and the number of threads, for both kernels:
    the row kernel (a proposer's cached weights) and the column-block kernel (a target's streamed
    weights, packed; outputs not a multiple of 16 padded and cut); bf16 weights give the bits of
    their float32 copies."""
    from engine.model.kernels import one_sequence

    kernels = one_sequence.load()
    if kernels is None:
        pytest.skip("the one-sequence CPU kernel does not build on this machine")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for out_features in (72, 13, 100):  # 13 outputs: fewer per thread, split unevenly
            w = torch.randn(out_features, 136).bfloat16()  # [out, in]
            x = torch.randn(30, 136)  # [rows, in]
            by_rows = kernels.linear(x, w)  # [30, out]
            by_columns = kernels.column_linear(x, one_sequence.to_column_blocks(w))  # [30, out]
            for full in (by_rows, by_columns):
                torch.testing.assert_close(full, x @ w.float().T, atol=1e-4, rtol=1e-4)
            assert torch.equal(by_rows, kernels.linear(x, w.float()))
            assert torch.equal(by_columns, kernels.column_linear(x, one_sequence.to_column_blocks(w.float())))
            for n_threads in (1, 3):
                torch.set_num_threads(n_threads)
                for rows in (1, 2, 3, 4, 6, 7, 8, 9, 12, 13, 17, 24, 25):
                    assert torch.equal(kernels.linear(x[:rows], w), by_rows[:rows])
                    assert torch.equal(kernels.column_linear(x[:rows], one_sequence.to_column_blocks(w)), by_columns[:rows])
            torch.set_num_threads(threads)
            assert kernels.linear(x[:20].view(4, 5, 136), w).shape == (4, 5, out_features)
            packed = one_sequence.to_column_blocks(w)
            assert kernels.column_linear(x[:20].view(4, 5, 136), packed).shape == (4, 5, out_features)
        # the column-block kernel takes any input width (the row kernel, multiples of 8)
        w, x = torch.randn(40, 37).bfloat16(), torch.randn(9, 37)
        odd = kernels.column_linear(x, one_sequence.to_column_blocks(w))  # [9, 40]
        torch.testing.assert_close(odd, x @ w.float().T, atol=1e-4, rtol=1e-4)
        assert torch.equal(kernels.column_linear(x[:1], one_sequence.to_column_blocks(w)), odd[:1])
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            one_sequence.to_column_blocks(w.half())
    finally:
        torch.set_num_threads(threads)


def test_the_column_block_kernel_sums_each_output_in_order_of_k():
    """Each output of the column-block kernel is one chain of fused multiply-adds over k in order,
    so it equals a float32 running sum of the products (fused: each product rounded only with its
    addition; with products exact in float32 the two agree bit for bit)."""
    from engine.model.kernels import one_sequence

    kernels = one_sequence.load()
    if kernels is None:
        pytest.skip("the one-sequence CPU kernel does not build on this machine")
    torch.manual_seed(1)
    # small integers times powers of two: every product is exact, every partial sum rounds
    w = (torch.randint(-8, 9, (32, 40)) * 2.0 ** torch.randint(-12, 12, (32, 40))).float()  # [out, in]
    x = (torch.randint(-8, 9, (3, 40)) * 2.0 ** torch.randint(-12, 12, (3, 40))).float()  # [rows, in]
    running = torch.zeros(3, 32)
    for k in range(40):
        running = running + x[:, k:k + 1] * w[:, k]
    assert torch.equal(kernels.column_linear(x, one_sequence.to_column_blocks(w)), running)
