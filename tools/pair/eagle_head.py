"""The trainable EAGLE-3 head and its training-time test, for the recipe in tools/train_eagle_head.py.

The head reads three of the target's hidden states (the inputs of layers `aux_layers`), fuses them
(fc: 3H -> H), and with the embedding of the next token runs one decoder layer whose attention
takes both (2H wide), then a norm and an output layer over a reduced draft vocabulary. Step 1 of a
rollout starts from the target's features; steps 2..K from the head's own previous (pre-norm)
output, as at serving time. Training-time test ("TTT"): every step of the rollout is trained, each
query attending to the real context up to its chain's start plus the chain's own earlier steps,
exactly the keys it meets when drafting.

Exported in the layout published for EAGLE-3 heads (see engine/model/eagle3.py for the reader).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


# published tensor name -> this module's state_dict key
_EXPORTED = {"fc.weight": "fc.weight", "midlayer.hidden_norm.weight": "hidden_norm",
             "midlayer.input_layernorm.weight": "input_norm", "midlayer.self_attn.q_proj.weight": "q.weight",
             "midlayer.self_attn.k_proj.weight": "k.weight", "midlayer.self_attn.v_proj.weight": "v.weight",
             "midlayer.self_attn.o_proj.weight": "o.weight", "midlayer.post_attention_layernorm.weight": "post_norm",
             "midlayer.mlp.gate_proj.weight": "gate.weight", "midlayer.mlp.up_proj.weight": "up.weight",
             "midlayer.mlp.down_proj.weight": "down.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight"}


class TrainableEagle3Head(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 draft_vocab: int, target_hidden: int, eps: float, rope_theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.input_norm = nn.Parameter(torch.ones(hidden))
        self.q = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_norm = nn.Parameter(torch.ones(hidden))
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.rope_theta = rope_theta
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        ang = positions.float()[:, None] * inv[None]  # [T, D/2]
        ang = torch.cat([ang, ang], dim=-1)[None, :, None]  # [1, T, 1, D]
        return ang.cos(), ang.sin()

    def rollout(self, features: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """features [B, T, 3H_t] (target, position i), embeds [B, T + steps, H] (token i + 1 at
        index i). Returns, per step s = 1..steps, the draft logits [B, T, Vd] of chain i at step s
        (its prediction of token i + s + 1)."""
        B, T, _ = features.shape
        G = self.heads // self.kv_heads
        hidden = self.fc(features)  # [B, T, H]
        causal = torch.ones(T, T, dtype=torch.bool, device=features.device).tril()  # [T, T] key j <= chain i
        k1 = v1 = None
        diag_k: list[torch.Tensor] = []  # each [B, kv_heads, T, D]: chain i's own earlier steps
        diag_v: list[torch.Tensor] = []
        out = []
        for s in range(steps):
            x = torch.cat([self._norm(embeds[:, s:s + T], self.input_norm), self._norm(hidden, self.hidden_norm)], -1)
            cos, sin = self._rope(torch.arange(s, s + T, device=features.device))
            q = _rotate(self.q(x).view(B, T, self.heads, self.head_dim), cos, sin).transpose(1, 2)  # [B, h, T, D]
            k = _rotate(self.k(x).view(B, T, self.kv_heads, self.head_dim), cos, sin).transpose(1, 2)  # [B, kv, T, D]
            v = self.v(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
            if s == 0:
                k1, v1 = k, v
            else:
                diag_k.append(k)
                diag_v.append(v)
            qg = q.reshape(B, self.kv_heads, G, T, self.head_dim)  # [B, kv, G, T, D]
            scale = self.head_dim ** -0.5
            ctx = torch.einsum("bkgtd,bkjd->bkgtj", qg, k1) * scale  # [B, kv, G, T, T]
            ctx = ctx.masked_fill(~causal, float("-inf"))
            own = [torch.einsum("bkgtd,bktd->bkgt", qg, kk)[..., None] * scale for kk in diag_k]  # each [B, kv, G, T, 1]
            probs = torch.cat([ctx, *own], dim=-1).float().softmax(-1).to(q.dtype)
            attn = torch.einsum("bkgtj,bkjd->bkgtd", probs[..., :T], v1)
            for t, vv in enumerate(diag_v):
                attn = attn + probs[..., T + t:T + t + 1] * vv[:, :, None]
            attn = attn.reshape(B, self.heads, T, self.head_dim).transpose(1, 2).reshape(B, T, -1)
            h = hidden + self.o(attn)
            y = self._norm(h, self.post_norm)
            h = h + self.down(F.silu(self.gate(y)) * self.up(y))
            out.append(self.lm_head(self._norm(h, self.norm)))
            hidden = h
        return out

    def export(self, out: Path, d2t: torch.Tensor, vocab_size: int, target_config: dict, aux_layers: list[int],
               dtype: torch.dtype = torch.bfloat16) -> None:
        """Writes config.json + model.safetensors in the published EAGLE-3 layout. d2t: [Vd] target
        id of each draft id (stored as offsets, target = draft + d2t, as published)."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[d2t] = True
        state = self.state_dict()
        w = {name: state[key] for name, key in _EXPORTED.items()}
        tensors = {n: t.detach().to(dtype).contiguous() for n, t in w.items()}
        tensors["d2t"] = (d2t - torch.arange(d2t.numel())).to(torch.int64)
        tensors["t2d"] = t2d
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.fc.out_features,
            "target_hidden_size": self.fc.in_features // 3,
            "intermediate_size": self.gate.out_features,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": target_config["max_position_embeddings"],
            "vocab_size": vocab_size,
            "draft_vocab_size": int(d2t.numel()),
            "tie_word_embeddings": False,
            "bos_token_id": target_config.get("bos_token_id"),
            "eos_token_id": target_config.get("eos_token_id"),
            "pad_token_id": target_config.get("pad_token_id"),
            "torch_dtype": str(dtype).removeprefix("torch."),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True},
        }
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def recipe_aux_layers(num_layers: int) -> list[int]:
    """Low / middle / high target layers whose inputs the head reads: 1, L // 2 and L - 1.

    EAGLE-3 takes 2, L // 2 and L - 3, which on a 32-layer target reads 28 of its 32 layers' work;
    on our 8-layer target it would leave the last three unseen. This keeps EAGLE-3's proportions
    (2/32, 16/32 and 29/32 of 8 layers round to 1, 4 and 7)."""
    return [1, num_layers // 2, num_layers - 1]


def chosen_layers(asked: list[int] | None, num_layers: int, resumed: list[int] | None) -> list[int]:
    """The aux layers of a run: those of the checkpoint it resumes (asking for others is an
    error), else `asked` or recipe_aux_layers; three distinct layers in 0..L-1, in layer order
    (the order the engine fuses them in)."""
    layers = sorted(asked) if asked else resumed or recipe_aux_layers(num_layers)
    if resumed is not None and layers != resumed:
        raise ValueError(f"--aux-layers {layers}: the checkpoint being resumed reads layers {resumed}")
    if len(set(layers)) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"--aux-layers {layers}: need three distinct layers of the target's 0..{num_layers - 1}")
    return layers


def exported_vocabulary(path: Path) -> torch.Tensor:
    """d2t (target id of each draft id) of a head exported by `export`."""
    from safetensors.torch import load_file

    offsets = load_file(str(Path(path) / "model.safetensors"))["d2t"]
    return offsets + torch.arange(offsets.numel())


def load_exported(head: TrainableEagle3Head, path: Path, d2t: torch.Tensor) -> None:
    """Copies the weights of a head exported by `export` into `head`, as the start of a new run.
    `d2t` is the exported head's draft vocabulary, a part of it (a smaller vocabulary keeps the
    output rows of its ids) or a larger one holding all of it (see wider_vocabulary): the output
    rows of the ids the export lacks keep what `head` has (the recipe's warm start: the target's)."""
    from safetensors.torch import load_file

    w = load_file(str(Path(path) / "model.safetensors"))
    exported = exported_vocabulary(path)
    row_of = {int(t): i for i, t in enumerate(exported)}
    ids = d2t.tolist()
    known = [i for i, t in enumerate(ids) if t in row_of]  # rows of d2t the export has
    if len(known) != min(len(d2t), len(exported)):
        raise ValueError(f"{path}: its draft vocabulary ({len(exported)} ids) and this run's ({len(d2t)}) are "
                         "neither a part of the other (--draft-vocab)")
    state = head.state_dict()
    if state["lm_head.weight"].shape[0] != len(d2t):
        raise ValueError(f"the head has {state['lm_head.weight'].shape[0]} output rows for {len(d2t)} draft ids")
    lm_head = state["lm_head.weight"].clone()  # [len(d2t), H]
    lm_head[known] = w["lm_head.weight"][[row_of[ids[i]] for i in known]].float()
    w["lm_head.weight"] = lm_head
    for name, key in _EXPORTED.items():
        if w[name].shape != state[key].shape:
            raise ValueError(f"{path}: {name} is {tuple(w[name].shape)}, this head's is {tuple(state[key].shape)}")
        state[key] = w[name].float()
    head.load_state_dict(state)


def wider_vocabulary(exported: torch.Tensor, by_frequency: torch.Tensor, size: int) -> torch.Tensor:
    """A draft vocabulary of `size` ids holding all of `exported` and then the most frequent
    others (`by_frequency`: target ids, most frequent first), sorted: d2t."""
    have = set(exported.tolist())
    if size < len(have):
        raise ValueError(f"a draft vocabulary of {size} ids cannot hold the exported head's {len(have)}")
    extra = [t for t in by_frequency.tolist() if t not in have][:size - len(have)]
    if len(have) + len(extra) < size:
        raise ValueError(f"a draft vocabulary of {size} ids: only {len(have) + len(extra)} ids to choose from")
    return torch.tensor(sorted(have.union(extra)), dtype=torch.long)


def step_weights(steps: int, decay: float = 0.8) -> list[float]:
    """Loss weight of each rollout step (later steps matter only when earlier ones were accepted)."""
    w = [decay ** s for s in range(steps)]
    return [x * steps / sum(w) for x in w]


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
