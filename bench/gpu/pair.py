"""A weight-free target and prefix draft that agree at a chosen rate, so speculation on a random
model of a real shape runs at a realistic acceptance through the ordinary acceptance rule.

The draft is the target's embedding, first `keep` layers, final norm and head. Three scales, each
found by bisection, teacher-forced on the target's own greedy continuations (what greedy
speculation sees), make the pair:
- boost: every layer's `o_proj` and `down_proj` times it. At a random init the layers write little
  into the residual next to the token's own embedding, so a prefix predicts what the whole model
  predicts (with tied embeddings: the current token again) whatever the later layers do;
- gain: the final norm's weight, which both share, times it, sharpening every distribution to a
  trained model's entropy (a random model's are near uniform: nothing to agree on);
- eps: the layers after the prefix write into the residual scaled by it, nudging the draft's
  hidden state instead of replacing it, so the two agree more as eps falls. Greedy agreement is
  the per-token acceptance of greedy speculation.
Nothing here touches the engine: the model is transformers' (its tensors are then served to the
engine, scaled), and acceptance is whatever the engine's rule makes of it. A random model's greedy
text soon repeats itself; the pair sets the acceptance of a proposer, not the text's realism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ENTROPY = 1.5  # nats: the target's mean entropy, near a trained code model's at T = 1
EPS_RANGE = (1e-4, 1.0)
GAIN_RANGE = (1.0, 64.0)
BOOSTS = (1, 2, 4, 8, 16, 32)
ROOM = 0.25  # boost until the unscaled pair agrees at most this far below the wanted rate


@dataclass
class Agreement:
    """Teacher-forced agreement of the prefix draft with the target over the target's greedy tokens."""

    greedy: float  # share of positions where both argmaxes agree: greedy speculation's per-token alpha
    alpha_t1: float  # mean sum_v min(p, q) at temperature 1: sampled speculation's per-token alpha
    entropy: float  # the target's mean entropy (nats)
    positions: int


class PrefixPair:
    """A transformers Llama made into a target whose `keep`-layer prefix agrees with it, in place:
    every layer's output projections (each expert's, in a mixture of experts) times `boost`, the later layers' times `eps` more, the final
    norm times `gain`."""

    def __init__(self, hf, keep: int):
        self.hf, self.keep = hf, keep
        self.boost, self.eps, self.gain = 1.0, 1.0, 1.0

    @torch.no_grad()
    def set(self, boost: float | None = None, eps: float | None = None, gain: float | None = None) -> None:
        for i, layer in enumerate(self.hf.model.layers):
            factor = (boost or self.boost) / self.boost
            if i >= self.keep:
                factor *= (eps or self.eps) / self.eps
            layer.self_attn.o_proj.weight.mul_(factor)
            mlp = layer.mlp  # a dense MLP, or a mixture of experts (transformers stacks their weights)
            (mlp.down_proj.weight if hasattr(mlp, "down_proj") else mlp.experts.down_proj).mul_(factor)
        if gain is not None:
            self.hf.model.norm.weight.mul_(gain / self.gain)
        self.boost, self.eps, self.gain = boost or self.boost, eps or self.eps, gain or self.gain

    @torch.inference_mode()
    def agreement(self, prompts: torch.Tensor, new_tokens: int) -> Agreement:
        """prompts [B, P] on the model's device; the target's greedy continuation of new_tokens,
        then one pass over it: the target's and the draft's next-token distributions."""
        hf = self.hf
        ids = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = hf(ids, output_hidden_states=True)
        at = slice(prompts.shape[1] - 1, ids.shape[1] - 1)  # the positions that predict generated tokens
        target = out.logits[:, at].float()  # [B, new, V]
        draft = hf.lm_head(hf.model.norm(out.hidden_states[self.keep][:, at])).float()  # [B, new, V]
        p, q = target.softmax(-1), draft.softmax(-1)
        return Agreement(greedy=(target.argmax(-1) == draft.argmax(-1)).float().mean().item(),
                         alpha_t1=torch.minimum(p, q).sum(-1).mean().item(),
                         entropy=-(p * p.clamp_min(1e-30).log()).sum(-1).mean().item(),
                         positions=target.shape[0] * target.shape[1])


def bisect(measure, lo: float, hi: float, want: float, increasing: bool, steps: int, tolerance: float):
    """Geometric bisection of x in [lo, hi] for measure(x) ~= want (monotone in x); the last
    (x, value) measured, stopping early within `tolerance`."""
    x, value = None, None
    for _ in range(steps):
        x = math.sqrt(lo * hi)
        value = measure(x)
        if abs(value - want) <= tolerance:
            break
        if (value < want) == increasing:
            lo = x
        else:
            hi = x
    return x, value


def calibrate(pair: PrefixPair, prompts: torch.Tensor, greedy_alpha: float, new_tokens: int = 32,
              steps: int = 12, tolerance: float = 0.02, log=print) -> dict:
    """Finds the boost (room below `greedy_alpha` at eps 1), the gain for ENTROPY (at a small eps),
    then eps for `greedy_alpha`; leaves the pair at them and returns what was found and measured."""
    def agreement(**scales) -> Agreement:
        pair.set(**scales)
        return pair.agreement(prompts, new_tokens)

    pair.set(gain=8.0)
    for boost in BOOSTS:
        unscaled = agreement(boost=boost, eps=1.0).greedy
        if unscaled <= greedy_alpha - ROOM:
            break
    log(f"pair: boost {pair.boost:g}: the unscaled prefix agrees at {unscaled:.3f}")
    pair.set(eps=0.03)
    gain, entropy = bisect(lambda g: agreement(gain=g).entropy, *GAIN_RANGE, ENTROPY, increasing=False,
                           steps=steps, tolerance=0.1)
    log(f"pair: gain {gain:.3g} gives entropy {entropy:.2f} nats")
    eps, _ = bisect(lambda e: agreement(eps=e).greedy, *EPS_RANGE, greedy_alpha, increasing=False, steps=steps,
                    tolerance=tolerance)
    found = pair.agreement(prompts, new_tokens)
    log(f"pair: eps {eps:.3g} gives greedy agreement {found.greedy:.3f} (alpha at T=1 {found.alpha_t1:.3f}, "
        f"entropy {found.entropy:.2f})")
    return {"keep_layers": pair.keep, "boost": pair.boost, "eps": eps, "gain": gain,
            "wanted_greedy_alpha": greedy_alpha, "teacher_forced": vars(found)}
