"""Exactness on the device, with tiny random models: parity with transformers (float32 tokens equal,
bf16 top-1 agreement), greedy speculative output equal to plain for every proposer on both KV
backends at batch 1 and 8, seeded sampling reproducible alone and in a batch, and the chi-square test
of speculative sampling against the target's exact marginals, with its teeth (a broken correction
must be rejected by the same test). First, the engine's Triton kernels (fused, FP8, INT4, MoE) against
eager torch or the dequantized weight (bench/gpu/kernels.py; on CPU under Triton's interpreter only)."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import torch

import engine.speculative.verify.chain as rejection
from bench.gpu import kernels
from bench.gpu.context import Context, check
from bench.gpu.stats import chi_square_pvalue
from engine import LLM, SamplingParams
from engine.config import ModelPlan
from engine.model.linears import onednn_reorders
from engine.model.loader import load_model
from engine.model.passes import forward_chunks, pool_for
from engine.sampling import Adjustments, SamplingRows, adjusted_probs
from tests.helpers import make_eagle3_head, make_model, make_tokenizer

METHODS = ("ngram", "draft", "eagle", "hybrid")
AUX = [0, 1, 1]  # the tiny target's two layers: layer 0's input is the embedding
VOCAB = 16  # the chi-square pair's vocabulary: exact marginals by enumeration
PROMPT = [3, 7, 2, 9, 4]


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        body = torch.randint(4, vocab, (6 + 3 * (i % 4),), generator=g).tolist()
        out.append(body * 2 if i % 2 else body)  # repeats give prompt lookup something to find
    return out


def run(ctx: Context, out: dict) -> None:
    kernels.run(ctx, out)  # first: what no GPU has run yet
    work = ctx.work / "tiny"
    tok = work / "tok"
    make_tokenizer(tok)
    target_hf = make_model(work / "target", tok, seed=0)
    make_model(work / "draft", tok, seed=6, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    make_eagle3_head(work / "eagle", work / "target", seed=3, aux=AUX,
                     two_back=target_hf.model.embed_tokens.weight.detach())
    _transformers_parity(ctx, out, work / "target", target_hf)
    _speculative_equals_plain(ctx, out, work)
    _seeds_reproduce(ctx, out, work)
    _chi_square(ctx, out, work, tok)
    _row_invariance_bf16(ctx, out, work / "target")  # last: its Triton kernels compile first on a GPU
    out["summary"] = [f"{name}: {'ok' if c['ok'] else 'FAILED'}" for name, c in out["checks"].items()] + (
        [f"kernel checks skipped: {out['kernels_skipped']}"] if out.get("kernels_skipped") else [])


def _transformers_parity(ctx: Context, out: dict, path: Path, hf) -> None:
    """float32: our greedy tokens equal transformers' generate; bf16: top-1 agreement of the
    logits at every position of one sequence."""
    prompts = _prompts(4, 320, seed=1)
    hf32 = hf.to(ctx.device)
    llm = LLM(**ctx.engine_kwargs(4, 160, model=str(path), dtype="float32"))
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))]
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=ctx.device)
            gen = hf32.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
            theirs.append(gen[0, len(p):].tolist())
    check(out, "float32 greedy tokens equal transformers generate", ours == theirs,
          {"sequences_equal": sum(a == b for a, b in zip(ours, theirs)), "of": len(prompts)})
    del llm
    ctx.free()
    if not ctx.device.startswith("cuda"):
        return  # bf16 matmuls on CPU are another backend's question
    model = load_model(path, ModelPlan("bfloat16"), ctx.device, 256)
    hf16 = hf32.to(torch.bfloat16)
    seq = sum(_prompts(8, 320, seed=2), [])[:200]
    pool = pool_for(model, 1, 256)
    slot = pool.allocate_slot([])[0]
    with torch.inference_mode():
        mine = forward_chunks(model, pool, [slot], [seq], [0], all_logits=True)[0]  # [T, V]
        ref = hf16(input_ids=torch.tensor([seq], device=ctx.device)).logits[0].float()
    agreement = float((mine.argmax(-1) == ref.argmax(-1)).float().mean())
    out["bf16_top1_agreement"] = agreement
    check(out, "bf16 top-1 agreement with transformers >= 0.95", agreement >= 0.95, round(agreement, 4))
    hf.to("cpu", torch.float32)


def _speculative_equals_plain(ctx: Context, out: dict, work: Path) -> None:
    prompts = _prompts(8, 320, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=ctx.size(40, 16), ignore_eos=True)
    results = out["greedy_parity"] = {}
    for backend in ("slotted", "paged"):
        base = ctx.engine_kwargs(8, 160, model=str(work / "target"), dtype="float32", kv_cache_backend=backend)
        plain = LLM(**base)
        expected = {b: [o.token_ids for o in plain.generate(prompts[:b], greedy)] for b in (1, 8)}
        del plain
        for method in METHODS:
            draft = {"ngram": None, "eagle": work / "eagle"}.get(method, work / "draft")
            llm = LLM(**base, use_speculative_decoding=True, speculative_method=method, spec_length=4,
                      spec_policy="fixed", **({} if draft is None else {"draft_model": str(draft)}))
            for b in (1, 8):
                outs = llm.generate(prompts[:b], greedy)
                same = [o.token_ids for o in outs] == expected[b]
                drafted = sum(o.num_draft_tokens for o in outs)
                alpha = sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None
                results[f"{method} {backend} batch {b}"] = {"equal": same, "draft_tokens": drafted, "acceptance": alpha}
                check(out, f"greedy {method} = plain, {backend}, batch {b}", same and drafted > 0,
                      {"draft_tokens": drafted, "acceptance": alpha})
            del llm
            ctx.free()
        ctx.log(f"greedy parity {backend}: " + ", ".join(f"{k.split()[0]} b{k.split()[-1]} {'ok' if v['equal'] else 'DIFF'}"
                                                        for k, v in results.items() if backend in k))


def _row_invariance_bf16(ctx: Context, out: dict, path: Path) -> None:
    """The row-invariance harness (engine/model/invariance.py) in bf16: a multi-token pass against
    its one-token steps, bitwise, on the plan's paths (the comparison) and on the device's rule
    (checked: CPU's oneDNN rule; CUDA's Triton kernels, the fused kernels on as the engine's
    load-time check leaves them); on CUDA also the rule's cost, its decode and verify passes timed
    against the plan's (the GPU verdict for batch_invariant auto, which keeps it at most 1.05x)."""
    from engine.model.cuda_graphs import tolerance
    from engine.model.fused_check import check_fused
    from engine.model.invariance import SPECULATIVE_SHAPES, check_passes, choose_invariance, decode_cost_ratio
    if ctx.device == "cpu" and not onednn_reorders(torch.bfloat16):
        out["row_invariance_bf16"] = "skipped: no bf16 matmul kernels on this CPU"
        return
    model = load_model(path, ModelPlan("bfloat16"), ctx.device, 512)
    pool = pool_for(model, 16, 512)  # two slot sets of batch 8
    fused = check_fused(model, pool, tolerance(model.dtype)) if ctx.device != "cpu" else None
    shapes = [(b, n, t) for b in (1, 8) for n in (40, 300) for t in (2, 5, 17)]
    plan = {f"batch {b}, context {n}, {t} tokens": check_passes(model, pool, n, t, b) or "equal" for b, n, t in shapes}
    rule = choose_invariance(model, "on")
    verdicts = {f"batch {b}, context {n}, {t} tokens": check_passes(model, pool, n, t, b) or "equal" for b, n, t in shapes}
    result = out["row_invariance_bf16"] = {"rule": rule, "fused": fused or "on", "verdicts": verdicts,
                                           "plan's paths": plan}
    check(out, "bf16 passes equal their one-token steps bitwise (invariant rule)",
          rule == "on" and all(v == "equal" for v in verdicts.values()), verdicts)
    if ctx.device != "cpu" and rule == "on":
        result["cost"] = {"shapes (sequences, tokens)": SPECULATIVE_SHAPES,
                          "rule / plan, geometric mean": decode_cost_ratio(model, shapes=SPECULATIVE_SHAPES)}
        ctx.log(f"row invariance bf16 cost: {result['cost']['rule / plan, geometric mean']:.3f}x the plan's passes")
    ctx.log("row invariance bf16: " + ", ".join(f"{k}: {v}" for k, v in verdicts.items()))


def _seeds_reproduce(ctx: Context, out: dict, work: Path) -> None:
    """A seeded sampled request gives the same tokens twice, and alone as in a batch."""
    prompts = _prompts(6, 320, seed=4)
    for name, spec in (("plain", {}), ("speculative", dict(use_speculative_decoding=True, speculative_method="draft",
                                                            draft_model=str(work / "draft"), spec_length=3,
                                                            spec_policy="fixed"))):
        llm = LLM(**ctx.engine_kwargs(8, 160, model=str(work / "target"), dtype="float32", **spec))
        seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=1234)
        alone = [llm.generate([prompts[0]], seeded)[0].token_ids for _ in range(2)]
        others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=i) for i in range(5)]
        batched = llm.generate(prompts, [seeded] + others)[0].token_ids
        check(out, f"{name}: a seeded request reproduces, alone and in a batch",
              alone[0] == alone[1] == batched, {"alone_twice_equal": alone[0] == alone[1],
                                                "batch_equal": alone[0] == batched})
        del llm
        ctx.free()


def _tiny_pair(work: Path, tok: Path):
    """A 16-token target and a perturbed copy as its draft, peaked so a wrong correction shows."""
    shape = dict(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab_size=VOCAB, head_dim=16)
    target = make_model(work / "stat_t", tok, seed=5, **shape)
    draft = make_model(work / "stat_d", tok, seed=5, **shape)
    torch.manual_seed(11)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
        draft.lm_head.weight.mul_(6.0)
        for p in draft.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    target.save_pretrained(work / "stat_t", safe_serialization=True)
    draft.save_pretrained(work / "stat_d", safe_serialization=True)
    return target


def exact_marginals(hf, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """P(2nd output token) and P(3rd) under plain sampling from the target (CPU, float64 sums)."""
    def probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + p for p in prefixes])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[:, -1].float()
        rows = SamplingRows.build([params] * len(prefixes), "cpu")
        adjust = Adjustments.build(rows, [params] * len(prefixes), [PROMPT + p for p in prefixes],
                                   [list(p) for p in prefixes], VOCAB, "cpu")
        return adjusted_probs(logits, rows, adjust).double()

    p1 = probs([[]])[0]
    joint12 = p1[:, None] * probs([[a] for a in range(VOCAB)])  # [V, V]
    p3 = probs([[a, b] for a, b in itertools.product(range(VOCAB), repeat=2)]).view(VOCAB, VOCAB, VOCAB)
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


@contextlib.contextmanager
def _correction_replaced_by_p():
    """The classic bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    good = rejection.verify

    def broken(p, q, draft, num_proposed, uniforms):
        result = good(p, q, draft, num_proposed, uniforms)
        return result._replace(final_probs=p[torch.arange(p.shape[0], device=p.device), result.num_accepted])

    rejection.verify = broken
    try:
        yield
    finally:
        rejection.verify = good


def _chi_square(ctx: Context, out: dict, work: Path, tok: Path) -> None:
    hf = _tiny_pair(work, tok)
    n = ctx.size(3000, 400)
    llm = LLM(**ctx.engine_kwargs(64, 32, model=str(work / "stat_t"), dtype="float32", seed=1,
                                  use_speculative_decoding=True, speculative_method="draft",
                                  draft_model=str(work / "stat_d"), spec_length=2, spec_policy="fixed"))
    stats = out["chi_square"] = {"n": n}

    def pvalues(config: dict) -> dict:
        params = SamplingParams(**config)
        m2, m3 = exact_marginals(hf, params)
        outs = llm.generate([PROMPT] * n, [SamplingParams(**config, max_tokens=4, ignore_eos=True, seed=i)
                                            for i in range(n)])
        tokens = torch.tensor([o.token_ids for o in outs])  # [n, 4]
        drafted = sum(o.num_draft_tokens for o in outs)
        return {"p_2nd": chi_square_pvalue(torch.bincount(tokens[:, 1], minlength=VOCAB), m2),
                "p_3rd": chi_square_pvalue(torch.bincount(tokens[:, 2], minlength=VOCAB), m3),
                "acceptance": sum(o.num_accepted_tokens for o in outs) / max(drafted, 1)}

    for name, config in (("t1", dict(temperature=1.0)), ("t07_topk6", dict(temperature=0.7, top_k=6))):
        stats[name] = r = pvalues(config)
        ctx.log(f"chi-square {name}: p {r['p_2nd']:.3g} / {r['p_3rd']:.3g}, acceptance {r['acceptance']:.2f}")
        check(out, f"speculative sampling follows the target ({name}): p > 1e-3", min(r["p_2nd"], r["p_3rd"]) > 1e-3
              and 0.2 < r["acceptance"] < 0.95, r)
    with _correction_replaced_by_p():
        stats["teeth"] = r = pvalues(dict(temperature=1.0))
    ctx.log(f"chi-square teeth (correction replaced by p): p {r['p_2nd']:.3g} / {r['p_3rd']:.3g}")
    if not ctx.smoke:  # 800 draws are too few to have the power; the real run's 3000 do
        check(out, "the teeth variant (correction replaced by p) is rejected: p < 1e-3",
              min(r["p_2nd"], r["p_3rd"]) < 1e-3, r)
