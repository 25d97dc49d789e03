"""Peers on the very same weights: transformers `generate` (plain, assisted, prompt lookup) vs our engine.

    python -m bench peers [--workload code edit] [--prompts 8] [--tokens 96] [--repeats 3] [--eagle embedded:eagle3]

Batch 1, greedy, the shipped bf16 pair. Our engine runs its forward plan (measured on this host);
transformers computes in the dtype our target's plan chose (on a CPU without bf16 matmul kernels,
float32: emulated bf16 would make it several times slower and the comparison meaningless).
Every variant decodes the same token-id prompts with
EOS ignored (transformers: eos_token_id=None), so each produces exactly `tokens` new tokens; the
variants are interleaved and repeated, medians reported. `same_as_plain` compares each variant's
tokens with the same library's plain greedy run (ours: exact; transformers' assisted paths may
differ from its own plain run by bf16 rounding of batched vs single-token passes). Our eagle rows
run on a second engine with the same target and the EAGLE-3 head of --eagle (transformers has no
EAGLE-3 path, so those rows have no transformers counterpart).
"""

from __future__ import annotations

import time

import torch

from bench import tables
from bench.common import PLAIN, adaptive, batch1_llm, interleave, ours_variant, parser, summarize, write
from bench.workloads import load_prompts

TRANSFORMERS_VARIANTS = {
    "transformers plain": {},
    "transformers assisted (draft model)": {"assistant": True},
    "transformers prompt lookup (10)": {"prompt_lookup_num_tokens": 10},
}
OURS_VARIANTS = {
    "ours plain": PLAIN,
    "ours draft (adaptive)": adaptive("draft"),
    "ours ngram (adaptive)": adaptive("ngram"),
    "ours hybrid (adaptive)": adaptive("hybrid"),
}
OURS_EAGLE_VARIANTS = {  # on the engine whose model proposer is the EAGLE-3 head
    "ours eagle (adaptive)": adaptive("eagle"),
    "ours hybrid-eagle (adaptive)": adaptive("hybrid"),
}


def _parser():
    ap = parser("peers", __doc__, tokens=96, workloads=True)
    ap.add_argument("--eagle", default="embedded:eagle3", help="the EAGLE-3 head for the eagle rows ('' for none)")
    return ap


def load_transformers(target_dir, draft_dir, dtype) -> tuple:
    """transformers' target and draft from the same checkpoints, computing in `dtype`."""
    from transformers import AutoModelForCausalLM

    hf_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    for m in (hf_target, hf_draft):
        m.generation_config.eos_token_id = None  # decode exactly `tokens` tokens, like ignore_eos
    return hf_target, hf_draft


def hf_variant(hf_target, hf_draft, kw: dict, prompts: list, tokens: int):
    """One transformers run: greedy `generate` on each prompt alone (kw: a TRANSFORMERS_VARIANTS
    entry); tok/s and the new tokens."""
    def go():
        extra = {"assistant_model": hf_draft} if kw.get("assistant") else \
            {k: v for k, v in kw.items() if k != "assistant"}
        out_tokens = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])  # [1, prompt_len]
                out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                         do_sample=False, pad_token_id=0, **extra)
                out_tokens.append(out[0, len(p):].tolist())
        dt = time.perf_counter() - t0
        return {"tok_s": sum(map(len, out_tokens)) / dt, "tokens": out_tokens, "acceptance": None}
    return go


def workload_results(workload: str, runs: dict[str, list[dict]]) -> dict:
    """One workload's table (speed against transformers plain and assisted, tokens the same as the
    library's own plain run), printed, and how far our plain run matches transformers'."""
    base = {"ours": runs["ours plain"][0]["tokens"], "transformers": runs["transformers plain"][0]["tokens"]}
    hf_plain = summarize(runs["transformers plain"], "tok_s")["median"]
    hf_assisted = summarize(runs["transformers assisted (draft model)"], "tok_s")["median"]
    table = {}
    for name, rs in runs.items():
        s = summarize(rs, "tok_s")
        family = "ours" if name.startswith("ours") else "transformers"
        same = sum(a == b for r in rs for x, y in zip(r["tokens"], base[family]) for a, b in zip(x, y))
        total = sum(len(y) for r in rs for y in base[family])
        table[name] = {"tok_s": s, "vs_transformers_plain": s["median"] / hf_plain,
                       "vs_transformers_assisted": s["median"] / hf_assisted,
                       "acceptance": rs[0]["acceptance"], "same_as_plain": same / total}
        print(f"{workload:5s} {name:38s} {s['median']:8.1f} tok/s  {s['median'] / hf_plain:5.2f}x HF plain  "
              f"{s['median'] / hf_assisted:5.2f}x HF assisted  same-as-plain {same / total:.1%}")
    ours_vs_hf = sum(a == b for x, y in zip(base["ours"], base["transformers"]) for a, b in zip(x, y))
    return {"results": table, "ours_plain_matches_transformers_plain": ours_vs_hf / sum(map(len, base["ours"]))}


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import SamplingParams
    from engine.model.loader import resolve_model_path

    target_dir, draft_dir = resolve_model_path(args.target), resolve_model_path(args.draft)
    llm = batch1_llm(str(target_dir), str(draft_dir), args.forward_plan)
    llm_eagle = batch1_llm(str(target_dir), str(resolve_model_path(args.eagle)), args.forward_plan,
                           speculative_method="eagle") if args.eagle else None
    dtype = llm.engine.model.dtype  # what our target computes the bf16 pair in here
    hf_target, hf_draft = load_transformers(target_dir, draft_dir, dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    for workload in args.workload:
        prompts = [llm.engine.tokenizer.encode(p) for p in load_prompts(workload, args.prompts)]
        variants = {name: ours_variant(llm, cfg, prompts, params) for name, cfg in OURS_VARIANTS.items()}
        if llm_eagle is not None:
            variants.update({name: ours_variant(llm_eagle, cfg, prompts, params)
                             for name, cfg in OURS_EAGLE_VARIANTS.items()})
        variants.update({name: hf_variant(hf_target, hf_draft, kw, prompts, args.tokens)
                         for name, kw in TRANSFORMERS_VARIANTS.items()})
        for fn in variants.values():  # warm-up: kernels, prefix-free caches
            fn()
        runs = interleave(variants, args.repeats, f"peers ({workload})")
        results[workload] = workload_results(workload, runs)
    path = write("peers", {"prompts": args.prompts, "tokens": args.tokens, "repeats": args.repeats,
                           "dtype": str(dtype).removeprefix("torch."), "batch": 1, "temperature": 0.0,
                           "workloads": results}, llm)
    print(f"wrote {path}")


def draw(r: dict) -> list[str]:
    m = r["machine"]
    lines = [f"**Peers on the same weights** — the shipped pair in bf16, batch 1, greedy, {r['tokens']} new tokens, "
             f"{r['prompts']} held-out prompts per workload, medians of {r['repeats']} interleaved runs, "
             f"{m['threads']} threads, {tables.host(m)}; ours: {tables.plan(r)} (`python -m bench peers`):", "",
             "| workload | variant | tok/s | vs transformers plain | vs transformers assisted | same tokens as own plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for w, block in r["workloads"].items():
        for name, e in block["results"].items():
            lines.append(f"| {w} | {name} | {e['tok_s']['median']:.0f} | {e['vs_transformers_plain']:.2f}x | "
                         f"{e['vs_transformers_assisted']:.2f}x | {e['same_as_plain']:.0%} |")
    lines += ["", "Our plain greedy tokens vs transformers' plain greedy tokens (bf16, different kernels): " + ", ".join(
        f"{w} {b['ours_plain_matches_transformers_plain']:.0%} positions equal" for w, b in r["workloads"].items()), ""]
    return lines + tables.img("peers")



def page_targets(row: tables.Row) -> None:
    """The target against transformers' assisted generation."""
    if (r := tables.load("peers")) is not None:
        parts, met = [], True
        for w, block in r["workloads"].items():
            res = block["results"]
            same_draft = res["ours draft (adaptive)"]["vs_transformers_assisted"]  # the same draft model
            ours = {n: e for n, e in res.items() if n.startswith("ours") and "plain" not in n}
            name = max(ours, key=lambda n: ours[n]["vs_transformers_assisted"])
            parts.append(f"{w}: draft {same_draft:.2f}x, best {ours[name]['vs_transformers_assisted']:.2f}x ({name})")
            met &= same_draft >= 2.0
        row("our speculative decoding (same draft) >= 2x transformers assisted generation", "; ".join(parts), met)


if __name__ == "__main__":
    main()
