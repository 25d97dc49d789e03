"""An EAGLE-3 draft head: a decoder layer (or a few) over the target's own features.

Step 1 fuses three target hidden states (the inputs of its layers `aux_layers`) with fc (3H -> H);
every step then norms the next token's embedding (the target's, shared) and the hidden state
separately, feeds both side by side (2H) to attention, keeps the hidden state as the residual, runs
the MLP, and returns the pre-norm output (fed back as the next step's hidden state) and, through
`norm` and `lm_head`, logits over the draft vocabulary, mapped to target ids by d2t.

Two published checkpoint layouts are read (docs/speculative/eagle3-heads.md):
- the EAGLE authors' (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; vLLM's and SGLang's
  llama_eagle3.py): config.json is the layer's Llama config with an architecture naming Eagle3,
  `draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; the layer's tensors
  under `midlayer.`;
- the speculators library's (vllm-project/speculators, e.g. RedHatAI/*-speculator.eagle3; vLLM's
  speculators config): config.json has `speculators_model_type: eagle3`, the layer's config in
  `transformer_layer_config`, and `draft_vocab_size`, `norm_before_residual` (vLLM reads it as
  true when absent), `target_hidden_size` and `eagle_aux_hidden_state_layer_ids` at the top; the
  layer's tensors under `layers.0.`.
Both: `fc.weight` [H, 3H_target] (and `fc.bias`, where written); the layer's
`{input_layernorm, hidden_norm, post_attention_layernorm}.weight`, `self_attn.{q,k,v}_proj.weight`
[*, 2H], `self_attn.o_proj.weight`, `mlp.{gate,up,down}_proj.weight` (a Qwen3 layer adds
`self_attn.{q,k}_norm.weight`); `norm.weight`; `lm_head.weight` [draft_vocab, H]; `d2t`
[draft_vocab] (target id = draft id + d2t); `t2d` [vocab] (bool); optionally
`embed_tokens.weight`. Weights in model.safetensors or pytorch_model.bin. Optional norms of the
features before fc, each with its config flag (as SGLang applies them): `norm_before_fc`,
`input_norm.weight` [3H_target] over all three; `fc_norm`, `fc_norm.{0,1,2}.weight` [H_target]
one per target layer; and `norm_output`: the state fed back is the final norm's output. A head
of num_hidden_layers > 1 has plain decoder layers after the first, under `layers.{i}.`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import ModelPlan
from engine.kv.protocol import KVView
from engine.model.config_keys import check_values
from engine.model.families import read_dense_layer, shape_of
from engine.model.kernels import one_sequence
from engine.model.shape import LayerWeights, ModelShape
from engine.model.token_step import TokenStep
from engine.model.transformer import Transformer


def is_eagle3(path: Path) -> bool:
    """Whether the checkpoint at `path` is an EAGLE-3 head (its config.json names an Eagle3
    architecture, or is a speculators library config: read_head_config refuses other kinds)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    return "speculators_model_type" in cfg or any("eagle3" in a.lower() for a in cfg.get("architectures") or [])


@dataclass(frozen=True)
class HeadConfig:
    """An EAGLE-3 head's config.json, in either published layout, read into one form."""

    layer: dict  # the decoder layer's (Llama or Qwen3) config
    draft_vocab_size: int | None
    target_hidden_size: int | None
    aux_layer_ids: list[int] | None
    norm_before_residual: bool  # the layer's residual is hidden_norm(hidden), not hidden itself
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc (input_norm)
    fc_norm: bool = False  # an RMSNorm over each target layer's features before fc (fc_norm.{i})
    norm_output: bool = False  # the state fed back to the next step is the final norm's output

    @property
    def shape(self) -> ModelShape:
        """The head's shape: its layers, its output over the draft vocabulary."""
        layer = {**self.layer, "num_hidden_layers": self.layer.get("num_hidden_layers", 1), "tie_word_embeddings": False,
                 "vocab_size": self.draft_vocab_size or self.layer["vocab_size"]}
        return shape_of(layer)


def read_head_config(path: Path) -> HeadConfig:
    """The head's config.json at `path`; ValueError naming what this reader does not implement."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if "speculators_model_type" in cfg:
        layer = cfg.get("transformer_layer_config")
        if cfg["speculators_model_type"] != "eagle3" or not isinstance(layer, dict):
            raise ValueError(f"EAGLE-3 head {path}: a speculators config needs speculators_model_type 'eagle3' and a "
                             f"transformer_layer_config (got {cfg['speculators_model_type']!r})")
        head = HeadConfig(layer, cfg.get("draft_vocab_size"), cfg.get("target_hidden_size"),
                          cfg.get("eagle_aux_hidden_state_layer_ids"), bool(cfg.get("norm_before_residual", True)),
                          bool(cfg.get("norm_before_fc")), bool(cfg.get("fc_norm")), bool(cfg.get("norm_output")))
    else:  # layer ids at the top first, as vLLM reads them; norm_before_fc in eagle_config first (NVIDIA's heads)
        nested = cfg.get("eagle_config") or {}
        head = HeadConfig(cfg, cfg.get("draft_vocab_size"), cfg.get("target_hidden_size"),
                          cfg.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids"),
                          bool(cfg.get("norm_before_residual", False)),
                          bool(nested.get("norm_before_fc", cfg.get("norm_before_fc"))), bool(cfg.get("fc_norm")),
                          bool(cfg.get("norm_output")))
    for keys in (cfg, head.layer):  # a quantized or mixture-of-experts head is refused as a model is
        check_values(keys, f"EAGLE-3 head {path}", skip=("architectures",))
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size") if k not in head.layer]
    if "vocab_size" not in head.layer and head.draft_vocab_size is None:
        missing.append("vocab_size (or draft_vocab_size)")
    if missing:
        raise ValueError(f"EAGLE-3 head {path}: config.json lacks {', '.join(missing)}")
    layers = head.layer.get("num_hidden_layers", 1)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"EAGLE-3 head {path}: num_hidden_layers must be a positive integer, got "
                         f"{head.layer['num_hidden_layers']!r}")
    if head.layer.get("attention_bias"):
        raise ValueError(f"EAGLE-3 head {path}: attention_bias is not implemented for heads")
    return head


def read_head_shape(path: Path) -> ModelShape:
    """The shape of the head at `path` (no weights read)."""
    return read_head_config(path).shape


def aux_layers(head: HeadConfig, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads: the checkpoint's choice, else EAGLE-3's
    default low / middle / high (2, L // 2, L - 3)."""
    ids = head.aux_layer_ids
    ids = tuple(sorted(ids)) if ids else (2, target_layers // 2, target_layers - 3)  # fused in layer order
    if len(ids) != 3 or not all(0 <= i < target_layers for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)}: need three layers of the target's {target_layers}")
    return ids


class Eagle3Head(Transformer):
    """The head's forward over its own KV pool. `forward` (the Transformer interface, used to time
    passes) is a draft step from a zero hidden state; the proposer calls `step`. Layer 0 is the
    EAGLE-3 layer (2H-wide attention input); any further layers are plain decoder layers over its
    output, as vLLM runs them. With `plan.token_step` (one-layer heads), passes of a few tokens run
    as C calls (token_step.c)."""

    def __init__(self, shape: ModelShape, embed: torch.Tensor, layers: list[LayerWeights], hidden_norm: torch.Tensor,
                 fc: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, draft_to_target: torch.Tensor,
                 target_vocab: int, aux: tuple[int, ...], max_positions: int, plan: ModelPlan,
                 fc_bias: torch.Tensor | None = None, norm_before_residual: bool = False,
                 input_norm: torch.Tensor | None = None, fc_norms: torch.Tensor | None = None,
                 norm_output: bool = False):
        self.fc = fc  # [hidden, 3 * target hidden]
        self.fc_bias = fc_bias  # [hidden] or None
        self.input_norm = input_norm  # [3 * target hidden] or None: norm_before_fc
        self.fc_norms = fc_norms  # [3, target hidden] or None: fc_norm, one per target layer
        self.norm_output = norm_output
        self.feature_width = fc.shape[1]
        self.hidden_norm = hidden_norm  # [hidden]
        self.norm_before_residual = norm_before_residual
        self.draft_to_target = draft_to_target  # [draft_vocab] target id of each draft id
        self.target_vocab = target_vocab
        self.aux_layers = aux
        # with the token step, a narrow pass fuses its features on the one-sequence matmul (torch's
        # call costs more than the product for a few rows); the plain weight, taken before the reorder
        fc_rows = one_sequence.bf16_if_exact(fc) if plan.token_step else None
        self._fc_rows = fc_rows if fc_rows is not None and one_sequence.supports(fc_rows) else None
        if plan.token_step and len(layers) > 1:
            raise ValueError(f"forward_plan token_step: the C token step runs one-layer EAGLE-3 heads; this one has "
                             f"{len(layers)} layers")
        super().__init__(shape, embed, layers, final_norm, lm_head, max_positions, plan)
        self.identity_vocab = draft_to_target.numel() == target_vocab and bool(
            (draft_to_target == torch.arange(target_vocab, device=draft_to_target.device)).all())

    def _weights(self) -> list[torch.Tensor]:
        return super()._weights() + [self.fc, self.hidden_norm] + [
            t for t in (self.fc_bias, self.input_norm, self.fc_norms) if t is not None]

    def _make_token_step(self) -> TokenStep:
        return TokenStep(self.shape, self.embed, self.layers, self.final_norm, self.lm_head, self.cos, self.sin,
                         self.plan.token_step_rows, self.hidden_norm, self.norm_before_residual)

    def _reorder_for_onednn(self) -> None:
        super()._reorder_for_onednn()
        self.fc = torch.ops.mkldnn._reorder_linear_weight(self.fc)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.zeros(*input_ids.shape, self.shape.hidden_size, dtype=self.dtype, device=self.device)
        return self.step(input_ids, position_ids, kv, hidden, logits_index)[0]

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVView, hidden: torch.Tensor,
             logits_index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, position_ids [B, T]; hidden [B, T, 3 * target hidden] (target features) or
        [B, T, hidden] (the head's own output). Returns logits over the target vocabulary (-inf
        outside the draft vocabulary) [B, (T,) vocab] and the state fed back to the next step [B, (T,)
        hidden] (the layer's output, or the final norm's with norm_output), at logits_index (or every
        position when None)."""
        B, T = input_ids.shape
        narrow = self._token_step is not None and self._token_step.takes(B, T, logits_index)
        if hidden.shape[-1] != self.shape.hidden_size:
            hidden = self._normed_features(hidden)
            hidden = one_sequence.load().linear(hidden, self._fc_rows).to(self.dtype) \
                if narrow and self._fc_rows is not None else self._linear(hidden, self.fc)  # [B, T, hidden]
            if self.fc_bias is not None:
                hidden = hidden + self.fc_bias
        if narrow:
            logits, h = self._token_step.head_pass(input_ids, position_ids, kv, hidden, logits_index)
            return self._target_logits(logits), self._rms_norm(h, self.final_norm) if self.norm_output else h
        lw = self.layers[0]
        normed = self._rms_norm(hidden, self.hidden_norm)  # [B, T, hidden]
        x = torch.cat([self._rms_norm(F.embedding(input_ids, self.embed), lw.attn_norm), normed], dim=-1)  # [B, T, 2H]
        rope = self.cos[position_ids].unsqueeze(2), self.sin[position_ids].unsqueeze(2)
        residual = normed if self.norm_before_residual else hidden
        groups = self._attention_inputs(kv, position_ids)
        with self._attention_backends():
            h = residual + self._attention_block(x, lw, self._linear, rope, kv, 0, groups)
            h = h + self._mlp_block(h, lw, self._linear)  # [B, T, hidden]
            for i, lw in enumerate(self.layers[1:], start=1):  # further layers: plain decoder layers
                h = h + self._attention_block(self._rms_norm(h, lw.attn_norm), lw, self._linear, rope, kv, i, groups)
                h = h + self._mlp_block(h, lw, self._linear)
        if logits_index is not None:
            h = h[torch.arange(B, device=h.device), logits_index]  # [B, hidden]
        out = self._rms_norm(h, self.final_norm)
        logits = self._linear(out, self.lm_head).float()  # [B, (T,) draft_vocab]
        return self._target_logits(logits), out if self.norm_output else h

    def _normed_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [B, T, 3 * target hidden] through the head's norms before fc, if it has any."""
        if self.input_norm is not None:
            features = self._rms_norm(features, self.input_norm)
        if self.fc_norms is not None:
            split = features.unflatten(-1, self.fc_norms.shape)  # [B, T, 3, target hidden]
            features = self._rms_norm(split, self.fc_norms).flatten(-2)
        return features

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] over the target vocabulary [..., vocab] (-inf outside)."""
        if self.identity_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        return full.index_copy_(-1, self.draft_to_target, logits)


class _HeadTensors:
    """The head's tensors by name (model.safetensors or pytorch_model.bin), in one dtype and on one
    device; a missing one is a ValueError naming it."""

    def __init__(self, path: Path, dtype: torch.dtype, device):
        if (path / "model.safetensors").exists():
            from safetensors.torch import load_file

            self.raw = load_file(str(path / "model.safetensors"))
        elif (path / "pytorch_model.bin").exists():
            self.raw = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(f"EAGLE-3 head {path}: no model.safetensors or pytorch_model.bin")
        self.path, self.dtype, self.device = path, dtype, device

    def __contains__(self, name: str) -> bool:
        return name in self.raw

    def get(self, name: str) -> torch.Tensor:
        if name not in self.raw:
            raise ValueError(f"EAGLE-3 head {self.path}: tensor {name!r} missing")
        if not self.raw[name].is_floating_point() or self.raw[name].element_size() < 2:  # float8 or integers
            raise ValueError(f"EAGLE-3 head {self.path}: tensor {name} is stored as {self.raw[name].dtype}: "
                             "quantized weights are not implemented")
        return self.raw[name].to(device=self.device, dtype=self.dtype)

    def linear(self, module: str) -> torch.Tensor:
        """A head's linears are dense."""
        return self.get(module + ".weight")

    def layer_prefix(self) -> str:
        """Where the decoder layer's tensors are: `midlayer.` (the EAGLE authors') or `layers.0.`
        (the speculators library's); vLLM reads either name under either config."""
        return "midlayer." if any(k.startswith("midlayer.") for k in self.raw) else "layers.0."


def _check_fit(path: Path, head: HeadConfig, w: _HeadTensors, t: ModelShape) -> None:
    """ValueError naming what of the head's config does not fit this reader or the target."""
    hidden, vocab = head.layer["hidden_size"], head.layer.get("vocab_size", t.vocab_size)
    for tensor, flag, asked in (("input_norm.weight", "norm_before_fc", head.norm_before_fc),
                                ("fc_norm.0.weight", "fc_norm", head.fc_norm)):
        if tensor in w and not asked:  # read without it, the head would propose from other features than it learnt
            raise ValueError(f"EAGLE-3 head {path}: has {tensor} (a norm before fc) but its config does not set {flag}")
    problems = []
    if vocab != t.vocab_size:
        problems.append(f"vocab_size {vocab} != the target's {t.vocab_size}")
    if (head.target_hidden_size or hidden) != t.hidden_size:
        problems.append(f"target_hidden_size {head.target_hidden_size or hidden} != the target's hidden_size "
                        f"{t.hidden_size}")
    if "embed_tokens.weight" not in w and hidden != t.hidden_size:
        problems.append(f"hidden_size {hidden} != the target's {t.hidden_size} (the head shares its embedding)")
    if problems:
        raise ValueError(f"EAGLE-3 head {path} does not fit target model: " + "; ".join(problems))


def load_eagle3(path: Path, target: Transformer, max_positions: int, token_step: bool = False,
                token_step_rows: int = ModelPlan.token_step_rows) -> Eagle3Head:
    """The head at `path` for `target` (sharing its embedding, in its dtype, on its device), its
    passes of up to token_step_rows tokens on the token step if asked; ValueError names what does
    not match the target."""
    path = Path(path)
    head = read_head_config(path)
    shape = dataclasses.replace(head.shape, max_position_embeddings=target.shape.max_position_embeddings)
    w = _HeadTensors(path, target.dtype, target.device)
    _check_fit(path, head, w, target.shape)
    hidden, vocab, draft_vocab = shape.hidden_size, target.shape.vocab_size, shape.vocab_size
    device = target.device
    prefix = w.layer_prefix()
    layers = [read_dense_layer(w, shape, prefix)] + [read_dense_layer(w, shape, f"layers.{i}.")
                                                     for i in range(1, shape.num_layers)]
    fc = w.get("fc.weight")
    if layers[0].qkv.shape[1] != 2 * hidden or fc.shape != (hidden, 3 * target.shape.hidden_size) \
            or any(lw.qkv.shape[1] != hidden for lw in layers[1:]):
        raise ValueError(f"EAGLE-3 head {path}: attention inputs {[lw.qkv.shape[1] for lw in layers]} (want 2 x "
                         f"{hidden}, then {hidden}) or fc {tuple(fc.shape)} (want ({hidden}, "
                         f"{3 * target.shape.hidden_size})) do not match")
    offsets = w.raw.get("d2t", torch.zeros(draft_vocab, dtype=torch.long)).to(device=device, dtype=torch.long)
    d2t = offsets + torch.arange(draft_vocab, device=device) if offsets.shape == (draft_vocab,) else None
    lm_head = w.get("lm_head.weight") if "lm_head.weight" in w else None
    if d2t is None or int(d2t.max()) >= vocab or int(d2t.min()) < 0 or lm_head is None \
            or lm_head.shape != (draft_vocab, hidden):
        raise ValueError(f"EAGLE-3 head {path}: d2t and lm_head.weight must cover draft_vocab_size {draft_vocab} "
                         f"draft ids (hidden {hidden}) mapped into the target's {vocab}")
    if torch.unique(d2t).numel() != draft_vocab:  # q over target ids is the head's q moved, never summed
        raise ValueError(f"EAGLE-3 head {path}: d2t maps two draft ids to the same target id")
    embed = w.get("embed_tokens.weight") if "embed_tokens.weight" in w else target.embed
    input_norm, fc_norms = _feature_norms(path, head, w, target.shape.hidden_size)
    return Eagle3Head(shape, embed, layers, w.get(prefix + "hidden_norm.weight"), fc, w.get("norm.weight"),
                      lm_head, d2t, vocab, aux_layers(head, target.shape.num_layers), max_positions,
                      ModelPlan(str(target.dtype).removeprefix("torch."), token_step=token_step,
                                token_step_rows=token_step_rows),
                      w.get("fc.bias") if "fc.bias" in w else None, head.norm_before_residual,
                      input_norm, fc_norms, head.norm_output)


def _feature_norms(path: Path, head: HeadConfig, w: _HeadTensors,
                   target_hidden: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The norms before fc the config asks for: input_norm.weight [3 * target hidden] and the
    fc_norm.{0,1,2}.weight [target hidden] stacked [3, target hidden]."""
    wanted = {"input_norm.weight": 3 * target_hidden} if head.norm_before_fc else {}
    wanted.update({f"fc_norm.{i}.weight": target_hidden for i in range(3)} if head.fc_norm else {})
    tensors = {name: w.get(name) for name in wanted}
    for name, width in wanted.items():
        if tensors[name].shape != (width,):
            raise ValueError(f"EAGLE-3 head {path}: {name} has shape {tuple(tensors[name].shape)}, want ({width},) "
                             "(from the target's hidden size)")
    input_norm = tensors.get("input_norm.weight")
    fc_norms = torch.stack([tensors[f"fc_norm.{i}.weight"] for i in range(3)]) if head.fc_norm else None
    return input_norm, fc_norms
