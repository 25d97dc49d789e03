"""EAGLE-3 heads: the published checkpoint layout against a plain-PyTorch reference, the target's
features, clear errors for heads that do not fit, the feature cache, and greedy exactness with
the eagle proposer (alone and inside hybrid), including live switches that stop feature capture."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ModelPlan
from engine.kv.features import FeatureCache
from engine.model.eagle3 import is_eagle3, load_eagle3
from engine.model.loader import load_model
from engine.model.passes import pass_inputs, pool_for
from tests.helpers import RecordingObserver, greedy, make_eagle3_head

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n",
    "import os",
    "x",
    "print(os.path.join('a', 'b'))\n" * 3,
]
AUX = [0, 1, 1]  # the tiny target has two layers; layer 0's input is the embedding





@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=8)
    return [o.token_ids for o in llm.generate(PROMPTS, greedy())]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_head(w: dict, cfg: dict, embed: torch.Tensor, tokens: list[int], inputs: list[torch.Tensor]):
    """The head written out plainly, from its tensors and config.json in either published layout:
    inputs[j] is position j's hidden input ([3H] target features, or [H], the head's own output).
    Returns logits over the target vocabulary [T, V] (-inf outside the draft vocabulary) and
    the states fed back [T, H] (pre-norm outputs; normed with norm_output)."""
    layer = cfg.get("transformer_layer_config") or cfg  # the speculators layout nests the layer's config
    m = "layers.0." if "speculators_model_type" in cfg else "midlayer."
    norm_first = cfg.get("norm_before_residual", "speculators_model_type" in cfg)  # vLLM's defaults
    eps, H = layer["rms_norm_eps"], layer["hidden_size"]
    nh, nkv = layer["num_attention_heads"], layer["num_key_value_heads"]
    D = H // nh
    fc_bias = w.get("fc.bias", torch.zeros(H))

    def fused(x):  # [3H] target features -> [H]
        if cfg.get("norm_before_fc", (cfg.get("eagle_config") or {}).get("norm_before_fc")):
            x = _rms(x, w["input_norm.weight"], eps)
        if cfg.get("fc_norm"):
            x = torch.cat([_rms(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(x.chunk(3))])
        return w["fc.weight"] @ x + fc_bias

    hidden = torch.stack([fused(x) if x.shape[-1] != H else x for x in inputs])  # [T, H]
    T = hidden.shape[0]
    normed = _rms(hidden, w[m + "hidden_norm.weight"], eps)
    inv = 1.0 / layer["rope_theta"] ** (torch.arange(0, D, 2).float() / D)
    ang = torch.arange(T).float()[:, None] * inv  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin

    def attention(x, p):  # causal self-attention of the layer under p over its normed input x [T, in]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, D)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, D)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, D)
        if p + "self_attn.q_norm.weight" in w:  # a Qwen3 layer: each head's q and k normed before rotation
            q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)  # [T, nh, D]
        scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H) @ w[p + "self_attn.o_proj.weight"].T

    def mlp(h, p):
        y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        return (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T

    x = torch.cat([_rms(embed[tokens], w[m + "input_layernorm.weight"], eps), normed], -1)  # [T, 2H]
    h = (normed if norm_first else hidden) + attention(x, m)
    h = h + mlp(h, m)
    for i in range(1, layer.get("num_hidden_layers", 1)):  # further layers: plain decoder layers
        p = f"layers.{i}."
        h = h + attention(_rms(h, w[p + "input_layernorm.weight"], eps), p)
        h = h + mlp(h, p)
    out = _rms(h, w["norm.weight"], eps)
    draft_logits = out @ w["lm_head.weight"].T  # [T, Vd]
    ids = w["d2t"] + torch.arange(len(w["d2t"]))
    logits = torch.full((T, layer["vocab_size"]), float("-inf"))
    logits[:, ids] = draft_logits
    return logits, out if cfg.get("norm_output") else h


def run_against_reference(path, tiny_model, backend: str, token_step: bool, **layout):
    """Writes a head (make_eagle3_head's `layout` options) at `path`, runs a 6-position pass from
    target features, then four one-token steps on its own output, as drafting does, and checks
    logits and outputs against reference_head. Returns the loaded head."""
    vocab = json.loads((tiny_model[0] / "config.json").read_text())["vocab_size"]
    w = make_eagle3_head(path, tiny_model[0], seed=1, aux=AUX, draft_vocab=list(range(0, vocab, 2)), **layout)
    cfg = json.loads((path / "config.json").read_text())
    assert is_eagle3(path) and not is_eagle3(tiny_model[0])
    target = load_model(tiny_model[0], ModelPlan(dtype="float32"), "cpu", 64)
    head = load_eagle3(path, target, 64, token_step)  # token_step: the passes below are C calls
    assert head.aux_layers == tuple(AUX) and head.plan.token_step == token_step
    passes = []  # shapes of the passes that ran as C calls
    if token_step:
        original = head._token_step.head_pass
        head._token_step.head_pass = lambda ids, *rest: passes.append(tuple(ids.shape)) or original(ids, *rest)
    pool = pool_for(head, max_slots=2, max_seq_len=64, backend=backend, block_size=4)
    slot = pool.allocate_slot([])[0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (10,), generator=g).tolist()
    features = torch.randn(6, 3 * target.shape.hidden_size, generator=g)  # [6, 3H]
    x = pass_inputs(head, pool, [slot], [tokens[:6]], [0])  # positions 0..5 from target features
    logits, out = head.step(x.ids, x.positions, x.view, features[None], None)  # [1, 6, V], [1, 6, H]
    inputs = list(features)
    got_logits, got_out = [logits[0]], [out[0]]
    for j in range(6, 10):  # then one-token steps on the head's own output, as drafting does
        inputs.append(got_out[-1][-1])
        x = pass_inputs(head, pool, [slot], [[tokens[j]]], [j])
        logits, out = head.step(x.ids, x.positions, x.view, got_out[-1][-1:][None], x.last)  # [1, V], [1, H]
        got_logits.append(logits)
        got_out.append(out)
    assert passes == ([(1, 6)] + [(1, 1)] * 4 if token_step else [])
    want_logits, want_out = reference_head(w, cfg, target.embed, tokens, inputs)
    got_logits, got_out = torch.cat(got_logits), torch.cat(got_out)
    assert torch.equal(torch.isinf(got_logits), torch.isinf(want_logits))
    finite = torch.isfinite(want_logits)
    torch.testing.assert_close(got_logits[finite], want_logits[finite], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_out, want_out, rtol=1e-4, atol=1e-4)
    return head


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("token_step", [False, True], ids=["torch", "token_step"])
def test_a_head_in_the_published_layout_runs_as_the_reference_does(tmp_path, tiny_model, fmt, backend, token_step):
    run_against_reference(tmp_path, tiny_model, backend, token_step, fmt=fmt)


@pytest.mark.parametrize("token_step", [False, True], ids=["torch", "token_step"])
@pytest.mark.parametrize("norm_before_residual", [True, None, False], ids=["norm_first", "unset", "residual_raw"])
def test_a_head_in_the_speculators_layout_runs_as_the_reference_does(tmp_path, tiny_model, token_step,
                                                                    norm_before_residual):
    """The speculators library's layout (RedHatAI/*-speculator.eagle3): its config read as vLLM
    reads it (norm_before_residual true when unset), the layer under layers.0., fc with a bias."""
    head = run_against_reference(tmp_path, tiny_model, "paged", token_step, layout="speculators",
                                 norm_before_residual=norm_before_residual, fc_bias=True)
    assert head.norm_before_residual == (norm_before_residual is not False) and head.fc_bias is not None


NORM_CASES = {"eagle_norm_before_fc": {"norm_before_fc": True},
              "norm_before_fc": {"layout": "speculators", "norm_before_fc": True},
              "fc_norm": {"layout": "speculators", "fc_norm": True},
              "norm_output": {"layout": "speculators", "norm_output": True},
              "all": {"layout": "speculators", "norm_before_fc": True, "fc_norm": True, "norm_output": True}}


@pytest.mark.parametrize("token_step", [False, True], ids=["torch", "token_step"])
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_heads_with_norms_before_fc_or_a_normed_output_run_as_the_reference_does(tmp_path, tiny_model, token_step,
                                                                                 case):
    """The speculators library's options for the fused features: one RMSNorm over all three
    (norm_before_fc, input_norm.weight; NVIDIA's EAGLE-layout heads set it under eagle_config), one
    per target layer (fc_norm, fc_norm.{i}.weight), and feeding the final norm's output back to the
    next step instead of the layer's (norm_output)."""
    layout = NORM_CASES[case]
    head = run_against_reference(tmp_path, tiny_model, "paged", token_step, **layout)
    assert (head.input_norm is not None) == layout.get("norm_before_fc", False)
    assert (head.fc_norms is not None) == layout.get("fc_norm", False)
    assert head.norm_output == layout.get("norm_output", False)


def test_a_head_feeding_its_normed_output_back_drafts_the_same_with_and_without_the_token_step(tmp_path,
                                                                                             tiny_model):
    """Drafting K tokens with a norm_output head: every step feeds the normed state back, also on
    the token step (whose one-call drafting loop feeds the layer's output, so it must not run).
    The proposals of the two plans agree, and the output is plain greedy's."""
    vocab = json.loads((tiny_model[0] / "config.json").read_text())["vocab_size"]
    make_eagle3_head(tmp_path, tiny_model[0], seed=4, aux=AUX, draft_vocab=list(range(0, vocab, 2)),
                     layout="speculators", norm_output=True, lm_scale=6.0)
    proposals, outputs = {}, {}
    for token_step in (False, True):
        llm = LLM(model=str(tiny_model[0]), draft_model=str(tmp_path), use_speculative_decoding=True,
                  speculative_method="eagle", spec_policy="fixed", spec_length=4, dtype="float32",
                  max_seq_len=160, max_batch_size=4, forward_plan={"draft": {"token_step": token_step}})
        proposer = llm.engine.speculation.proposer
        seen = proposals[token_step] = []

        def recording(*args, original=proposer.propose, seen=seen):
            proposal = original(*args)
            seen.append(proposal.tokens)
            return proposal

        proposer.propose = recording
        outputs[token_step] = [o.token_ids for o in llm.generate(PROMPTS[:4], greedy(16))]
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=4)
    assert outputs[False] == outputs[True] == [o.token_ids for o in plain.generate(PROMPTS[:4], greedy(16))]
    assert proposals[True] == proposals[False]
    assert any(len(row) == 4 for step in proposals[True] for row in step)  # four-token rounds ran


def test_a_heads_tree_drafting_runs_on_the_token_step_and_proposes_the_same_trees(tmp_path, tiny_model):
    """Tree drafting's head passes (each fed node seeing the context and its own ancestors) run as
    C calls on the token step, each query given the keys its tree mask shows: the trees proposed
    equal the torch forward's, and the output is plain greedy's."""
    vocab = json.loads((tiny_model[0] / "config.json").read_text())["vocab_size"]
    make_eagle3_head(tmp_path, tiny_model[0], seed=4, aux=AUX, draft_vocab=list(range(0, vocab, 2)),
                     layout="speculators", lm_scale=6.0)
    proposed, outputs, passes = {}, {}, []
    for token_step in (False, True):
        llm = LLM(model=str(tiny_model[0]), draft_model=str(tmp_path), use_speculative_decoding=True,
                  speculative_method="eagle", spec_policy="fixed", spec_length=3, tree_width=2, tree_tokens=6,
                  dtype="float32", max_seq_len=160, max_batch_size=4, forward_plan={"draft": {"token_step": token_step}})
        proposer = llm.engine.speculation.proposer
        seen = proposed[token_step] = []

        def recording(*args, original=proposer.propose_trees, seen=seen):
            trees = original(*args)
            seen.append([None if t is None else (t.tokens, t.parents) for t in trees])
            return trees

        proposer.propose_trees = recording
        if token_step:
            step = llm.engine.draft_model._token_step
            step.head_pass = lambda ids, pos, kv, *rest, original=step.head_pass: passes.append(
                kv.mask_override is not None) or original(ids, pos, kv, *rest)
        outputs[token_step] = [o.token_ids for o in llm.generate(PROMPTS[:4], greedy(16))]
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=4)
    assert outputs[False] == outputs[True] == [o.token_ids for o in plain.generate(PROMPTS[:4], greedy(16))]
    assert proposed[True] == proposed[False]
    assert any(len(set(parents)) < len(parents) for step in proposed[True] for tree in step if tree
               for _, parents in [tree])  # some tree branched
    assert any(passes)  # passes under a tree mask ran in C


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_a_head_of_several_layers_runs_as_the_reference_does(tmp_path, tiny_model, layers, backend):
    """A speculators head with num_hidden_layers > 1: the EAGLE-3 layer, then plain decoder layers
    (layers.{i}., H-wide attention input) over its output, each with its own K/V, as vLLM runs
    them; the state fed back is the last layer's output."""
    head = run_against_reference(tmp_path, tiny_model, backend, False, layout="speculators", layers=layers)
    assert len(head.layers) == layers and head.shape.num_layers == layers


@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_a_head_of_several_layers_rolls_back_every_layers_kv(tmp_path, tiny_model, backend):
    """Drafting writes K/V in every layer of the head and a rejected round drops it: after
    truncating to a shorter length and stepping on from there with other tokens, the head's logits
    are the reference's over the new sequence (stale K/V left in layer 1 or 2 would show)."""
    vocab = json.loads((tiny_model[0] / "config.json").read_text())["vocab_size"]
    w = make_eagle3_head(tmp_path, tiny_model[0], seed=7, aux=AUX, layout="speculators", layers=3)
    cfg = json.loads((tmp_path / "config.json").read_text())
    target = load_model(tiny_model[0], ModelPlan(dtype="float32"), "cpu", 64)
    head = load_eagle3(tmp_path, target, 64)
    pool = pool_for(head, max_slots=1, max_seq_len=64, backend=backend, block_size=4)
    slot = pool.allocate_slot([])[0]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (12,), generator=g).tolist()
    features = torch.randn(6, 3 * target.shape.hidden_size, generator=g)  # [6, 3H]
    x = pass_inputs(head, pool, [slot], [tokens[:6]], [0])
    _, out = head.step(x.ids, x.positions, x.view, features[None], None)  # [1, 6, H]
    state = out[:, -1:]
    for j in range(6, 9):  # a rejected round's three steps
        x = pass_inputs(head, pool, [slot], [[tokens[j]]], [j])
        _, state = head.step(x.ids, x.positions, x.view, state, x.last)
        state = state[:, None]
    pool.truncate_to(slot, 6)  # the round rejected: positions 6..8 again, with other tokens
    inputs, logits = list(features), []
    state = out[:, -1:]
    for j, token in zip(range(6, 9), tokens[9:12]):
        inputs.append(state[0, -1])
        x = pass_inputs(head, pool, [slot], [[token]], [j])
        step_logits, state = head.step(x.ids, x.positions, x.view, state, x.last)
        logits.append(step_logits)
        state = state[:, None]
    want, _ = reference_head(w, cfg, target.embed, tokens[:6] + tokens[9:12], inputs)
    got = torch.cat(logits)  # [3, V]
    finite = torch.isfinite(want[6:])
    torch.testing.assert_close(got[finite], want[6:][finite], rtol=1e-4, atol=1e-4)


def test_a_head_of_several_layers_plans_without_the_token_step_and_stays_exact(tmp_path, tiny_model):
    """The C token step runs one-layer heads: an engine serving a two-layer head plans it off the
    token step (an explicit plan asking for it is a clear error), and its greedy output is plain
    greedy's."""
    make_eagle3_head(tmp_path, tiny_model[0], seed=6, aux=AUX, layout="speculators", layers=2)
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tmp_path), use_speculative_decoding=True,
              speculative_method="eagle", spec_policy="fixed", spec_length=3, dtype="float32", max_seq_len=160,
              max_batch_size=2, kv_cache_backend="paged", block_size=4)
    assert llm.engine.forward_plan["draft"]["token_step"] is False
    assert llm.engine.draft_model.shape.num_layers == 2
    out = llm.generate(PROMPTS[:2], greedy(12))
    assert sum(o.num_draft_tokens for o in out) > 0
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=2)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain.generate(PROMPTS[:2], greedy(12))]
    with pytest.raises(ValueError, match="one-layer"):
        LLM(model=str(tiny_model[0]), draft_model=str(tmp_path), use_speculative_decoding=True,
            speculative_method="eagle", dtype="float32", max_seq_len=160,
            forward_plan={"draft": {"token_step": True}})


def test_a_head_with_a_qwen3_layer_runs_as_the_reference_does_and_plans_without_the_token_step(tmp_path, tiny_model):
    """A head whose layer is Qwen3's (q_norm and k_norm per head before rotation), as published for
    Qwen3 targets: the torch pass matches the reference, and an engine serving it plans its steps
    off the C token step (which has no q/k norms)."""
    run_against_reference(tmp_path, tiny_model, "slotted", False, layout="speculators", norm_before_residual=True,
                          qwen3=True)
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tmp_path), use_speculative_decoding=True,
              speculative_method="eagle", dtype="float32", max_seq_len=160, max_batch_size=2)
    assert llm.engine.forward_plan["draft"]["token_step"] is False
    out = llm.generate(PROMPTS[:2], greedy(8))
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=2).generate(PROMPTS[:2],
                                                                                                     greedy(8))
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]


@pytest.mark.parametrize("layout", [{}, {"layout": "speculators", "norm_before_residual": True}],
                         ids=["eagle", "speculators_norm_first"])
def test_a_head_pass_over_sequences_of_unequal_lengths_is_each_sequence_alone(tmp_path, tiny_model, layout):
    """One C head pass over two sequences (1 and 3 tokens, padded; only each one's last row's
    outputs wanted, so the others only write K/V) gives each sequence's logits and output as the
    torch pass over it alone does, and leaves the same K/V (also when the residual is the normed
    hidden state of an output row that is not the pass's row of the same index)."""
    vocab = json.loads((tiny_model[0] / "config.json").read_text())["vocab_size"]
    make_eagle3_head(tmp_path, tiny_model[0], seed=2, aux=AUX, draft_vocab=list(range(0, vocab, 2)), **layout)
    target = load_model(tiny_model[0], ModelPlan(dtype="float32"), "cpu", 64)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (2, 10), generator=g).tolist()
    features = torch.randn(2, 9, 3 * target.shape.hidden_size, generator=g)  # [2, 9, 3H]

    def run(token_step: bool, rows: list[int], chunk: list[slice]):
        head = load_eagle3(tmp_path, target, 64, token_step=token_step)
        pool = pool_for(head, max_slots=2, max_seq_len=64, backend="paged", block_size=4)
        slots = [pool.allocate_slot([])[0] for _ in rows]
        x = pass_inputs(head, pool, slots, [tokens[r][:6] for r in rows], [0] * len(rows))
        head.step(x.ids, x.positions, x.view, features[rows, :6], x.last)  # the same 6-token context
        x = pass_inputs(head, pool, slots, [tokens[r][c] for r, c in zip(rows, chunk)], [6] * len(rows))
        h = torch.zeros(len(rows), x.ids.shape[1], features.shape[-1])
        for i, (r, c) in enumerate(zip(rows, chunk)):
            h[i, :c.stop - c.start] = features[r, c]
        logits, out = head.step(x.ids, x.positions, x.view, h, x.last)  # [n, V], [n, H]
        # one more step on its own output attends over every key the pass wrote
        x = pass_inputs(head, pool, slots, [[tokens[r][c.stop]] for r, c in zip(rows, chunk)],
                        [c.stop for c in chunk])
        after, _ = head.step(x.ids, x.positions, x.view, out[:, None], x.last)  # [n, V]
        return logits, out, after

    together = run(True, [0, 1], [slice(6, 7), slice(6, 9)])
    for i, (r, c) in enumerate(((0, slice(6, 7)), (1, slice(6, 9)))):
        alone = run(False, [r], [c])
        for got, want in zip(together, alone):
            finite = torch.isfinite(want[0])
            torch.testing.assert_close(got[i][finite], want[0][finite], rtol=1e-4, atol=1e-4)


def test_target_features_are_the_inputs_of_the_chosen_layers(tiny_model):
    path, hf = tiny_model
    target = load_model(path, ModelPlan(dtype="float32"), "cpu", 64)
    pool = pool_for(target, max_slots=1, max_seq_len=64)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    x = pass_inputs(target, pool, [pool.allocate_slot([])[0]], ids.tolist(), [0])
    logits, feats = target.forward_features(x.ids, x.positions, x.view, None, (1, 0, 1))  # [1, 12, 3H]
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
    want = torch.cat([out.hidden_states[i] for i in (1, 0, 1)], -1)
    torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-4)


def test_heads_that_do_not_fit_the_target_are_clear_errors(tmp_path, tiny_model, tiny_draft, tiny_head):
    cfg = json.loads((tiny_model[0] / "config.json").read_text())
    small = tmp_path / "small"
    make_eagle3_head(small, tiny_draft[0], aux=AUX)  # hidden 32 vs the target's 64
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(model=str(tiny_model[0]), draft_model=str(small), use_speculative_decoding=True, speculative_method="eagle")
    vocab = tmp_path / "vocab"
    make_eagle3_head(vocab, tiny_model[0], aux=AUX)
    c = json.loads((vocab / "config.json").read_text())
    (vocab / "config.json").write_text(json.dumps({**c, "vocab_size": cfg["vocab_size"] + 8}))
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(model=str(tiny_model[0]), draft_model=str(vocab), use_speculative_decoding=True, speculative_method="eagle")
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True, speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_method='eagle'"):
        LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), use_speculative_decoding=True,
            speculative_method="eagle")
    target = load_model(tiny_model[0], ModelPlan(dtype="float32"), "cpu", 64)
    bad = tmp_path / "bad"
    w = make_eagle3_head(bad, tiny_model[0], aux=AUX)
    c = json.loads((bad / "config.json").read_text())
    for field, value in (("attention_bias", True), ("mlp_bias", True)):
        (bad / "config.json").write_text(json.dumps({**c, field: value}))
        with pytest.raises(ValueError, match=field):
            load_eagle3(bad, target, 64)
    (bad / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="layers.1.input_layernorm.weight"):  # a second layer not written
        load_eagle3(bad, target, 64)
    (bad / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 0}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_eagle3(bad, target, 64)
    (bad / "config.json").write_text(json.dumps({**c, "norm_before_fc": True}))
    with pytest.raises(ValueError, match="input_norm.weight"):  # asked for, not written
        load_eagle3(bad, target, 64)
    normed = tmp_path / "normed"
    make_eagle3_head(normed, tiny_model[0], aux=AUX, norm_before_fc=True)
    c = json.loads((normed / "config.json").read_text())
    (normed / "config.json").write_text(json.dumps({**c, "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}))
    with pytest.raises(ValueError, match="does not set norm_before_fc"):  # written, not asked for
        load_eagle3(normed, target, 64)
    per_layer = tmp_path / "per_layer"
    make_eagle3_head(per_layer, tiny_model[0], aux=AUX, fc_norm=True)
    c = json.loads((per_layer / "config.json").read_text())
    (per_layer / "config.json").write_text(json.dumps({**c, "fc_norm": False}))
    with pytest.raises(ValueError, match="does not set fc_norm"):
        load_eagle3(per_layer, target, 64)
    tensors = load_file(per_layer / "model.safetensors")
    tensors["fc_norm.1.weight"] = tensors["fc_norm.1.weight"][:-8]
    save_file(tensors, per_layer / "model.safetensors")
    (per_layer / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"fc_norm.1.weight has shape \(56,\)"):
        load_eagle3(per_layer, target, 64)
    (bad / "config.json").write_text(json.dumps({**c, "num_hidden_layers": True}))
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer"):
        load_eagle3(bad, target, 64)
    (bad / "config.json").write_text(json.dumps({**c, "speculators_model_type": "eagle"}))
    with pytest.raises(ValueError, match="speculators_model_type 'eagle3'"):
        load_eagle3(bad, target, 64)
    (bad / "config.json").write_text(json.dumps({**c, "draft_vocab_size": c["draft_vocab_size"] - 1}))
    with pytest.raises(ValueError, match="d2t and lm_head.weight"):
        load_eagle3(bad, target, 64)
    assert w["fc.weight"].shape[1] == 3 * cfg["hidden_size"]
    twice = tmp_path / "twice"
    make_eagle3_head(twice, tiny_model[0], aux=AUX, draft_vocab=list(range(12)))
    tensors = load_file(twice / "model.safetensors")
    tensors["d2t"][5] += 1  # draft ids 5 and 6 both -> target id 6
    save_file(tensors, twice / "model.safetensors")
    with pytest.raises(ValueError, match="d2t maps two draft ids to the same target id"):
        load_eagle3(twice, target, 64)


def test_the_feature_cache_keeps_contiguous_runs_and_rolls_back():
    cache = FeatureCache()
    rows = torch.arange(40.0).view(10, 4)
    cache.append("a", 0, rows[:6])
    cache.append("a", 6, rows[6:9])
    cache.truncate_to("a", 7)  # a verify's rejected positions go
    assert cache.pending("a") == 7
    got = cache.take("a")
    assert (got.origin, got.start) == (0, 0) and torch.equal(got.rows, rows[:7])
    assert cache.pending("a") == 0 and cache.take("a") is None
    cache.append("a", 7, rows[7:8])
    assert cache.take("a").start == 7
    cache.append("a", 20, rows[:2])  # not contiguous: a new run starts there
    got = cache.take("a")
    assert (got.origin, got.start) == (20, 20)
    cache.free("a")
    assert cache.pending("a") == 0
    small = FeatureCache(max_pending=4)  # past the bound, the newest rows start a new run
    small.append("b", 0, rows[:3])
    small.append("b", 3, rows[3:6])
    got = small.take("b")
    assert (got.origin, got.start) == (2, 2) and torch.equal(got.rows, rows[2:6])


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("method", ["eagle", "hybrid"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("token_step", [False, True], ids=["torch", "token_step"])
def test_eagle_greedy_equals_plain(tiny_model, tiny_head, reference, backend, method, policy, token_step):
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True,
              speculative_method=method, spec_policy=policy, spec_length=4, dtype="float32",
              kv_cache_backend=backend, block_size=4, max_seq_len=160, max_batch_size=8,
              enable_prefix_caching=backend == "paged", forward_plan={"draft": {"token_step": token_step}})
    assert llm.engine.forward_plan["draft"]["token_step"] == token_step
    calls = []
    if token_step:  # the steps after a round's first token: one greedy C call
        step = llm.engine.draft_model.token_step
        step.draft = lambda *a, original=step.draft: calls.append(a[3]) or original(*a)
    alone = [llm.generate(p, greedy())[0] for p in PROMPTS]
    batched = llm.generate(PROMPTS, greedy())  # paged: prompts now hit the prefix cache
    assert [o.token_ids for o in alone] == reference
    assert [o.token_ids for o in batched] == reference
    if policy == "fixed":
        drafted = sum(o.num_draft_tokens for o in batched)
        accepted = sum(o.num_accepted_tokens for o in batched)
        assert 0 < accepted < drafted
        assert any("eagle" in o.proposers for o in batched)
        assert bool(calls) == token_step  # adaptive may keep K <= 1 on a host where the head does not pay
    assert all(pool.num_used_slots() == 0 for pool in llm.engine.kv.pools().values())
    assert llm.engine.kv.features.pending(batched[0].request_id) == 0


def test_switching_away_from_eagle_and_back_mid_request_stays_exact(tiny_model, tiny_head, reference):
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True,
              speculative_method="eagle", spec_policy="fixed", spec_length=3, dtype="float32",
              max_seq_len=160, max_batch_size=8)
    engine = llm.engine
    ids = [engine.add_request(p, greedy()) for p in PROMPTS[:4]]
    outputs: dict[str, list[int]] = {}
    for step in range(200):
        if step == 3:
            engine.reconfigure_speculation(speculative_method="ngram")  # the target stops keeping features
            ids += [engine.add_request(p, greedy()) for p in PROMPTS[4:]]  # prefilled with no features kept
        if step == 6:
            engine.reconfigure_speculation(speculative_method="eagle")  # the head starts over where they resume
        if step == 8:
            engine.reconfigure_speculation(use_speculative_decoding=False)  # features are dropped
        if step == 10:
            engine.reconfigure_speculation(use_speculative_decoding=True)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out.token_id)
        if not engine.has_unfinished_requests():
            break
    assert [outputs[i] for i in ids] == reference


def test_the_heads_plan_is_measured_with_and_without_the_token_step(tiny_model, tiny_head, tmp_path, monkeypatch):
    monkeypatch.setattr("engine.model.plan.cache_dir", lambda: tmp_path)  # nothing cached: measured now
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True,
              speculative_method="eagle", dtype="float32", max_seq_len=160, max_batch_size=4)
    plans = llm.engine.forward_plan
    assert plans["draft"]["source"] == "measured"
    assert set(plans["draft"]["ms"]) == {"float32", "float32+token_step", "float32+token_step16"}
    assert plans["draft"]["dtype"] == plans["target"]["dtype"]  # the head computes as its target
    head = llm.engine.draft_model  # the head loaded is the plan chosen, its width included
    assert head.plan.token_step_rows == plans["draft"]["token_step_rows"]
    assert head.token_step is None or head.token_step.max_rows == plans["draft"]["token_step_rows"]
    again = LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True,
                speculative_method="eagle", dtype="float32", max_seq_len=160, max_batch_size=4)
    assert again.engine.forward_plan["draft"]["source"] == "cached"
    assert again.engine.forward_plan["draft"]["token_step"] == plans["draft"]["token_step"]
    wide = LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True,
               speculative_method="eagle", dtype="float32", max_seq_len=160, max_batch_size=4,
               forward_plan={"draft": {"dtype": "float32", "token_step": True, "token_step_rows": 16}})
    assert wide.engine.draft_model.token_step.max_rows == 16 and wide.engine.draft_model.token_step.takes(1, 12, None)


class _AllowOnly:
    """A grammar stub: only `ids` are allowed, at every position."""

    terminated = False

    def __init__(self, ids: list[int]):
        self.ids = ids

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for i in self.ids:
            bitmask[row, i // 32] |= 1 << (i % 32)

    def accept(self, token: int) -> bool:
        return token in self.ids

    def rollback(self, num_tokens: int) -> None:
        pass


def test_a_grammar_allowing_only_ids_outside_the_draft_vocabulary_stops_that_row_drafting():
    """A reduced draft vocabulary (ids 0..31 of 64) under a grammar that allows only ids 40 and 41:
    the head can propose nothing there, so the row drafts nothing and its q stays a distribution;
    the unconstrained row drafts as usual."""
    from types import SimpleNamespace

    from engine.speculative.proposers.drafting import draft_tokens
    from engine.uniforms import RandomStream

    logits = torch.full((2, 64), float("-inf"))  # [N, V]
    logits[:, :32] = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    reqs = [SimpleNamespace(grammar=g, params=SamplingParams(temperature=1.0), all_token_ids=[3], output_token_ids=[],
                            random_stream=RandomStream(i)) for i, g in enumerate([_AllowOnly([40, 41]), None])]
    observer = SimpleNamespace(observe_draft_steps=lambda *a: None)
    tokens, q = draft_tokens(reqs, [3, 3], logits, True, lambda rows, last: logits[rows], observer)
    assert tokens[0] == [] and len(tokens[1]) == 3 and all(t < 32 for t in tokens[1])
    assert torch.isfinite(q).all() and torch.allclose(q.sum(-1), torch.ones(2, q.shape[1]))


def test_kv_sizing_sets_aside_the_features_a_head_may_keep(tiny_model, tiny_head):
    """With an EAGLE-3 head, the KV pools get the fraction of what is free after the features the
    head may have pending (max_batch_size requests x MAX_PENDING rows x 3H) and the activation
    reserve are set aside."""
    from engine import EngineConfig, LLMEngine
    from engine.kv.features import MAX_PENDING
    from engine.kv_sizing import activation_bytes, kv_bytes_per_token

    def engine(free: int) -> LLMEngine:
        config = EngineConfig.from_kwargs(model=str(tiny_model[0]), draft_model=str(tiny_head), dtype="float32",
                                          use_speculative_decoding=True, speculative_method="eagle",
                                          max_batch_size=4, max_seq_len=256, block_size=16, forward_plan="torch",
                                          kv_cache_memory_fraction=0.5)
        return LLMEngine(config, free_memory=lambda device: free)

    roomy = engine(10**12)
    shapes = [roomy.model.shape, roomy.draft_model.shape]
    per_token = kv_bytes_per_token(shapes, [4, 4])
    features = 4 * MAX_PENDING * roomy.draft_model.feature_width * 4
    reserve = activation_bytes(shapes, [4, 4], 4, 5, 512, 256)  # batch 4, the default spec_length 5
    assert engine(features + reserve + 2 * 40 * 16 * per_token).config.num_kv_blocks == 40


def test_a_round_after_a_full_acceptance_is_a_steady_first_pass_not_a_catch_up(tiny_model, tiny_head, reference):
    """After a round that accepted all its k proposals the head has k + 1 features to feed: its
    round's first pass (priced by width), not a long catch-up the policy charges on top. Only the
    prompt is caught up on apart. (The head runs as usual; its tokens are swapped for the target's
    own greedy ones so every proposal is accepted.)"""
    from engine.speculative.policy.k_choice import Choice
    from engine.speculative.proposers.base import Proposal

    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_head), use_speculative_decoding=True,
              speculative_method="eagle", spec_policy="adaptive", spec_length=5, dtype="float32",
              max_seq_len=160, max_batch_size=4)
    spec = llm.engine.speculation
    head, recorder, behind = spec.proposer, RecordingObserver(), []
    head.observer = recorder
    want, drafting = reference[0], head.propose

    def propose(reqs, ks, with_q):
        drafted = drafting(reqs, ks, with_q)
        done = len(reqs[0].output_token_ids)
        return Proposal([want[done:done + len(drafted.tokens[0])]], drafted.q, drafted.sources)

    def choose(rates, caps, draft_rows, catch_up_tokens, catch_up):
        behind.append(catch_up_tokens)
        return Choice(min(5, max(caps)), "policy", {})

    head.propose, spec.planner.policy.choose = propose, choose
    out = llm.generate(PROMPTS[0], greedy())[0]
    assert out.token_ids == want and out.num_accepted_tokens == out.num_draft_tokens
    firsts = [s for s in recorder.seen if s[0] in ("first", "catch_up")]  # each round's first pass
    assert firsts == [("catch_up", len(out.prompt_token_ids))] + [("first", 1, 6)] * 3
    assert behind == [len(out.prompt_token_ids)] + [0] * 3
