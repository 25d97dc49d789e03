"""What the forward does with each `config.json` key of the families it loads: computes it
(implemented), refuses the checkpoint where the value asks for math it does not compute
(refused), or has no use for it (irrelevant: training, generation defaults, metadata). A key in
none of the tables is logged as unread (families.check_config). docs/models/config-keys.md is
generated from `KEYS` and each family's own keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.model.quant.schemes import scheme_of

FOUR = ("llama", "mistral", "qwen2", "qwen3")  # the families whose published configs the table describes
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _unset(value) -> bool:
    return value in (None, 0, False, [], {}, "")


@dataclass(frozen=True)
class Key:
    """One config.json key: its status, which values the forward computes, and a test that
    returns why a value is refused (None: computed, or no use for it)."""

    name: str
    status: str  # "implemented", "refused" or "irrelevant"
    what: str  # what the forward does with it, or why it refuses
    families: tuple[str, ...] = FOUR  # the families whose published configs carry it
    refuse: Callable[[object, dict], str | None] = lambda value, cfg: None


def _refuse_any(why: str):
    return lambda value, cfg: None if _unset(value) else why


def _refuse_unless(accepted: tuple, why: str):
    return lambda value, cfg: None if value in accepted else why


def _rope_type(value, cfg) -> str | None:
    params = value or {}
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else None
    if kind not in ROPE_TYPES:
        return f"RoPE scaling type {kind!r} is not implemented (implemented: {', '.join(ROPE_TYPES)})"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        return "a partial rotary factor other than 1.0 is not implemented"
    return None


def _architectures(value, cfg) -> str | None:
    if not value:
        return None
    if not any(isinstance(a, str) and a.endswith("ForCausalLM") for a in value):
        return "only causal-LM checkpoints (an architecture ending in ForCausalLM) are implemented"
    return None


def _quantization(value, cfg) -> str | None:
    try:
        scheme_of({"quantization_config": value})
    except ValueError as e:
        return str(e)
    return None


_MOE = "mixture-of-experts layers in a dense family (it would be loaded as dense; qwen3_moe computes them)"

KEYS: tuple[Key, ...] = (
    # the shape
    Key("model_type", "implemented", "the family: llama, mistral, qwen2 or qwen3; others are refused"),
    Key("architectures", "implemented", "checked: an architecture ending in ForCausalLM", refuse=_architectures),
    Key("vocab_size", "implemented", "rows of the embedding and the output layer"),
    Key("hidden_size", "implemented", "the residual width"),
    Key("intermediate_size", "implemented", "the MLP's width"),
    Key("num_hidden_layers", "implemented", "decoder layers"),
    Key("num_attention_heads", "implemented", "query heads"),
    Key("num_key_value_heads", "implemented", "KV heads (grouped-query attention; absent: as many as query heads)"),
    Key("head_dim", "implemented", "per-head width (absent: hidden_size / num_attention_heads)"),
    Key("rms_norm_eps", "implemented", "every RMSNorm's epsilon"),
    Key("max_position_embeddings", "implemented", "the longest sequence (max_seq_len is checked against it)"),
    Key("tie_word_embeddings", "implemented", "the output layer is the embedding; checked against the tensors "
        "present: untied needs lm_head.weight, tied refuses an lm_head.weight that differs from the embedding"),
    # attention
    Key("rope_theta", "implemented", "RoPE's base"),
    Key("rope_scaling", "implemented", "RoPE scaling: linear, llama3, yarn; other types are refused",
        refuse=_rope_type),
    Key("rope_parameters", "implemented", "transformers 5's name for rope_theta with rope_scaling: as those",
        refuse=_rope_type),
    Key("partial_rotary_factor", "implemented", "1.0 only: RoPE over part of each head is refused", families=(),
        refuse=lambda v, cfg: None if v in (None, 1, 1.0) else "a partial rotary factor other than 1.0 is not implemented"),
    Key("attention_bias", "implemented", "biases on q, k, v and o (Llama, Qwen3); Qwen2's q/k/v biases are always on",
        families=("llama", "qwen3")),
    Key("sliding_window", "implemented", "sequences are kept within the window, where sliding-window attention "
        "is full attention (max_seq_len is bounded by it)", families=("mistral", "qwen2", "qwen3")),
    Key("use_sliding_window", "implemented", "Qwen: whether sliding_window applies at all",
        families=("qwen2", "qwen3")),
    Key("max_window_layers", "implemented", "Qwen: layers from this one on use the window",
        families=("qwen2", "qwen3")),
    Key("layer_types", "implemented", "Qwen: which layers use the window (full_attention or sliding_attention)",
        families=("qwen2", "qwen3")),
    # the MLP
    Key("hidden_act", "implemented", "the MLP's gate: silu only; others are refused",
        refuse=_refuse_unless(("silu", None), "only a SiLU-gated MLP is implemented")),
    Key("mlp_bias", "implemented", "false only: MLP biases are refused", families=("llama",),
        refuse=_refuse_any("a bias-free MLP only is implemented")),
    # mixture of experts, in a family loaded as dense
    Key("num_experts", "refused", _MOE, families=(), refuse=_refuse_any(_MOE)),
    Key("num_local_experts", "refused", _MOE, families=(), refuse=_refuse_any(_MOE)),
    Key("num_experts_per_tok", "refused", _MOE, families=(), refuse=_refuse_any(_MOE)),
    Key("moe_intermediate_size", "refused", _MOE, families=(), refuse=_refuse_any(_MOE)),
    Key("shared_expert_intermediate_size", "refused", _MOE, families=(), refuse=_refuse_any(_MOE)),
    Key("decoder_sparse_step", "refused", _MOE, families=(), refuse=_refuse_any(_MOE)),
    # quantized weights
    Key("quantization_config", "implemented", "quantized linears in the published layouts: Qwen's FP8, "
        "compressed-tensors float- and pack-quantized, GPTQ, AWQ (docs/models/quantized.md); others are refused, "
        "naming the key", families=(), refuse=_quantization),
    Key("compression_config", "implemented", "compressed-tensors' older name for quantization_config: as it",
        families=(), refuse=_quantization),
    # other families' variants, refused if a config of ours carries them
    Key("attn_logit_softcapping", "refused", "softcapped attention scores (Gemma 2) are not implemented", families=(),
        refuse=_refuse_any("softcapped attention scores are not implemented")),
    Key("final_logit_softcapping", "refused", "softcapped logits (Gemma 2) are not implemented", families=(),
        refuse=_refuse_any("softcapped logits are not implemented")),
    Key("query_pre_attn_scalar", "refused", "a query scale other than 1/sqrt(head_dim) (Gemma) is not implemented",
        families=(), refuse=_refuse_any("a custom query scale is not implemented")),
    Key("embedding_multiplier", "refused", "scaled embeddings (Granite) are not implemented", families=(),
        refuse=_refuse_unless((None, 1, 1.0), "scaled embeddings are not implemented")),
    Key("logits_scaling", "refused", "scaled logits (Granite) are not implemented", families=(),
        refuse=_refuse_unless((None, 1, 1.0), "scaled logits are not implemented")),
    Key("residual_multiplier", "refused", "scaled residuals (Granite) are not implemented", families=(),
        refuse=_refuse_unless((None, 1, 1.0), "scaled residuals are not implemented")),
    Key("attention_multiplier", "refused", "a custom attention scale (Granite) is not implemented", families=(),
        refuse=_refuse_any("a custom attention scale is not implemented")),
    Key("no_rope_layers", "refused", "layers without RoPE (SmolLM3, Llama 4) are not implemented", families=(),
        refuse=_refuse_any("layers without RoPE are not implemented")),
    Key("clip_qkv", "refused", "clipped q/k/v (OLMo) are not implemented", families=(),
        refuse=_refuse_any("clipped q/k/v are not implemented")),
    Key("use_qk_norm", "refused", "a q/k norm outside Qwen3 is not implemented", families=(),
        refuse=_refuse_any("a q/k norm outside Qwen3 is not implemented")),
    # no use in the forward
    Key("eos_token_id", "irrelevant", "not in the forward; generation stops at it (with the tokenizer's and "
        "generation_config.json's)"),
    Key("bos_token_id", "irrelevant", "not in the forward; the tokenizer adds it"),
    Key("pad_token_id", "irrelevant", "not in the forward (no padding tokens are computed)"),
    Key("attention_dropout", "irrelevant", "training only"),
    Key("initializer_range", "irrelevant", "training only"),
    Key("pretraining_tp", "irrelevant", "the same matmuls split into slices; the same math", families=("llama",)),
    Key("use_cache", "irrelevant", "the engine always keeps a KV cache"),
    Key("torch_dtype", "irrelevant", "the dtype the weights were saved in; EngineConfig.dtype chooses the compute"),
    Key("dtype", "irrelevant", "transformers 5's name for torch_dtype"),
    Key("router_aux_loss_coef", "irrelevant", "training only", families=()),
    Key("output_router_logits", "irrelevant", "training only", families=()),
    Key("transformers_version", "irrelevant", "metadata"),
    Key("_name_or_path", "irrelevant", "metadata"),
)
BY_NAME = {k.name: k for k in KEYS}
# keys every transformers PretrainedConfig may write: outputs, tasks and generation defaults, none in the forward
COMMON_METADATA = frozenset({
    "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder", "is_decoder", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "torchscript", "pruned_heads", "use_return_dict",
    "_attn_implementation_autoset", "keys_to_ignore_at_inference", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "tf_legacy_loss", "use_bfloat16",
})


def check_values(cfg: dict, where: str = "", skip: tuple[str, ...] = (), keys: dict[str, Key] | None = None) -> None:
    """ValueError naming the first key (not in `skip`) whose value the forward refuses (`keys`:
    by name, default the common table)."""
    keys = BY_NAME if keys is None else keys
    for name, value in cfg.items():
        key = keys.get(name)
        why = key.refuse(value, cfg) if key is not None and name not in skip else None
        if why is not None:
            raise ValueError(f"{where + ': ' if where else ''}config.json {name}={_short(value)} is refused: {why} "
                             f"(docs/models/config-keys.md)")


def unread_keys(cfg: dict, keys: dict[str, Key]) -> list[str]:
    """The config.json keys no table knows (logged: if one changes the math, the output differs)."""
    return sorted(set(cfg) - set(keys) - COMMON_METADATA)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
