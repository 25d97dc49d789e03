"""Model families by config.json `model_type`: a registry of what tells each apart, so that a family
is added by registering it (docs/contributing.md, "Add a model family"), with no if-chain in the
forward. A family gives the ModelShape options it sets from its config (biases, q/k norms, a
sliding window), how a layer's tensors are read, its MLP, and any config.json keys of its own
for the refusal table (config_keys.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.config_keys import BY_NAME, Key, check_values, unread_keys
from engine.model.experts import Experts
from engine.model.mlp import MLP, SWIGLU
from engine.model.quant.linear import fuse
from engine.model.rope import Rope
from engine.model.shape import LayerWeights, ModelShape, MoEShape

log = logging.getLogger(__name__)

def read_dense_layer(reader, shape: ModelShape, pre: str, mlp: MLP | None = None) -> LayerWeights:
    """One layer's tensors (HF names under `pre`, from `reader`: get(name), linear(module) and
    `name in reader`), q/k/v and gate/up fused (linears kept quantized where the checkpoint is);
    mlp: an MLP holding its own weights (no gate_up or down read), else the family's over them."""
    attn = pre + "self_attn."
    attention = dict(attn_norm=reader.get(pre + "input_layernorm.weight"),  # read in the layer's order
                     qkv=fuse([reader.linear(attn + f"{n}_proj") for n in "qkv"]), o=reader.linear(attn + "o_proj"),
                     mlp_norm=reader.get(pre + "post_attention_layernorm.weight"))
    dense = dict(gate_up=fuse([reader.linear(pre + f"mlp.{n}_proj") for n in ("gate", "up")]),
                 down=reader.linear(pre + "mlp.down_proj"), mlp=family_of(shape.model_type).mlp) if mlp is None \
        else dict(gate_up=None, down=None, mlp=mlp)
    weights = LayerWeights(**attention, **dense)
    if shape.qkv_bias:
        weights.qkv_bias = torch.cat([reader.get(attn + f"{n}_proj.bias") for n in "qkv"])
    if shape.o_bias:
        weights.o_bias = reader.get(attn + "o_proj.bias")
    if shape.qk_norm:  # one row per head: the query heads' rows, then the key heads'
        weights.qk_norm = torch.cat([reader.get(attn + "q_norm.weight").expand(shape.num_heads, -1),
                                     reader.get(attn + "k_norm.weight").expand(shape.num_kv_heads, -1)])
    return weights


@dataclass(frozen=True)
class Family:
    """What sets a model family apart from the common decoder (RMSNorm, RoPE, GQA, an MLP)."""

    model_type: str  # config.json's model_type
    options: Callable[[dict], dict]  # config.json -> the ModelShape fields it sets beyond the common ones
    read_layer: Callable[..., LayerWeights] = read_dense_layer  # (reader, shape, "model.layers.{i}.") -> weights
    mlp: MLP = SWIGLU  # its dense layers' MLP (mlp.py), over their gate_up and down
    keys: tuple[Key, ...] = ()  # config.json keys of its own: implemented, refused or irrelevant


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> None:
    """Makes `family.model_type` loadable."""
    FAMILIES[family.model_type] = family


def family_of(model_type: str) -> Family:
    """The registered family of this model_type (ValueError naming the supported ones)."""
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def check_config(cfg: dict, where: str = "") -> Family:
    """The family of a config.json, refusing a family not registered and keys whose values ask
    for math the forward does not compute (ValueError naming the key and its value); the keys no
    table knows are logged."""
    family = family_of(cfg.get("model_type", "llama"))
    keys = {**BY_NAME, **{k.name: k for k in family.keys}}
    check_values(cfg, where, keys=keys)
    unknown = unread_keys(cfg, keys)
    if unknown:
        log.warning("%sconfig.json keys the forward does not read: %s; if one changes the model's math, the "
                    "output differs from transformers'", f"{where}: " if where else "", unknown)
    return family


def shape_of(cfg: dict) -> ModelShape:
    """The ModelShape of a config.json (its family's options over the common fields)."""
    family = family_of(cfg.get("model_type", "llama"))
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return ModelShape(
        model_type=family.model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=Rope.from_hf_config(cfg, head_dim),
        max_position_embeddings=_positions(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **family.options(cfg),
    )


def _positions(cfg: dict) -> int:
    """Positions the model is meant for: yarn scaling stretches the original ones by its factor
    (Qwen2.5 keeps max_position_embeddings at 32,768 and reaches 131,072 with factor 4)."""
    positions = cfg.get("max_position_embeddings", 2048)
    yarn = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if yarn.get("rope_type", yarn.get("type")) == "yarn" and yarn.get("factor"):
        original = yarn.get("original_max_position_embeddings") or positions
        positions = max(positions, int(yarn["factor"] * original))
    return positions


def llama_options(cfg: dict) -> dict:
    """Llama and Mistral: attention_bias puts biases on q, k, v and o; Mistral's window applies to every layer."""
    bias = bool(cfg.get("attention_bias"))
    window = cfg.get("sliding_window")
    return {"qkv_bias": bias, "o_bias": bias, "sliding_window": int(window) if window else None}


def _qwen_window(cfg: dict) -> int | None:
    """Qwen's window: only when switched on, and only in layers past max_window_layers."""
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
        for i in range(cfg["num_hidden_layers"])]
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window") or "sliding_attention" not in layer_types or not window:
        return None
    return int(window)


def qwen2_options(cfg: dict) -> dict:
    """Qwen2: biases on q, k and v, always."""
    return {"qkv_bias": True, "o_bias": False, "sliding_window": _qwen_window(cfg)}


def qwen3_options(cfg: dict) -> dict:
    """Qwen3: an RMSNorm on each head of q and k; attention_bias as Llama's."""
    bias = bool(cfg.get("attention_bias"))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "sliding_window": _qwen_window(cfg)}


for _family in (Family("llama", llama_options), Family("mistral", llama_options), Family("qwen2", qwen2_options),
                Family("qwen3", qwen3_options)):
    register_family(_family)



# --- Qwen3-MoE: Qwen3's attention, a mixture of experts for the MLP (experts.py) ----------------
def qwen3_moe_options(cfg: dict) -> dict:
    """Qwen3's options, and the experts: every layer's MLP but mlp_only_layers' and those off the decoder_sparse_step."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    step = cfg.get("decoder_sparse_step") or 1
    dense = tuple(i for i in range(cfg["num_hidden_layers"])
                  if i in (cfg.get("mlp_only_layers") or ()) or not experts or (i + 1) % step)
    moe = MoEShape(num_experts=experts, top_k=cfg["num_experts_per_tok"], intermediate_size=cfg["moe_intermediate_size"],
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
    return {**qwen3_options(cfg), "moe": moe}


def read_qwen3_moe_layer(reader, shape: ModelShape, pre: str) -> LayerWeights:
    """A Qwen3-MoE layer: `mlp.gate.weight` (the router) and `mlp.experts.{e}.{gate,up,down}_proj.weight`."""
    if int(pre.split(".")[-2]) in shape.moe.dense_layers:
        return read_dense_layer(reader, shape, pre)
    def dense(module: str) -> torch.Tensor:
        weight = reader.linear(module)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"quantization_config: {module} is quantized; quantized experts are not implemented "
                             "(docs/models/quantized.md)")
        return weight
    mlp = pre + "mlp."
    experts = range(shape.moe.num_experts)
    gate_up = torch.stack([torch.cat([dense(f"{mlp}experts.{e}.{n}_proj") for n in ("gate", "up")]) for e in experts])
    down = torch.stack([dense(f"{mlp}experts.{e}.down_proj") for e in experts])
    moe = Experts(reader.get(mlp + "gate.weight"), gate_up, down, shape.moe.top_k, shape.moe.norm_topk_prob)
    return read_dense_layer(reader, shape, pre, mlp=moe)


_IMPLEMENTED_MOE = "Qwen3-MoE's experts (engine/model/experts.py)"
QWEN3_MOE_KEYS = (
    Key("num_experts", "implemented", _IMPLEMENTED_MOE + ": how many", families=("qwen3_moe",)),
    Key("num_local_experts", "implemented", "transformers' name for num_experts", families=("qwen3_moe",)),
    Key("num_experts_per_tok", "implemented", "the top k experts each token goes through", families=("qwen3_moe",)),
    Key("moe_intermediate_size", "implemented", "each expert's intermediate size", families=("qwen3_moe",)),
    Key("norm_topk_prob", "implemented", "the top k router weights renormalised to sum to one",
        families=("qwen3_moe",)),
    Key("decoder_sparse_step", "implemented", "every step-th layer has experts, the others a dense MLP",
        families=("qwen3_moe",)),
    Key("mlp_only_layers", "implemented", "layers with a dense MLP of intermediate_size", families=("qwen3_moe",)),
    Key("router_aux_loss_coef", "irrelevant", "a training loss", families=("qwen3_moe",)),
    Key("output_router_logits", "irrelevant", "a training output", families=("qwen3_moe",)),
)
register_family(Family("qwen3_moe", qwen3_moe_options, read_qwen3_moe_layer, keys=QWEN3_MOE_KEYS))
