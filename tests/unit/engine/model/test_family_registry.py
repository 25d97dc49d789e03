"""The model-family registry, and docs/contributing.md's recipe "Add a model family" run as
written: a family registered from this file alone (no edit to the engine) loads a checkpoint of
its model_type, with its own options, layer reader and MLP, and refuses its own config keys."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM
from engine.model.config_keys import Key
from engine.model.families import FAMILIES, Family, llama_options, read_dense_layer, register_family
from engine.model.mlp import SwiGLU
from tests.helpers import greedy

PROMPTS = ["def add(a, b):", "class Point:\n    def"]


class DoubledSwiGLU(SwiGLU):
    """A toy family's MLP: SwiGLU, output doubled (its own math: the C token step does not run it)."""

    dense = False

    def __call__(self, x, lw, linear, silu_mul):
        return 2.0 * super().__call__(x, lw, linear, silu_mul)


@pytest.fixture(scope="module")
def toy_family():
    family = Family("toy_llama", llama_options, read_dense_layer, DoubledSwiGLU(),
                    keys=(Key("toy_scale", "refused", "a toy key: only 1 is implemented",
                              refuse=lambda v, cfg: None if v in (None, 1) else "only 1 is implemented"),))
    register_family(family)
    yield family
    FAMILIES.pop("toy_llama")


def _as_toy(src, dst, **config):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "toy_llama", **config}))
    return dst


def test_a_family_registered_from_a_test_loads_with_its_own_pieces(tmp_path, tiny_model, toy_family):
    """Its MLP doubles Llama's: the same as a Llama checkpoint whose down_proj is doubled."""
    from safetensors.torch import load_file, save_file

    toy = _as_toy(tiny_model[0], tmp_path / "toy")
    doubled = tmp_path / "doubled"
    shutil.copytree(tiny_model[0], doubled)
    tensors = load_file(doubled / "model.safetensors")
    save_file({k: v * 2 if k.endswith("down_proj.weight") else v for k, v in tensors.items()},
              doubled / "model.safetensors", metadata={"format": "pt"})
    ours = LLM(model=str(toy), dtype="float32", max_seq_len=64)
    assert ours.engine.model.shape.model_type == "toy_llama"
    reference = LLM(model=str(doubled), dtype="float32", max_seq_len=64)
    assert [o.token_ids for o in ours.generate(PROMPTS, greedy(12))] == \
        [o.token_ids for o in reference.generate(PROMPTS, greedy(12))]
    llama, toy_model = (LLM(model=str(p), dtype="float32", max_seq_len=64).engine.model for p in (tiny_model[0], toy))
    assert {type(lw.mlp) for lw in toy_model.layers} == {DoubledSwiGLU} and llama.layers[0].mlp.dense


def test_a_family_with_its_own_mlp_keeps_the_fused_kernels(tmp_path, tiny_model, toy_family):
    """Its MLP runs inside the fused path (the fused SiLU-and-multiply passed to it), with the fused
    norms, RoPE and K/V write around it (Triton's interpreter on CPU); tokens as eager."""
    toy = _as_toy(tiny_model[0], tmp_path / "toy")
    common = dict(model=str(toy), dtype="float32", max_seq_len=64, forward_plan="torch")
    fused, eager = LLM(**common, fused_kernels="on"), LLM(**common, fused_kernels="off")
    assert fused.engine.fused_kernels == {"target": "fused"} and fused.engine.model.fused
    assert [o.token_ids for o in fused.generate(PROMPTS, greedy(8))] == \
        [o.token_ids for o in eager.generate(PROMPTS, greedy(8))]


def test_the_c_token_step_refuses_a_familys_own_mlp(tmp_path, tiny_model, toy_family):
    from engine.config import ModelPlan
    from engine.model.loader import load_model

    toy = _as_toy(tiny_model[0], tmp_path / "toy")
    with pytest.raises(ValueError, match="the C token step computes SwiGLU, not the toy_llama family's own MLP"):
        load_model(toy, ModelPlan("float32", token_step=True), "cpu", 64)


def test_a_familys_own_mlp_takes_the_float32_row_invariant_rule(tmp_path, tiny_model, toy_family):
    """An MLP holding no weights of its own runs on its layer's gate_up and down, so the column-block
    kernel takes it: a multi-token pass then computes bitwise what one-token steps compute."""
    from engine.config import ModelPlan
    from engine.model.invariance import choose_invariance
    from engine.model.kernels import one_sequence
    from engine.model.loader import load_model

    if one_sequence.load() is None:
        pytest.skip("the CPU kernels do not build here")
    model = load_model(_as_toy(tiny_model[0], tmp_path / "toy"), ModelPlan("float32"), "cpu", 64)
    assert choose_invariance(model, "on") == "on" and model.row_invariant


def test_a_familys_own_config_key_is_refused_by_its_table(tmp_path, tiny_model, toy_family):
    toy = _as_toy(tiny_model[0], tmp_path / "toy", toy_scale=3)
    with pytest.raises(ValueError, match=r"config.json toy_scale=3 is refused: only 1 is implemented"):
        LLM(model=str(toy), dtype="float32", max_seq_len=64)


def test_a_model_type_not_registered_names_the_registered_ones(tmp_path, tiny_model):
    other = _as_toy(tiny_model[0], tmp_path / "other", model_type="gemma2")
    with pytest.raises(ValueError, match=r"unsupported model_type 'gemma2' \(supported: llama, mistral, qwen2, qwen3"):
        LLM(model=str(other), dtype="float32", max_seq_len=64)
