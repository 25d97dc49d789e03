"""A checkpoint the forward would compute wrongly is refused at load, naming the config key or the
tensor: quantizations it does not compute (other bit widths, formats, schemes), quantized tensors
without their config, MoE keys in a family loaded as dense, variants the forward lacks, and
tie_word_embeddings against the tensors present."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.model.config_keys import KEYS
from engine.model.families import check_config
from tests.helpers import FAMILIES, make_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tok_dir) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    make_model(path, tok_dir, seed=5, **FAMILIES["qwen3"])
    return path


def _rewritten(src: Path, dst: Path, tensors, **config) -> Path:
    """A copy of `src` with its tensors passed through tensors(name, tensor) -> {name: tensor}
    and config.json fields set (None removes one)."""
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    out = {}
    for name, t in load_file(file).items():
        out.update(tensors(name, t))
    save_file(out, file, metadata={"format": "pt"})
    cfg = {**json.loads((dst / "config.json").read_text()), **config}
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(tuple(f"{n}.weight" for n in LINEARS))


def _fp8_block(name: str, t: torch.Tensor) -> dict:
    """Qwen/Qwen3-8B-FP8's layout: e4m3 weights, one float32 `weight_scale_inv` per 128x128 block."""
    if not _is_linear(name):
        return {name: t}
    rows, cols = -(-t.shape[0] // 128), -(-t.shape[1] // 128)
    scale = t.abs().amax().float().clamp(min=1e-6) / 448.0
    return {name: (t.float() / scale).to(torch.float8_e4m3fn),
            name.removesuffix("weight") + "weight_scale_inv": torch.full((rows, cols), float(scale))}


FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _pack_quantized(name: str, t: torch.Tensor) -> dict:
    """compressed-tensors' pack-quantized W4A16 (RedHatAI/*-quantized.w4a16): int32 `weight_packed`
    (eight 4-bit values a word along the input), `weight_scale` per group of 128, `weight_shape`."""
    if not _is_linear(name):
        return {name: t}
    out_f, in_f = t.shape
    base = name.removesuffix("weight")
    return {base + "weight_packed": torch.zeros(out_f, -(-in_f // 8), dtype=torch.int32),
            base + "weight_scale": torch.ones(out_f, -(-in_f // 128), dtype=torch.bfloat16),
            base + "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}


COMPRESSED_TENSORS_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                    "dynamic": False, "actorder": None, "observer": "minmax"}}}}


def _gptq(name: str, t: torch.Tensor) -> dict:
    """GPTQ's layout (AutoGPTQ / gptqmodel, e.g. Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4): int32 `qweight`
    [in / 8, out], `qzeros` [groups, out / 8], fp16 `scales` [groups, out], int32 `g_idx` [in]."""
    if not _is_linear(name):
        return {name: t}
    out_f, in_f = t.shape
    groups, base = -(-in_f // 128), name.removesuffix("weight")
    return {base + "qweight": torch.zeros(-(-in_f // 8), out_f, dtype=torch.int32),
            base + "qzeros": torch.zeros(groups, -(-out_f // 8), dtype=torch.int32),
            base + "scales": torch.ones(groups, out_f, dtype=torch.float16),
            base + "g_idx": torch.arange(in_f, dtype=torch.int32) // 128}


GPTQ_CONFIG = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "quant_method": "gptq",
               "damp_percent": 0.01, "static_groups": False, "true_sequential": True}


@pytest.mark.parametrize("layout,tensors,config,key", [
    ("fp8", _fp8_block, {**FP8_CONFIG, "fmt": "e5m2"}, "fmt"),
    ("fp8", _fp8_block, {**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme"),
    ("compressed-tensors", _pack_quantized, {**COMPRESSED_TENSORS_CONFIG, "kv_cache_scheme": {"num_bits": 8}},
     "kv_cache_scheme"),
    ("compressed-tensors", _pack_quantized, {**COMPRESSED_TENSORS_CONFIG, "format": "marlin-24"}, "format"),
    ("gptq", _gptq, {**GPTQ_CONFIG, "bits": 3}, "bits"),
    ("gptq", _gptq, {**GPTQ_CONFIG, "quant_method": "bitsandbytes"}, "quant_method"),
])
def test_a_quantization_the_engine_does_not_compute_is_refused_naming_its_key(qwen3, tmp_path, layout, tensors,
                                                                              config, key):
    path = _rewritten(qwen3, tmp_path / layout, tensors, quantization_config=config)
    with pytest.raises(ValueError, match=rf"quantization_config\.{key}=.* is not implemented"):
        LLM(model=str(path), dtype="float32", max_seq_len=64)


@pytest.mark.parametrize("layout,tensors,stored", [
    ("fp8", _fp8_block, "F8_E4M3"), ("compressed-tensors", _pack_quantized, "I32"), ("gptq", _gptq, "I32")])
def test_quantized_tensors_without_their_config_are_refused_by_dtype(qwen3, tmp_path, layout, tensors, stored):
    """The quantization_config stripped (as a careless conversion leaves it): the tensors themselves
    are refused, where before an e4m3 weight was read without its scales."""
    path = _rewritten(qwen3, tmp_path / layout, tensors)
    with pytest.raises(ValueError, match=rf"tensor model\.layers\.0\..* is stored as {stored}: quantized"):
        LLM(model=str(path), dtype="float32", max_seq_len=64)


@pytest.mark.parametrize("family,key", [("qwen3", "num_experts"), ("mistral", "num_local_experts"),
                                        ("llama", "num_experts_per_tok"), ("qwen2", "moe_intermediate_size")])
def test_moe_keys_in_a_dense_family_are_refused(tmp_path, tok_dir, family, key):
    make_model(tmp_path / "src", tok_dir, layers=1, **FAMILIES[family])
    path = _rewritten(tmp_path / "src", tmp_path / "moe", lambda n, t: {n: t}, **{key: 8})
    with pytest.raises(ValueError, match=rf"config.json {key}=8 is refused: mixture-of-experts"):
        LLM(model=str(path), dtype="float32", max_seq_len=64)


@pytest.mark.parametrize("changes,message", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_scaling=.*'dynamic'.* RoPE scaling type"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), r"rope_parameters=.*RoPE scaling type 'longrope'"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is refused: only a SiLU-gated MLP"),
    (dict(mlp_bias=True), r"mlp_bias=True is refused: a bias-free MLP"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5 is refused"),
    (dict(final_logit_softcapping=30.0), r"final_logit_softcapping=30.0 is refused: softcapped logits"),
    (dict(architectures=["LlamaForSequenceClassification"]), r"architectures=.* is refused: only causal-LM"),
    (dict(model_type="gemma2"), r"unsupported model_type 'gemma2' \(supported: llama, mistral, qwen2, qwen3, qwen3_moe\)"),
])
def test_variants_the_forward_lacks_are_refused(tmp_path, tiny_model, changes, message):
    path = _rewritten(tiny_model[0], tmp_path / "m", lambda n, t: {n: t}, **changes)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), dtype="float32", max_seq_len=64)


def test_untied_without_an_output_layer_is_refused(tmp_path, tiny_model):
    """Loaded before as tied, silently: the output layer would be the embedding."""
    untied = json.loads((tiny_model[0] / "config.json").read_text())
    assert not untied.get("tie_word_embeddings")
    path = _rewritten(tiny_model[0], tmp_path / "m", lambda n, t: {} if n == "lm_head.weight" else {n: t})
    with pytest.raises(ValueError, match="tie_word_embeddings is false .* no lm_head.weight"):
        LLM(model=str(path), dtype="float32", max_seq_len=64)


def test_tied_with_a_different_output_layer_is_refused_and_with_the_same_loads(tmp_path, tiny_model):
    path = _rewritten(tiny_model[0], tmp_path / "m", lambda n, t: {n: t}, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings is true but the checkpoint's lm_head.weight differs"):
        LLM(model=str(path), dtype="float32", max_seq_len=64)
    embed = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    same = _rewritten(path, tmp_path / "same", lambda n, t: {n: embed if n == "lm_head.weight" else t})
    assert LLM(model=str(same), dtype="float32", max_seq_len=64).engine.model.lm_head is not None


def test_a_tensor_the_forward_does_not_read_is_refused(tmp_path, tiny_model):
    """An o_proj bias with attention_bias false: transformers would drop it too, but the checkpoint
    says the layer has one, so the output would not be the one it was trained to give."""
    def add_bias(name, t):
        extra = {"model.layers.0.self_attn.o_proj.bias": torch.ones(t.shape[0])} if name.endswith("0.self_attn.o_proj.weight") else {}
        return {name: t, **extra}

    path = _rewritten(tiny_model[0], tmp_path / "m", add_bias)
    with pytest.raises(ValueError, match=r"1 checkpoint tensor\(s\) the forward does not read.*o_proj.bias"):
        LLM(model=str(path), dtype="float32", max_seq_len=64)


def test_the_published_configs_keys_are_all_known(caplog):
    """Every key in the published configs of the four families (as transformers writes them) is in
    a table: implemented, refused or irrelevant; so none is logged as unread."""
    from transformers import AutoConfig

    for family in FAMILIES:
        cfg = AutoConfig.for_model(family).to_dict()
        with caplog.at_level(logging.WARNING, logger="engine.model.families"):
            check_config(cfg, family)
        assert "does not read" not in caplog.text, (family, caplog.text)
    with caplog.at_level(logging.WARNING, logger="engine.model.families"):
        check_config({"model_type": "llama", "embedding_scale": 2.0})
    assert "['embedding_scale']" in caplog.text


def test_every_key_has_a_status_and_a_description():
    assert {k.status for k in KEYS} == {"implemented", "refused", "irrelevant"}
    assert all(k.what for k in KEYS) and len({k.name for k in KEYS}) == len(KEYS)
