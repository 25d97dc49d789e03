"""Tiny random checkpoints (Llama, Mistral, Qwen2, Qwen3) and a tiny tokenizer, built on disk for tests."""

from __future__ import annotations

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]  # the repository

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 🚀 текст",
]


# per family, the config fields that set it apart in published checkpoints (head_dim: Qwen3's
# default is 128, so tiny models give theirs)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=None),  # v0.2 on: full attention
    "qwen2": dict(model_type="qwen2", use_sliding_window=False, sliding_window=4096, max_window_layers=2),
    "qwen3": dict(model_type="qwen3", head_dim=16),
}


def greedy(max_tokens: int = 24):
    """Greedy sampling params for max_tokens tokens, past EOS (a random model's output length is its own)."""
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def fixed_step_prices(monkeypatch) -> None:
    """The per-request policy at fixed prices, not this host's timings: a row's plain step 1 ms, a
    verify token 0.4 of that, drafting free, a draft's catch-up 0.1 ms a token (the prompt's is a
    long one: timed on a loaded host it outweighed these and the policy decoded plainly)."""
    from engine.speculative.policy.costs import MeasuredCosts
    from engine.speculative.policy.per_request import StepCost

    monkeypatch.setattr(StepCost, "seconds", lambda self, total, *rest: 1e-3 * (self.batch + 0.4 * (total - self.batch)))
    monkeypatch.setattr(MeasuredCosts, "catch_up_time", lambda self, tokens: 1e-4 * tokens)


def make_tokenizer(path: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|endoftext|>"]  # the last: a Qwen2 tokenizer adds it when missing
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)
    fast.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    fast.save_pretrained(path)
    return fast


def make_model(path: Path, tokenizer_dir: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, intermediate: int = 128, tied: bool = False,
               rope_scaling: dict | None = None, max_pos: int = 512, dtype=torch.float32,
               vocab_size: int | None = None, model_type: str = "llama", **family):
    """Saves a random-init HF causal LM of `model_type` (llama, mistral, qwen2, qwen3; `family`:
    more config fields) with the tokenizer; returns the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab_size or len(tok), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
        tie_word_embeddings=tied, max_position_embeddings=max_pos, rope_scaling=rope_scaling,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **family,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():  # larger-than-default weights so random models are far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(2.5)
            elif p.dim() == 3:  # a mixture of experts' stacked experts: as strong as a dense MLP
                p.normal_(0.0, 0.3)
            elif name.endswith(".bias"):  # zero at init: random, or a bias would test nothing
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # ones at init: one scale per channel
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model


def pool_for(model, backend: str = "paged", max_slots: int = 4, max_seq_len: int = 256, block_size: int = 16):
    """A KV pool shaped for `model` (no prefix cache)."""
    from engine.model.passes import pool_for as engine_pool_for

    return engine_pool_for(model, max_slots, max_seq_len, backend, block_size)


class InMemoryRecorder:
    """A Recorder that keeps values in dicts (tests, the stats endpoint)."""

    def __init__(self):
        self.counters: dict[tuple, float] = {}
        self.gauges: dict[tuple, float] = {}
        self.observations: dict[tuple, list[float]] = {}

    @staticmethod
    def _key(name: str, labels: dict[str, str]) -> tuple:
        return (name, *sorted(labels.items()))

    def inc(self, name, value, labels):
        key = self._key(name, labels)
        self.counters[key] = self.counters.get(key, 0.0) + value

    def set(self, name, value, labels):
        self.gauges[self._key(name, labels)] = value

    def observe(self, name, value, labels):
        self.observations.setdefault(self._key(name, labels), []).append(value)

    def total(self, name: str, **labels) -> float:
        return sum(v for k, v in self.counters.items() if k[0] == name and all((lk, lv) in k[1:] for lk, lv in labels.items()))


def make_eagle3_head(path: Path, target_dir: Path, *, seed: int = 0, aux: list[int] | None = None,
                     draft_vocab: list[int] | None = None, intermediate: int = 96, lm_scale: float = 1.0,
                     fmt: str = "safetensors", two_back: torch.Tensor | None = None, layout: str = "eagle",
                     norm_before_residual: bool | None = None, qwen3: bool = False,
                     fc_bias: bool = False, norm_before_fc: bool = False, fc_norm: bool = False,
                     norm_output: bool = False, layers: int = 1) -> dict[str, torch.Tensor]:
    """Writes a random EAGLE-3 head for the target at `target_dir` in a published layout and
    returns its tensors (float32, d2t as stored: offsets):
    - layout "eagle", the EAGLE authors' (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): config.json is
      the layer's Llama config naming LlamaForCausalLMEagle3, the layer under `midlayer.`;
    - layout "speculators", the speculators library's (RedHatAI/*-speculator.eagle3): config.json
      with speculators_model_type eagle3 and the layer's config in transformer_layer_config, the
      layer under `layers.0.`.
    Both: fc, the layer, norm, lm_head, d2t, t2d. norm_before_residual: written to config.json
    when not None; qwen3: a Qwen3 layer (q_norm and k_norm); fc_bias: fc.bias too. The norms
    before fc, each its flag in config.json (norm_before_fc under eagle_config in the first layout,
    as NVIDIA's heads write it) and its tensors: norm_before_fc, input_norm.weight [3H]; fc_norm,
    fc_norm.{0,1,2}.weight [H]. norm_output: the head feeds its normed output back. layers > 1:
    plain decoder layers after the first, under `layers.{i}.` (H-wide attention input).

    two_back: the target's embedding [V, H]: the head then guesses the token two back (fc passes
    the first feature through -- the embedding when aux[0] is 0 --, attention and MLP add nothing,
    lm_head is the embedding), right on the short cycles random models fall into, so some of its
    proposals are accepted and some are not."""
    import json

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    H, V, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg.get("head_dim") or H // heads
    ids = torch.tensor(sorted(draft_vocab) if draft_vocab is not None else list(range(V)))
    g = torch.Generator().manual_seed(seed)
    m = {"eagle": "midlayer.", "speculators": "layers.0."}[layout]

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5

    w = {"fc.weight": rand(H, 3 * H),
         m + "hidden_norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
         m + "input_layernorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
         m + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * H, scale=2.0),
         m + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * H, scale=2.0),
         m + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * H),
         m + "self_attn.o_proj.weight": rand(H, heads * head_dim),
         m + "post_attention_layernorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
         m + "mlp.gate_proj.weight": rand(intermediate, H),
         m + "mlp.up_proj.weight": rand(intermediate, H),
         m + "mlp.down_proj.weight": rand(H, intermediate),
         "norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
         "lm_head.weight": rand(len(ids), H, scale=4.0 * lm_scale),
         "d2t": ids - torch.arange(len(ids)),
         "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)}
    if qwen3:
        w[m + "self_attn.q_norm.weight"] = 1 + 0.2 * torch.randn(head_dim, generator=g)
        w[m + "self_attn.k_norm.weight"] = 1 + 0.2 * torch.randn(head_dim, generator=g)
    if fc_bias:
        w["fc.bias"] = 0.3 * torch.randn(H, generator=g)
    if norm_before_fc:
        w["input_norm.weight"] = 1 + 0.5 * torch.randn(3 * H, generator=g)
    if fc_norm:
        for i in range(3):
            w[f"fc_norm.{i}.weight"] = 1 + 0.5 * torch.randn(H, generator=g)
    for i in range(1, layers):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
                  p + "self_attn.q_proj.weight": rand(heads * head_dim, H, scale=2.0),
                  p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, H, scale=2.0),
                  p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, H),
                  p + "self_attn.o_proj.weight": rand(H, heads * head_dim),
                  p + "post_attention_layernorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
                  p + "mlp.gate_proj.weight": rand(intermediate, H),
                  p + "mlp.up_proj.weight": rand(intermediate, H),
                  p + "mlp.down_proj.weight": rand(H, intermediate)})
    if two_back is not None:
        w["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], 1)
        w[m + "self_attn.o_proj.weight"].zero_()
        w[m + "mlp.down_proj.weight"].zero_()
        w["norm.weight"] = torch.ones(H)
        w["lm_head.weight"] = two_back[ids].float() * lm_scale
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(w, str(path / "model.safetensors"))
    else:
        torch.save(w, path / "pytorch_model.bin")
    layer = {"model_type": "qwen3" if qwen3 else "llama", "hidden_size": H, "intermediate_size": intermediate,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
             "num_hidden_layers": layers, "hidden_act": "silu", "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
             "rope_theta": (cfg.get("rope_parameters") or cfg).get("rope_theta", 10000.0), "rope_scaling": None,
             "max_position_embeddings": cfg["max_position_embeddings"], "vocab_size": V,
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    if layout == "eagle":
        config = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": len(ids),
                  "torch_dtype": "float32"}
        if aux is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    else:  # as the speculators library serialises an Eagle3 draft model
        config = {"architectures": ["Eagle3DraftModel"], "draft_vocab_size": len(ids), "dtype": "float32",
                  "eagle_aux_hidden_state_layer_ids": aux, "embed_requires_grad": False, "norm_before_fc": False,
                  "speculators_config": {
                      "algorithm": "eagle3", "default_proposal_method": "greedy",
                      "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                            "speculative_tokens": 3, "verifier_accept_k": 1}],
                      "verifier": {"architectures": cfg.get("architectures", []), "name_or_path": str(target_dir)}},
                  "speculators_model_type": "eagle3", "speculators_version": "0.4.0", "target_hidden_size": None,
                  "transformer_layer_config": layer}
    if norm_before_residual is not None:
        config["norm_before_residual"] = norm_before_residual
    if norm_before_fc:
        (config.setdefault("eagle_config", {}) if layout == "eagle" else config)["norm_before_fc"] = True
    if fc_norm:
        config["fc_norm"] = True
    if norm_output:
        config["norm_output"] = True
    (path / "config.json").write_text(json.dumps(config))
    return w


class RecordingObserver:
    """A CostObserver that keeps every observation."""

    def __init__(self):
        self.seen: list[tuple] = []

    def observe_target(self, batch, tokens, seconds):
        self.seen.append(("target", batch, tokens))

    def observe_draft_first(self, batch, width, seconds):
        self.seen.append(("first", batch, width))

    def observe_draft_steps(self, batch, steps, seconds):
        self.seen.extend([("step", batch)] * steps)

    def observe_catch_up(self, tokens, seconds):
        self.seen.append(("catch_up", tokens))


def toy_lm(seed: int, vocab: int, max_len: int, concentration: float = 0.7,
           one_hot: bool = False) -> dict[tuple, torch.Tensor]:
    """A toy language model: a next-token distribution (float64) over `vocab` tokens for every
    prefix of at most `max_len` tokens (one-hot ones for a deterministic proposer)."""
    import itertools

    import numpy as np

    rng = np.random.default_rng(seed)
    tables = {}
    for length in range(max_len + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            draw = np.eye(vocab)[rng.integers(vocab)] if one_hot else rng.dirichlet([concentration] * vocab)
            tables[prefix] = torch.from_numpy(draw / draw.sum())
    return tables


def chi2_sequences(sequences: list[tuple], target: dict[tuple, torch.Tensor], vocab: int, length: int) -> float:
    """Chi-square p-value of `sequences` (each `length` tokens) against the toy model `target`'s
    joint distribution (cells expected below 5 pooled)."""
    import itertools

    import numpy as np
    from scipy.stats import chisquare

    cells = list(itertools.product(range(vocab), repeat=length))
    index = {c: i for i, c in enumerate(cells)}
    counts = np.bincount([index[tuple(s)] for s in sequences], minlength=len(cells))
    probs = np.array([float(np.prod([target[c[:j]][c[j]].item() for j in range(length)])) for c in cells])
    expected = probs / probs.sum() * len(sequences)
    big = expected >= 5
    return chisquare(np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())).pvalue


def continue_with(target: dict[tuple, torch.Tensor], prefix: tuple, length: int, gen: torch.Generator) -> tuple:
    """`prefix` continued by sampling the toy model `target` to `length` tokens."""
    while len(prefix) < length:
        prefix += (int(torch.multinomial(target[prefix], 1, generator=gen)),)
    return prefix

