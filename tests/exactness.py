"""Exactness machinery shared by the statistical tests: a 16-token target and a perturbed draft,
its exact marginals by enumeration, sampling them speculatively, the chi-square p-value, and a
wrong tree rule (the teeth of the tree tests)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from engine.grammar import GrammarCompiler
from engine.sampling import Adjustments, SamplingRows, adjusted_probs
from engine.structured_output import StructuredOutput
from engine.tokenizer import Tokenizer
from tests.helpers import FAMILIES, make_model

VOCAB = 16
PROMPT = [3, 7, 2, 9, 4]
N = 3000
CONFIGS = {
    "t1": dict(temperature=1.0),
    "t07_topk": dict(temperature=0.7, top_k=6),
    "topp": dict(temperature=1.0, top_p=0.8),
    "rep_penalty": dict(temperature=1.0, repetition_penalty=1.8),
    "presence_frequency": dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.7),
    "logit_bias": dict(temperature=1.0, logit_bias={3: 2.5, 8: -4.0, 12: 1.0}),
}


def make_pair(tpath, dpath, tok_dir, model_type: str = "llama"):
    """A 16-token target of the family and a perturbed copy as draft; returns the HF target."""
    family = dict(FAMILIES[model_type], head_dim=16)
    target = make_model(tpath, tok_dir, seed=5, hidden=32, layers=1, heads=2, kv_heads=1,
                        intermediate=64, vocab_size=VOCAB, **family)
    draft = make_model(dpath, tok_dir, seed=5, hidden=32, layers=1, heads=2, kv_heads=1,
                       intermediate=64, vocab_size=VOCAB, **family)
    torch.manual_seed(11)
    with torch.no_grad():  # peaked distributions, so a wrong correction is visible
        target.lm_head.weight.mul_(6.0)
        draft.lm_head.weight.mul_(6.0)
        for p in draft.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    target.save_pretrained(tpath, safe_serialization=True)
    draft.save_pretrained(dpath, safe_serialization=True)
    return target


def exact_marginals(hf, params: SamplingParams, fourth: bool = False, joint23: bool = False) -> tuple[np.ndarray, ...]:
    """P(2nd token) and P(3rd token) under plain sampling from the target (and P(4th token), or the
    joint P(2nd, 3rd) [V, V])."""
    def probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + p for p in prefixes])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[:, -1].float()
        rows = SamplingRows.build([params] * len(prefixes), "cpu")
        adjust = Adjustments.build(rows, [params] * len(prefixes), [PROMPT + p for p in prefixes],
                                   [list(p) for p in prefixes], VOCAB, "cpu")
        return adjusted_probs(logits, rows, adjust).double()

    p1 = probs([[]])[0]  # [V]
    p2_given = probs([[a] for a in range(VOCAB)])  # [V, V]
    p3_given = probs([[a, b] for a, b in itertools.product(range(VOCAB), repeat=2)]).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2_given  # [V, V]
    m2 = joint12.sum(0)
    m3 = (joint12[:, :, None] * p3_given).sum((0, 1))
    if joint23:
        return m2.numpy(), m3.numpy(), (joint12[:, :, None] * p3_given).sum(0).numpy()
    if not fourth:
        return m2.numpy(), m3.numpy()
    joint123 = (joint12[:, :, None] * p3_given).reshape(-1)  # [V^3], prefixes in product order
    p4_given = probs([list(t) for t in itertools.product(range(VOCAB), repeat=3)])  # [V^3, V]
    m4 = (joint123[:, None] * p4_given).sum(0)
    return m2.numpy(), m3.numpy(), m4.numpy()


def sample_speculative(tpath, dpath, params: SamplingParams, proposer=None, max_batch_size=64,
                       **engine) -> tuple[np.ndarray, float]:
    engine = {"spec_policy": "fixed", "spec_length": 2, **engine}
    llm = LLM(model=str(tpath), draft_model=str(dpath), use_speculative_decoding=True, dtype="float32",
              max_seq_len=32, max_batch_size=max_batch_size, seed=1, **engine)
    if proposer is not None:
        llm.engine.speculation.proposer = proposer(llm.engine)
    kw = {**vars(params), "max_tokens": 4, "ignore_eos": True}
    outs = llm.generate([PROMPT] * N, [SamplingParams(**{**kw, "seed": i}) for i in range(N)])
    tokens = np.array([o.token_ids for o in outs])  # [N, 4]
    drafted = sum(o.num_draft_tokens for o in outs)
    return tokens, sum(o.num_accepted_tokens for o in outs) / drafted


def chi2_pvalue(observed_tokens: np.ndarray, expected_probs: np.ndarray) -> float:
    counts = np.bincount(observed_tokens, minlength=VOCAB).astype(float)
    expected = expected_probs / expected_probs.sum() * len(observed_tokens)
    big = expected >= 5  # pool rare bins so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert counts[expected == 0].sum() == 0, "sampled a token the target gives probability 0"
    return chisquare(obs[keep], exp[keep]).pvalue


def no_residual(tree, p, uniforms):
    """A wrong tree rule: every sibling tried against the node's p, rejected siblings not taken out."""
    node, path, used = -1, [], 0
    while True:
        kids = tree.children[node + 1]
        accepted = None
        for c in kids:
            x = tree.tokens[c]
            q_x = float(tree.children_q(node + 1)[x]) if tree.q is not None else 1.0
            hit = uniforms[used] < min(1.0, float(p[node + 1][x]) / q_x)
            used += 1
            if hit:
                accepted = c
                break
        if accepted is None:
            return path, p[node + 1]
        path.append(accepted)
        node = accepted


CHOICES = ["1", "0", "10", "11", "01", "100"]  # a grammar's choices whose tokens share prefixes


def exact_grammar_outcomes(hf, tok_dir, prompt: list[int], spec: StructuredOutput, depth: int) -> dict[tuple, float]:
    """P(output tokens) when sampling the target at temperature 1 restricted to the grammar and
    renormalised at each step, by enumerating every allowed path (to EOS or `depth` tokens)."""
    tokenizer = Tokenizer(tok_dir)
    matcher = GrammarCompiler(tokenizer, hf.config.vocab_size).matcher(spec)
    out: dict[tuple, float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == depth or (prefix and prefix[-1] in tokenizer.eos_token_ids):
            out[tuple(prefix)] = out.get(tuple(prefix), 0.0) + prob
            return
        allowed = matcher.allowed()
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + prefix])).logits[0, -1].double()
        p = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        for t in allowed.nonzero().flatten().tolist():
            assert matcher.accept(t)
            walk(prefix + [t], prob * float(p[t]))
            matcher.rollback(1)

    walk([], 1.0)
    return out


