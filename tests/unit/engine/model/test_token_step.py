"""A draft's narrow passes as whole-model C calls (engine.model.token_step) against its torch forward."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelPlan
from engine.model.kernels import one_sequence
from engine.model.loader import load_model
from engine.model.passes import forward_chunks
from engine.model.token_step import TOKEN_STEP_ROWS, WeightKind
from tests.helpers import make_model, pool_for

needs_kernels = pytest.mark.skipif(one_sequence.load() is None, reason="the CPU kernels do not build here")


def _passes(model_dir, model, backend: str, rows: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Three sequences prefilled together, then one-token steps of the first (past its third
    16-token block, so a paged pool's blocks stop being consecutive), a 3-token chunk, two
    sequences stepping together, two sequences taking 3-token chunks together, then 1 and 3 tokens
    (a padded pass), a chunk of `rows` tokens (the widest a token step of that width takes) and a
    chunk one token wider. Returns each pass's logits, the KV storage before the widest chunk and
    after it (but its scratch row)."""
    pool = pool_for(model, backend, max_slots=4, max_seq_len=128)
    torch.manual_seed(1)
    ids = torch.randint(0, model.shape.vocab_size, (3, 100)).tolist()
    slots = [pool.allocate_slot([])[0] for _ in range(3)]
    out = [forward_chunks(model, pool, slots, [s[:40] for s in ids], [0, 0, 0])]  # [3, vocab]
    for i in range(40, 52):
        out.append(forward_chunks(model, pool, slots[:1], [ids[0][i:i + 1]], [i]))  # [1, vocab]
    out.append(forward_chunks(model, pool, slots[:1], [ids[0][52:55]], [52]))  # [1, vocab]
    for i in range(40, 44):
        out.append(forward_chunks(model, pool, slots[1:], [ids[1][i:i + 1], ids[2][i:i + 1]], [i, i]))  # [2, vocab]
    out.append(forward_chunks(model, pool, slots[1:], [ids[1][44:47], ids[2][44:47]], [44, 44]))  # [2, vocab]
    out.append(forward_chunks(model, pool, slots[1:], [ids[1][47:48], ids[2][47:50]], [47, 47]))  # [2, vocab]: 1 + 3 rows
    out.append(forward_chunks(model, pool, slots[:1], [ids[0][55:55 + rows]], [55]))  # [1, vocab]
    before_wide = pool.storage.clone()
    out.append(forward_chunks(model, pool, slots[:1], [ids[0][55 + rows:56 + 2 * rows]], [55 + rows]))  # [1, vocab]
    return out, before_wide[..., :-1, :], pool.storage[..., :-1, :]  # the last row is scratch: padding writes there


@needs_kernels
@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("weights,compute,rows", [("float32", "float32", 8), ("bfloat16", "float32", 8),
                                                 ("bfloat16", "bfloat16", 8), ("bfloat16", "float32", 16)])
def test_token_steps_match_the_torch_forward(tmp_path, tok_dir, backend, weights, compute, rows):
    """Logits and the K/V left in the pool agree with the torch forward to the compute dtype's
    rounding (a bf16 model keeps a bf16 KV cache); passes of at most the plan's token_step_rows
    tokens run as token steps (bfloat16 weights when the checkpoint's values are bf16 values),
    wider ones do not."""
    assert rows in TOKEN_STEP_ROWS
    make_model(tmp_path, tok_dir, seed=4, dtype=torch.bfloat16 if weights == "bfloat16" else torch.float32)
    reference = load_model(tmp_path, ModelPlan(compute), "cpu", 256)
    stepped = load_model(tmp_path, ModelPlan(compute, token_step=True, token_step_rows=rows), "cpu", 256)
    step = stepped._token_step
    assert reference._token_step is None and step is not None
    assert step._model.kind == (WeightKind.BF16 if weights == "bfloat16" else WeightKind.F32)
    assert step._model.kv_kind == (WeightKind.BF16 if compute == "bfloat16" else WeightKind.F32)
    taken = []
    original = step.forward

    def counted(input_ids, *args):
        taken.append(tuple(input_ids.shape))
        return original(input_ids, *args)

    step.forward = counted
    want, want_kv, want_end = _passes(tmp_path, reference, backend, rows)
    got, got_kv, got_end = _passes(tmp_path, stepped, backend, rows)
    # 12 one-token steps, the 3-token chunk, 4 two-sequence steps, the two 3-token chunks, 1 + 3, `rows`
    assert taken == [(1, 1)] * 12 + [(1, 3)] + [(2, 1)] * 4 + [(2, 3)] * 2 + [(1, rows)]
    if compute == "float32":
        torch.testing.assert_close(got_end, want_end, atol=1e-5, rtol=1e-5)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1))
        torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=1e-5)
        return
    # bf16: torch rounds every activation to bf16, the C step only its K/V; the same maths
    assert got_kv.dtype == torch.bfloat16
    torch.testing.assert_close(got_kv.float(), want_kv.float(), atol=0.05, rtol=0.05)
    for w, g in zip(want, got):
        scale = w.abs().max().item()
        torch.testing.assert_close(g, w, atol=0.05 * scale, rtol=0.0)
        top2 = w.topk(2, dim=-1).values  # [B, 2]
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale  # not a near tie
        assert torch.equal(g.argmax(-1)[clear], w.argmax(-1)[clear])


@needs_kernels
def test_a_draft_model_in_the_engine_steps_with_the_kernel_and_keeps_greedy_output_exact(tmp_path, tok_dir):
    """Speculative greedy output with the draft on token steps equals plain greedy output, and
    the draft's passes did run as token steps, its steps after the first token as one greedy call
    a round (a plan without token_step: neither)."""
    from engine import LLM, SamplingParams

    make_model(tmp_path / "target", tok_dir, seed=1, layers=3)
    make_model(tmp_path / "draft", tok_dir, seed=2, layers=1)
    prompts = ["def add(a, b):", "for i in range(3):"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(model=str(tmp_path / "target"), dtype="float32", max_batch_size=4, max_seq_len=128)
    plain = [o.token_ids for o in LLM(**common, forward_plan="torch").generate(prompts, params)]
    for on in (True, False):
        llm = LLM(**common, use_speculative_decoding=True, draft_model=str(tmp_path / "draft"),
                  spec_length=4, spec_policy="fixed",
                  forward_plan={"target": {"dtype": "float32"}, "draft": {"dtype": "float32", "token_step": on}})
        draft = llm.engine.draft_model
        assert (draft._token_step is not None) == on
        calls, drafted = [], []
        if on:
            def counted(*args, original=draft._token_step.forward, calls=calls):
                calls.append(1)
                return original(*args)

            def counted_draft(first, kv, positions, steps, *rest, original=draft._token_step.draft, drafted=drafted):
                drafted.append(steps)
                return original(first, kv, positions, steps, *rest)

            draft._token_step.forward = counted
            draft._token_step.draft = counted_draft
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain
        assert bool(calls) == on and bool(drafted) == on and set(drafted) <= {1, 2, 3}


def test_token_step_is_refused_where_it_cannot_apply(tmp_path, tok_dir):
    make_model(tmp_path, tok_dir, seed=4)
    with pytest.raises(ValueError, match="forward_plan.target: token_step is draft-only"):
        EngineConfig(model=str(tmp_path), forward_plan={"target": {"dtype": "float32", "token_step": True}})
    with pytest.raises(ValueError, match="token_step needs dtype 'float32' or 'bfloat16'"):
        EngineConfig(model=str(tmp_path), forward_plan={"draft": {"dtype": "float16", "token_step": True}})
    with pytest.raises(ValueError, match="one_sequence_kernel needs dtype 'float32' or 'bfloat16'"):
        EngineConfig(model=str(tmp_path), forward_plan={"target": {"dtype": "float16", "one_sequence_kernel": True}})
    with pytest.raises(ValueError, match="forward_plan token_step must be a bool"):
        EngineConfig(model=str(tmp_path), forward_plan={"draft": {"dtype": "float32", "token_step": "yes"}})
    with pytest.raises(ValueError, match=r"unknown forward_plan.draft field\(s\): \['steps'\]"):
        EngineConfig(model=str(tmp_path), forward_plan={"draft": {"steps": True}})


@needs_kernels
def test_sampled_drafting_in_one_call_draws_from_the_torch_forwards_distribution(tmp_path, tok_dir):
    """TokenStep.draft at a temperature: each step's q is softmax(logits / T) of the torch forward
    fed the same tokens, and its token is q's inverse CDF at the row's uniform; a row at
    temperature 0 takes the argmax with a one-hot q."""
    from engine.speculative.proposers.drafting import token_step_loop

    make_model(tmp_path, tok_dir, seed=4)
    reference = load_model(tmp_path, ModelPlan("float32"), "cpu", 256)
    stepped = load_model(tmp_path, ModelPlan("float32", token_step=True), "cpu", 256)
    vocab, steps = reference.shape.vocab_size, 4
    torch.manual_seed(3)
    prompts = torch.randint(0, vocab, (2, 12)).tolist()
    pools = [pool_for(m, "paged", max_slots=2, max_seq_len=64) for m in (reference, stepped)]
    slots = [[pool.allocate_slot([])[0] for _ in prompts] for pool in pools]
    for model, pool, s in zip((reference, stepped), pools, slots):
        forward_chunks(model, pool, s, prompts, [0, 0])
    first = [5, 9]
    temperatures = torch.tensor([0.7, 0.0])
    uniforms = torch.rand(2, steps)
    tokens, q = token_step_loop(stepped, pools[1], slots[1], vocab)(first, steps, temperatures, uniforms)
    assert q.shape == (2, steps, vocab)
    fed = [[f] + t[:-1] for f, t in zip(first, tokens)]
    for j in range(steps):
        logits = forward_chunks(reference, pools[0], slots[0], [[f[j]] for f in fed], [12 + j, 12 + j])  # [2, vocab]
        want = (logits[0] / 0.7).softmax(-1)
        torch.testing.assert_close(q[0, j], want, atol=1e-5, rtol=1e-4)
        cdf = q[0, j].double().cumsum(0)
        assert tokens[0][j] == int(torch.searchsorted(cdf, uniforms[0, j].double() * cdf[-1], right=True))
        assert tokens[1][j] == int(logits[1].argmax()) and q[1, j, tokens[1][j]] == 1.0 and q[1, j].sum() == 1.0
    assert len(set(tokens[0])) > 1  # drawn, not a constant


@needs_kernels
def test_token_step_draft_refuses_half_a_sampling_request(tmp_path, tok_dir):
    make_model(tmp_path, tok_dir, seed=4)
    stepped = load_model(tmp_path, ModelPlan("float32", token_step=True), "cpu", 256)
    pool = pool_for(stepped, "paged", max_slots=1, max_seq_len=64)
    slot = pool.allocate_slot([])[0]
    forward_chunks(stepped, pool, [slot], [[1, 2, 3]], [0])
    from engine.model.passes import pass_inputs

    x = pass_inputs(stepped, pool, [slot], [[4, 4]], [3])
    with pytest.raises(ValueError, match="temperatures .* and uniforms"):
        stepped._token_step.draft([4], x.view, [3], 2, None, None, temperatures=torch.tensor([1.0]))


def _tree_passes(model, backend: str) -> list[torch.Tensor]:
    """Two sequences prefilled, then tree passes as drafting and verifying make them: a whole tree
    and a chain side by side, a tree's newest nodes after its earlier ones (tree_from), and a
    tree beside a padded one-token row. Returns each pass's logits of every position."""
    from engine.token_tree import TokenTree

    pool = pool_for(model, backend, max_slots=4, max_seq_len=128)
    torch.manual_seed(2)
    ids = torch.randint(0, model.shape.vocab_size, (2, 60)).tolist()
    slots = [pool.allocate_slot([])[0] for _ in range(2)]
    forward_chunks(model, pool, slots, [s[:37] for s in ids], [0, 0])
    bushy = TokenTree((11, 12, 13, 14, 15, 16), (-1, -1, -1, 0, 0, 1))
    chain = TokenTree((21, 22, 23), (-1, 0, 1))
    out = [forward_chunks(model, pool, slots, [[7, *bushy.tokens], [8, *chain.tokens]], [37, 37], all_logits=True,
                          trees=[bushy, chain])]
    for s in slots:
        pool.truncate_to(s, 37)
    # drafting: the root and the first three nodes, then the newest three after them
    out.append(forward_chunks(model, pool, slots[:1], [[7, 11, 12, 13]], [37], all_logits=True, trees=[bushy]))
    out.append(forward_chunks(model, pool, slots[:1], [[14, 15, 16]], [41], all_logits=True, trees=[bushy],
                              tree_from=[4]))
    for s in slots:
        pool.truncate_to(s, 37)
    out.append(forward_chunks(model, pool, slots, [[9], [8, *bushy.tokens]], [37, 37], all_logits=True,
                              trees=[None, bushy]))
    return out


@needs_kernels
@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_tree_passes_run_as_token_steps_and_match_the_torch_forward(tmp_path, tok_dir, backend):
    """A token tree's passes (each query seeing the context and its own ancestors) run in the C step,
    each row given the keys its mask shows, and agree with the torch forward's masked passes."""
    make_model(tmp_path, tok_dir, seed=4)
    reference = load_model(tmp_path, ModelPlan("float32"), "cpu", 256)
    stepped = load_model(tmp_path, ModelPlan("float32", token_step=True, token_step_rows=16), "cpu", 256)
    taken = []
    original = stepped._token_step.forward

    def counted(input_ids, *args):
        taken.append(tuple(input_ids.shape))
        return original(input_ids, *args)

    stepped._token_step.forward = counted
    want, got = _tree_passes(reference, backend), _tree_passes(stepped, backend)
    assert taken == [(2, 7), (1, 4), (1, 3), (2, 7)]
    real = [[7, 4], [4], [3], [1, 7]]  # each row's tokens (the rest: padding)
    for w, g, rows in zip(want, got, real):
        for b, n in enumerate(rows):
            torch.testing.assert_close(g[b, :n], w[b, :n], atol=1e-4, rtol=1e-4)
            assert torch.equal(g[b, :n].argmax(-1), w[b, :n].argmax(-1))


def test_a_tree_mask_that_does_not_match_the_positions_is_refused():
    from engine.model.token_step import _tree_key_rows

    read = torch.arange(10)[None]  # [1, L]: key position j at storage row j
    mask = torch.zeros(1, 1, 2, 10, dtype=torch.bool)
    mask[0, 0, 0, :6] = True  # position 5 sees keys 0..5
    mask[0, 0, 1, [0, 1, 2, 3, 4, 6]] = True  # a sibling at position 5: the root's context, not node 5
    rows = _tree_key_rows(read, mask, torch.tensor([[5, 5]]), torch.tensor([1]))
    assert rows[0, 0, :6].tolist() == [0, 1, 2, 3, 4, 5] and rows[0, 1, :6].tolist() == [0, 1, 2, 3, 4, 6]
    mask[0, 0, 1, 7] = True  # one key too many for its position
    with pytest.raises(ValueError, match="position \\+ 1 keys"):
        _tree_key_rows(read, mask, torch.tensor([[5, 5]]), torch.tensor([1]))
