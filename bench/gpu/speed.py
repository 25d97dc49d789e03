"""A Llama-3.2-1B-shaped target in bf16 with random weights (transformers' init, the same tensors
served to our engine), and a draft made of its embedding, first layers, norm and head:
- plain decode tok/s at batch 1 / 8 / 32 against transformers `generate` on the same weights, and at
  batch 1 against the bound of reading every weight once a step at the measured copy bandwidth;
- the share of a batch-1 decode step the GPU is busy (profiler kernel time / unprofiled wall time);
- speculative speedup (fixed K, the prefix draft) at batch 1 and 8, and measured / Thm 3.8 bound from
  the measured acceptance and cost ratio c; the identical draft's acceptance (about 1) as a sanity check;
- time to first token of a 2,048-token prompt (chunks of 512, and one chunk);
- memory left after the pools, sized from free memory as a server sizes them, across a batch-32
  sampled verify at K = 8."""

from __future__ import annotations

import torch

from bench.common import theoretical
from bench.gpu.context import Context, check
from bench.gpu.decode import busy_share, median_of, random_prompts, timed_generate, transformers_generate
from bench.random_checkpoints import (
    LLAMA_3_2_1B,
    SMOKE_1B,
    checkpoint_dir,
    hf_model,
    hf_tensors,
    target_and_prefix_draft,
    weights_in_memory,
)
from engine import LLM, SamplingParams

K = 4
DRAFT_LAYERS = 2


def run(ctx: Context, out: dict) -> None:
    config = ctx.size(LLAMA_3_2_1B, SMOKE_1B)
    dtype = ctx.dtype
    work = ctx.work / "llama_1b"
    hf = hf_model(config, getattr(torch, dtype), ctx.device)
    tensors = hf_tensors(hf)
    target, draft, store = target_and_prefix_draft(work, config, tensors, DRAFT_LAYERS)
    same = checkpoint_dir(work / "same", config, tokenizer_from=target)  # the identical draft
    store[str(same)] = tensors
    out.update(config={k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}, dtype=dtype,
               draft_layers=DRAFT_LAYERS, k=K)
    with weights_in_memory(store):
        _plain(ctx, out, hf, target, dtype, config)
        del hf
        ctx.free()
        _speculative(ctx, out, target, draft, same, dtype, config)
        _time_to_first_token(ctx, out, target, dtype, config)
        _memory_at_batch_32(ctx, out, target, draft, dtype, config)
    out["summary"] = _summary(out)


def _plain(ctx: Context, out: dict, hf, target, dtype: str, config: dict) -> None:
    new = ctx.size(128, 8)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm = LLM(**ctx.engine_kwargs(32, 2304, model=str(target), dtype=dtype))
    out["weights_gb"] = llm.engine.model.num_parameters * llm.engine.model.dtype.itemsize / 1e9
    out["paged_attention"] = llm.engine.paged_attention  # {"target": "inplace"}, or why it gathers
    rows = out["plain"] = {}
    for batch in (1, 8, 32):
        prompts = random_prompts(batch, 32, config["vocab_size"], seed=batch)
        if not ctx.smoke:  # warm-up: kernels, allocator
            timed_generate(ctx, llm, prompts, params)
            transformers_generate(ctx, hf, prompts, new)
        ours, theirs = [], []
        for _ in range(ctx.size(3, 1)):
            ours.append(timed_generate(ctx, llm, prompts, params))
            theirs.append(transformers_generate(ctx, hf, prompts, new))
        rows[batch] = r = {"ours": median_of(ours, "tok_s"), "step_ms": median_of(ours, "step_ms"),
                           "transformers": median_of(theirs, "tok_s"),
                           "same_first_tokens": ours[0]["first_tokens"] == theirs[0]["first_tokens"]}
        r["ratio"] = r["ours"]["median"] / r["transformers"]["median"]
        ctx.log(f"plain batch {batch}: ours {r['ours']['median']:.1f} tok/s (step {r['step_ms']['median']:.2f} ms), "
                f"transformers {r['transformers']['median']:.1f} tok/s, ratio {r['ratio']:.2f}")
    bandwidth = ctx.report.get("sections", {}).get("environment", {}).get("copy_tb_s")
    if bandwidth:
        bound_ms = out["weights_gb"] / bandwidth  # GB / (TB/s) = ms
        out["batch1_bound"] = {"weights_gb": out["weights_gb"], "copy_tb_s": bandwidth, "bound_ms": bound_ms,
                               "step_ms": rows[1]["step_ms"]["median"],
                               "share_of_bound": bound_ms / rows[1]["step_ms"]["median"]}
    out["busy_share_batch1"] = busy_share(ctx, llm, config["vocab_size"])
    del llm


def _speculative(ctx: Context, out: dict, target, draft, same, dtype: str, config: dict) -> None:
    new = ctx.size(128, 8)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    plain = LLM(**ctx.engine_kwargs(8, 512, model=str(target), dtype=dtype))
    draft_alone = LLM(**ctx.engine_kwargs(8, 512, model=str(draft), dtype=dtype))
    spec = LLM(**ctx.engine_kwargs(8, 512, model=str(target), dtype=dtype, use_speculative_decoding=True,
                                   speculative_method="draft", draft_model=str(draft), spec_length=K,
                                   spec_policy="fixed"))
    rows = out["speculative"] = {}
    for batch in (1, 8):
        prompts = random_prompts(batch, 32, config["vocab_size"], seed=10 + batch)
        runs = {"plain": [], "draft_alone": [], "spec": []}
        for llm in (plain, draft_alone, spec):
            if not ctx.smoke:  # warm-up
                timed_generate(ctx, llm, prompts, params)
        for _ in range(ctx.size(3, 1)):
            for name, llm in (("plain", plain), ("draft_alone", draft_alone), ("spec", spec)):
                runs[name].append(timed_generate(ctx, llm, prompts, params))
        plain_tok_s = median_of(runs["plain"], "tok_s")["median"]
        spec_tok_s = median_of(runs["spec"], "tok_s")["median"]
        alpha = median_of(runs["spec"], "alpha")["median"]  # per token, as Thm 3.8 takes it
        c = median_of(runs["draft_alone"], "step_ms")["median"] / median_of(runs["plain"], "step_ms")["median"]
        bound = theoretical(alpha, K, c)
        rows[batch] = r = {"plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": spec_tok_s / plain_tok_s,
                           "alpha": alpha, "c": c, "thm_3_8_bound": bound,
                           "measured_over_bound": spec_tok_s / plain_tok_s / bound,
                           "equal_to_plain": runs["spec"][0]["first_tokens"] == runs["plain"][0]["first_tokens"]}
        ctx.log(f"speculative batch {batch}: {r['speedup']:.2f}x plain (alpha {alpha:.3f}, c {c:.3f}, "
                f"Thm 3.8 bound {bound:.2f}x, measured/bound {r['measured_over_bound']:.2f})")
    del plain, draft_alone, spec
    ctx.free()
    # float32: in bf16 the draft's one-token passes and the verify pass round differently, and a random
    # model's top logits are near ties (alpha 0.86 on an H200)
    identical = LLM(**ctx.engine_kwargs(1, 512, model=str(target), dtype="float32", use_speculative_decoding=True,
                                        speculative_method="draft", draft_model=str(same), spec_length=K,
                                        spec_policy="fixed"))
    r = timed_generate(ctx, identical, random_prompts(1, 32, config["vocab_size"], seed=21), params)
    out["identical_draft_alpha"] = r["alpha"]
    ctx.log(f"identical draft: per-token alpha {r['alpha']:.3f}")
    check(out, "the identical draft is accepted almost always in float32 (alpha >= 0.9)", (r["alpha"] or 0) >= 0.9,
          r["alpha"])
    del identical


def _time_to_first_token(ctx: Context, out: dict, target, dtype: str, config: dict) -> None:
    length = ctx.size(2048, 256)
    prompt = random_prompts(1, length, config["vocab_size"], seed=5)[0]
    rows = out["ttft"] = {"prompt_tokens": length}
    for chunk in (512, length):
        llm = LLM(**ctx.engine_kwargs(1, length + 8, model=str(target), dtype=dtype, max_num_batched_tokens=chunk))
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        if not ctx.smoke:
            timed_generate(ctx, llm, [prompt], params)
        rows[f"chunks of {chunk}"] = median_of([timed_generate(ctx, llm, [prompt], params)
                                                 for _ in range(ctx.size(3, 1))], "seconds")
        ctx.log(f"time to first token, {length} tokens in chunks of {chunk}: "
                f"{1e3 * rows[f'chunks of {chunk}']['median']:.1f} ms")
        del llm
        ctx.free()


def _memory_at_batch_32(ctx: Context, out: dict, target, draft, dtype: str, config: dict) -> None:
    """Pools sized from free memory (as serving sizes them), then a sampled batch-32 run at K = 8."""
    ctx.free()
    max_seq_len = ctx.size(2048, 128)
    llm = LLM(model=str(target), dtype=dtype, device=ctx.device, forward_plan="torch", max_batch_size=32,
              max_seq_len=max_seq_len, use_speculative_decoding=True, speculative_method="draft",
              draft_model=str(draft), spec_length=8, spec_policy="fixed")
    if ctx.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=ctx.size(24, 6), ignore_eos=True, seed=1)
    r = timed_generate(ctx, llm, random_prompts(32, 64, config["vocab_size"], seed=7), params)
    mem = out["memory_batch32_k8_sampled"] = {"num_kv_blocks": llm.config.num_kv_blocks, "tokens": r["tokens"],
                                              "acceptance": r["acceptance"]}
    if ctx.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        mem.update(total_gib=total / 2**30, free_after_gib=free / 2**30,
                   peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                   reserved_gib=torch.cuda.memory_reserved() / 2**30)
        ctx.log(f"batch 32 sampled K=8 verify: peak {mem['peak_allocated_gib']:.1f} GiB of {total / 2**30:.1f}, "
                f"{mem['free_after_gib']:.1f} GiB free after")
    check(out, "a batch-32 sampled K=8 run fits beside pools sized from free memory", r["tokens"] == 32 * params.max_tokens,
          mem)
    del llm


def _summary(out: dict) -> list[str]:
    lines = []
    for batch, r in out.get("plain", {}).items():
        lines.append(f"plain decode batch {batch}: ours {r['ours']['median']:.1f} tok/s, transformers generate "
                     f"{r['transformers']['median']:.1f} tok/s ({r['ratio']:.2f}x), step {r['step_ms']['median']:.2f} ms")
    if "batch1_bound" in out:
        b = out["batch1_bound"]
        lines.append(f"batch-1 step {b['step_ms']:.2f} ms vs weights / bandwidth bound {b['bound_ms']:.2f} ms "
                     f"({b['weights_gb']:.2f} GB at {b['copy_tb_s']:.2f} TB/s): {100 * b['share_of_bound']:.0f}% of bound")
    if "paged_attention" in out:
        lines.append(f"decode attention: {str(out['paged_attention'])[:200]}")
    if out.get("busy_share_batch1"):
        s = out["busy_share_batch1"]
        lines.append(f"batch-1 decode step: GPU busy {100 * s['busy_share']:.0f}% ({s['kernel_ms_per_step']:.2f} ms of "
                     f"kernels in {s['wall_ms_per_step']:.2f} ms, {s['kernels_per_step']:.0f} kernels)")
    for batch, r in out.get("speculative", {}).items():
        lines.append(f"speculative K={out['k']} batch {batch} ({out['draft_layers']}-layer prefix draft): "
                     f"{r['speedup']:.2f}x plain, alpha {r['alpha']:.3f}, c {r['c']:.3f}, "
                     f"Thm 3.8 bound {r['thm_3_8_bound']:.2f}x, measured / bound {r['measured_over_bound']:.2f}")
    if "identical_draft_alpha" in out:
        lines.append(f"identical draft acceptance (float32) {out['identical_draft_alpha']:.3f}")
    for name, r in out.get("ttft", {}).items():
        if isinstance(r, dict):
            lines.append(f"time to first token, {out['ttft']['prompt_tokens']}-token prompt, {name}: "
                         f"{1e3 * r['median']:.1f} ms")
    if "memory_batch32_k8_sampled" in out and "peak_allocated_gib" in out["memory_batch32_k8_sampled"]:
        m = out["memory_batch32_k8_sampled"]
        lines.append(f"pools from free memory + batch-32 sampled K=8: peak {m['peak_allocated_gib']:.1f} GiB of "
                     f"{m['total_gib']:.1f}, {m['free_after_gib']:.1f} GiB free after")
    return lines
