"""Token trees on the device (section `trees`): at a realistic acceptance (the Llama-3.2-1B shape's
1-layer prefix pair, bench/gpu/pair.py), adaptive speculation with trees ÷ with chains only at
batch 1, and block ÷ token verification (sampled, fixed K); what a verify pass costs by its width,
as a chain and as a tree (the ancestor mask), at batch 1 and 8, replayed from captured graphs (as
the engine runs them) and eager; and greedy n-gram trees equal plain decoding (float32, both pools)."""

from __future__ import annotations

import statistics
import time

import torch

from bench.gpu.context import Context, check, goal
from bench.gpu.decode import median_of, random_prompts, timed_generate
from bench.gpu.realistic import K_MAX, build_pair
from bench.random_checkpoints import LLAMA_3_2_1B, SMOKE_1B, checkpoint_dir, hf_model, hf_tensors, weights_in_memory
from engine import LLM, SamplingParams
from engine.model.cuda_graphs import CapturedPasses, PassKind, default_capture, target_pass
from engine.model.passes import fill_slots, forward_chunks, padded_length, pool_for
from engine.token_tree import TokenTree

WIDTHS = (1, 5, 9, 17)  # tokens per sequence in a verify pass (root + nodes)


def _tree(nodes: int) -> TokenTree:
    """A bushy tree of `nodes` nodes: three children a node, breadth first."""
    return TokenTree(tuple(range(1, nodes + 1)), tuple((i - 1) // 3 - 1 if i else -1 for i in range(nodes)))


TREE = dict(tree_width=3, tree_tokens=16)  # the trees' shape limits (the policy picks within them)


def run(ctx: Context, out: dict) -> None:
    _realistic(ctx, out)
    ctx.free()
    _verify_widths(ctx, out)


def _realistic(ctx: Context, out: dict) -> None:
    """Trees ÷ chains (adaptive, greedy, batch 1) and block ÷ token (fixed K = 4, T = 1), on the pair."""
    config = ctx.size(LLAMA_3_2_1B, SMOKE_1B)
    new = ctx.size(96, 12)
    target, draft, store, out["pair"] = build_pair(ctx, config, 1, new, "trees_pair")
    spec = dict(use_speculative_decoding=True, speculative_method="draft", draft_model=str(draft))
    with weights_in_memory(store):
        engines = {name: LLM(**ctx.engine_kwargs(1, 512, model=str(target), dtype=ctx.dtype, **spec, **kw))
                   for name, kw in (("chains", dict(spec_length=K_MAX)), ("trees", dict(spec_length=K_MAX, **TREE)),
                                    ("token", dict(spec_length=4, spec_policy="fixed")),
                                    ("block", dict(spec_length=4, spec_policy="fixed", verification="block")))}
    store.clear()
    ctx.free()
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, seed=3)
    prompts = random_prompts(1, 32, config["vocab_size"], seed=31)
    for (a, b), params in ((("trees", "chains"), greedy), (("block", "token"), sampled)):
        runs = {name: [] for name in (a, b)}
        for _ in range(ctx.size(3, 1) + (0 if ctx.smoke else 1)):  # the first repeat warms up on the GPU
            for name in (a, b):
                runs[name].append(timed_generate(ctx, engines[name], prompts, params))
        runs = {name: r[0 if ctx.smoke else 1:] for name, r in runs.items()}
        ratio = median_of(runs[a], "tok_s")["median"] / median_of(runs[b], "tok_s")["median"]
        out[f"{a}_over_{b}"] = {"tok_s": ratio, "alpha": {n: median_of(runs[n], "alpha")["median"] for n in runs},
                                "mean_k": {n: median_of(runs[n], "mean_k")["median"] for n in runs}}
        ctx.log(f"{a} / {b}: {ratio:.2f}x ({out[f'{a}_over_{b}']})")
    goal(out, "trees ÷ chains >= 1.05 at batch 1 (adaptive, greedy, realistic pair)",
         out["trees_over_chains"]["tok_s"] >= 1.05, out["trees_over_chains"]["tok_s"])
    del engines


def _verify_widths(ctx: Context, out: dict) -> None:
    config = ctx.size(LLAMA_3_2_1B, SMOKE_1B)
    work = ctx.work / "trees"
    hf = hf_model(config, getattr(torch, ctx.dtype), ctx.device)
    target = checkpoint_dir(work / "target", config)
    store = {str(target): hf_tensors(hf)}
    del hf
    context, batches = ctx.size(512, 48), ctx.size((1, 8), (1, 2))
    with weights_in_memory(store):
        llm = LLM(**ctx.engine_kwargs(max(batches), context + 32, model=str(target), dtype=ctx.dtype))
    model = llm.engine.runner.model
    repeats = ctx.size(20, 2)
    out.update(context=context, widths=list(WIDTHS), dtype=ctx.dtype)
    pool = pool_for(model, max(batches), context + 64)
    filled = fill_slots(model, pool, max(batches), context)
    # the engine's captured passes over this pool: chains of each width, and trees under their mask
    widths = sorted({padded_length(w) for w in WIDTHS})
    graphs = CapturedPasses(target_pass(model, ()), pool.storage,
                            [PassKind(w) for w in widths] + [PassKind(w, tree=True) for w in widths if w > 1],
                            max_batch=max(batches), max_seq_len=context + 64, extra_dtype=model.dtype)
    t0 = time.perf_counter()
    graphs.capture(default_capture(model.device))
    out["capture_seconds"] = time.perf_counter() - t0
    engine_graphs = model.graphs
    try:
        for mode, captured in (("graphs", graphs), ("eager", None)):
            model.graphs = captured
            rows = out.setdefault(f"verify_ms_{mode}", {})
            for batch in batches:
                slots = filled[:batch]
                for width in WIDTHS:
                    for shape in ("chain", "tree"):
                        trees = None if shape == "chain" or width == 1 else [_tree(width - 1)] * batch
                        times = []
                        for _ in range(repeats + 1):
                            ctx.sync()
                            t0 = time.perf_counter()
                            forward_chunks(model, pool, slots, [[1] * width] * batch, [context] * batch,
                                           all_logits=True, trees=trees)
                            ctx.sync()
                            times.append(time.perf_counter() - t0)
                            for s in slots:
                                pool.truncate_to(s, context, keep_storage=True)
                        rows.setdefault(str(batch), {}).setdefault(shape, {})[str(width)] = \
                            1e3 * statistics.median(times[1:])
                ctx.log(f"{mode}, batch {batch}: verify ms by width {rows[str(batch)]}")
        replays = graphs.replays
    finally:
        model.graphs = engine_graphs
    check(out, "every timed pass replayed a graph where graphs were on",
          replays == len(batches) * len(WIDTHS) * 2 * (repeats + 1), {"replays": replays})
    out["summary"] = [f"{name.replace('_', ' ')}: {out[name]['tok_s']:.2f}x (alpha {out[name]['alpha']}, mean K "
                      f"{out[name]['mean_k']})" for name in ("trees_over_chains", "block_over_token")]
    out["summary"] += _summary(out["verify_ms_graphs"], "graphs") + _summary(out["verify_ms_eager"], "eager")
    del llm, model, graphs
    ctx.free()
    _parity(ctx, out, work)


def _summary(rows: dict, mode: str) -> list[str]:
    """One line a batch: each width's pass time as a chain and as a tree, and the widest tree's
    pass over a one-token pass (how near free the extra nodes are)."""
    lines = []
    for batch, shapes in rows.items():
        chain, tree = shapes["chain"], shapes.get("tree", {})
        cells = ", ".join(f"{w}: {chain[w]:.2f} / {tree[w]:.2f} ms" for w in chain if w in tree)
        widest = str(max(WIDTHS))
        if widest in tree:
            cells += f"; tree of {widest} / 1 token = {tree[widest] / chain['1']:.2f}x"
        lines.append(f"{mode}, batch {batch} verify pass, chain / tree by tokens a sequence: {cells}")
    return lines


def _parity(ctx: Context, out: dict, work) -> None:
    """Greedy n-gram trees = plain decoding, float32 on the device, paged and slotted pools."""
    config = SMOKE_1B
    hf = hf_model(config, torch.float32, ctx.device, seed=3)
    target = checkpoint_dir(work / "parity", config)
    store = {str(target): hf_tensors(hf)}
    del hf
    prompts = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 6], [20, 21, 22, 20, 21, 23, 20, 21, 22, 24, 20, 21]]
    params = SamplingParams(temperature=0, max_tokens=ctx.size(48, 12), ignore_eos=True)
    with weights_in_memory(store):
        plain = LLM(**ctx.engine_kwargs(4, 128, model=str(target), dtype="float32"))
        expected = [o.token_ids for o in plain.generate(prompts, params)]
        for backend in ctx.size(("paged", "slotted"), ("paged",)):
            spec = LLM(**ctx.engine_kwargs(4, 128, model=str(target), dtype="float32", kv_cache_backend=backend,
                                           use_speculative_decoding=True, speculative_method="ngram",
                                           spec_policy="fixed", spec_length=4, tree_width=3, tree_tokens=10))
            outs = spec.generate(prompts, params)
            check(out, f"greedy n-gram trees = plain ({backend})", [o.token_ids for o in outs] == expected,
                  {"rounds": sum(o.num_spec_rounds for o in outs)})
