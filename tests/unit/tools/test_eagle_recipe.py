"""The EAGLE-3 training recipe's head (tools/pair/eagle_head.py) against the engine's reader: a head
trained by the recipe must draft at serving time exactly as it was trained to (same features,
same inputs, same positions), and a run resumes only on its own layers."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from engine.config import ModelPlan
from engine.model.eagle3 import load_eagle3
from engine.model.loader import load_model
from engine.model.passes import pass_inputs, pool_for
from tests.helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
from pair.eagle_head import (  # noqa: E402
    TrainableEagle3Head,
    chosen_layers,
    exported_vocabulary,
    load_exported,
    wider_vocabulary,
)

AUX = [0, 1, 1]  # the tiny target's two layers (layer 0's input is the embedding)


def _head(cfg: dict, draft_vocab: int, seed: int) -> TrainableEagle3Head:
    torch.manual_seed(seed)
    head = TrainableEagle3Head(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                               cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"],
                               draft_vocab, cfg["hidden_size"], cfg["rms_norm_eps"], 10000.0)
    with torch.no_grad():  # weights large enough that a wrong wiring shows in the logits
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    return head


def test_a_recipe_head_drafts_in_the_engine_as_it_was_trained(tmp_path, tiny_model):
    """Step 1 of the training rollout at every position (target features + the next token) and
    step 2 of the last chain (the head's own output fed back) give the logits the engine's head
    gives over the exported checkpoint, catching up on the features then stepping once."""
    path, hf = tiny_model
    cfg = json.loads((path / "config.json").read_text())
    vocab = cfg["vocab_size"]
    d2t = torch.arange(0, vocab, 3)  # a reduced draft vocabulary
    head = _head(cfg, d2t.numel(), seed=4)
    head.export(tmp_path / "head", d2t, vocab, cfg, AUX, dtype=torch.float32)

    tokens = torch.randint(0, vocab, (1, 14), generator=torch.Generator().manual_seed(1))  # [1, 14]
    with torch.no_grad():
        hs = hf(input_ids=tokens, output_hidden_states=True).hidden_states  # hs[i]: the input of layer i
        features = torch.cat([hs[i] for i in AUX], dim=-1)  # [1, 14, 3H]
        T = 12
        step1, step2 = head.rollout(features[:, :T], hs[0][:, 1:], steps=2)  # [1, T, Vd] each

    target = load_model(path, ModelPlan(dtype="float32"), "cpu", 64)
    served = load_eagle3(tmp_path / "head", target, 64)
    pool = pool_for(served, max_slots=1, max_seq_len=64, backend="paged", block_size=4)
    slot = pool.allocate_slot([])[0]
    ids = tokens[0].tolist()
    x = pass_inputs(served, pool, [slot], [ids[1:T + 1]], [0])  # position j: features of j, token j + 1
    logits, out = served.step(x.ids, x.positions, x.view, features[:, :T], None)  # [1, T, V], [1, T, H]
    torch.testing.assert_close(logits[0][:, d2t], step1[0], rtol=1e-4, atol=1e-4)
    assert torch.isinf(logits[0][:, 1]).all()  # id 1 is outside the draft vocabulary
    x = pass_inputs(served, pool, [slot], [[ids[T + 1]]], [T])  # chain T - 1's second step
    logits, _ = served.step(x.ids, x.positions, x.view, out[:, -1:], x.last)  # [1, V]
    torch.testing.assert_close(logits[0, d2t], step2[0, T - 1], rtol=1e-4, atol=1e-4)


def test_an_exported_head_starts_a_new_run_only_with_a_vocabulary_inside_or_around_its_own(tmp_path, tiny_model):
    cfg = json.loads((tiny_model[0] / "config.json").read_text())
    d2t = torch.arange(0, cfg["vocab_size"], 2)
    trained = _head(cfg, d2t.numel(), seed=2)
    trained.export(tmp_path, d2t, cfg["vocab_size"], cfg, AUX, dtype=torch.float32)
    assert torch.equal(exported_vocabulary(tmp_path), d2t)
    fresh = _head(cfg, d2t.numel(), seed=3)
    load_exported(fresh, tmp_path, d2t)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), trained.state_dict().values()))
    with pytest.raises(ValueError, match="neither a part of the other"):
        load_exported(fresh, tmp_path, d2t + 1)
    overlapping = torch.cat([d2t[:-1], torch.tensor([1])])  # the same size, one id not the export's
    with pytest.raises(ValueError, match="neither a part of the other"):
        load_exported(fresh, tmp_path, overlapping)


def test_a_larger_draft_vocabulary_keeps_the_exported_rows_and_starts_the_others_from_the_warm_start(tmp_path,
                                                                                                     tiny_model):
    cfg = json.loads((tiny_model[0] / "config.json").read_text())
    d2t = torch.arange(0, cfg["vocab_size"], 2)
    trained = _head(cfg, d2t.numel(), seed=2)
    trained.export(tmp_path, d2t, cfg["vocab_size"], cfg, AUX, dtype=torch.float32)
    by_frequency = torch.tensor([7, 4, 9, 0, 11, 13])  # 4 and 0 are in the export already
    wider = wider_vocabulary(d2t, by_frequency, d2t.numel() + 3)
    assert torch.equal(wider, torch.tensor(sorted(d2t.tolist() + [7, 9, 11])))
    with pytest.raises(ValueError, match="only"):
        wider_vocabulary(d2t, by_frequency, d2t.numel() + 5)
    with pytest.raises(ValueError, match="cannot hold"):
        wider_vocabulary(d2t, by_frequency, d2t.numel() - 1)
    larger = _head(cfg, wider.numel(), seed=3)
    start = larger.lm_head.weight.detach().clone()  # [len(wider), H]: the warm start's rows
    load_exported(larger, tmp_path, wider)
    old = torch.isin(wider, d2t)
    torch.testing.assert_close(larger.lm_head.weight[old], trained.lm_head.weight)
    torch.testing.assert_close(larger.lm_head.weight[~old], start[~old])
    assert torch.equal(larger.fc.weight, trained.fc.weight)


def test_a_smaller_draft_vocabulary_keeps_the_exported_output_rows_of_its_ids(tmp_path, tiny_model):
    cfg = json.loads((tiny_model[0] / "config.json").read_text())
    d2t = torch.arange(0, cfg["vocab_size"], 2)
    trained = _head(cfg, d2t.numel(), seed=2)
    trained.export(tmp_path, d2t, cfg["vocab_size"], cfg, AUX, dtype=torch.float32)
    kept = d2t[[0, 3, 5, 9]]  # target ids 0, 6, 10, 18
    smaller = _head(cfg, kept.numel(), seed=3)
    load_exported(smaller, tmp_path, kept)
    assert torch.equal(smaller.lm_head.weight, trained.lm_head.weight[[0, 3, 5, 9]])
    assert torch.equal(smaller.fc.weight, trained.fc.weight)


def test_aux_layers_are_three_distinct_layers_in_order_and_a_resumed_run_keeps_its_own():
    assert chosen_layers(None, 8, None) == [1, 4, 7]
    assert chosen_layers([7, 4, 1], 8, None) == [1, 4, 7]  # the order the engine fuses them in
    assert chosen_layers(None, 8, [2, 4, 5]) == [2, 4, 5]
    for bad in ([1, 1, 2], [1, 4, 8], [1, 2]):
        with pytest.raises(ValueError, match="three distinct layers"):
            chosen_layers(bad, 8, None)
    with pytest.raises(ValueError, match="resumed reads layers"):
        chosen_layers([1, 4, 7], 8, [2, 4, 5])


def test_the_training_dtype_is_a_named_choice_or_the_faster_one_timed():
    from pair.train import autocast, training_dtype

    assert training_dtype("float32") is torch.float32 and training_dtype("bfloat16") is torch.bfloat16
    assert training_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        training_dtype("float16")
    x = torch.randn(4, 8)
    with autocast(torch.float32):
        assert (x @ x.T).dtype is torch.float32  # float32: no autocast at all
    with autocast(torch.bfloat16):
        assert (x @ x.T).dtype is torch.bfloat16


def test_another_generated_set_is_named_by_seed_and_rows():
    import argparse

    from train_eagle_head import generated_set

    assert generated_set("59:2048") == (59, 2048)
    for bad in ("59", "59:", ":2048", "59:0", "a:1", "59:-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="SEED:ROWS"):
            generated_set(bad)


def test_rejections_at_tokens_outside_the_draft_vocabulary_are_counted_where_the_round_stopped():
    from types import SimpleNamespace

    from bench.alpha import rejections_outside

    # prefill token 5; round 1 accepts 2 of 3 then the target's 9; round 2 accepts all 2 (+ bonus 4);
    # round 3 accepts 0 of 2, the target's 8
    out = SimpleNamespace(token_ids=[5, 1, 2, 9, 3, 3, 4, 8], accepted_per_round=[2, 2, 0], proposed_per_round=[3, 2, 2])
    assert rejections_outside([out], {1, 2, 3, 4, 5, 8}) == 0.5  # 9 is outside, 8 inside
    assert rejections_outside([out], {1, 2, 3, 4, 5}) == 1.0
    assert rejections_outside([out], set(range(10))) == 0.0
    out.token_ids.append(6)  # a plain step after the rounds (the length guard's last token)
    assert rejections_outside([out], {1, 2, 3, 4, 5, 8}) == 0.5
    out.token_ids[:] = out.token_ids[:6]  # rounds that claim more tokens than the output has
    with pytest.raises(ValueError, match="steps without a proposal"):
        rejections_outside([out], set(range(10)))
