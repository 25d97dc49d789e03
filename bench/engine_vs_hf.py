"""Plain greedy decode: our engine vs transformers `generate` on the same random-init weights.

    python -m bench.engine_vs_hf [--batch 1 16] [--tokens 128] [--repeats 5]

A ~28M-parameter Llama (the shipped target's shape) in bf16, random init, prompts of 32
random tokens; decode tokens/s = generated tokens / wall time (prefill included for both).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench import tables
from bench.common import interleave, summarize, write


def make_checkpoint(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8192)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", bos_token="t0").save_pretrained(path)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1408, tie_word_embeddings=True,
                      max_position_embeddings=2048, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    from engine import LLM, SamplingParams

    tmp = Path(tempfile.mkdtemp())
    make_checkpoint(tmp)
    hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).eval()
    llm = LLM(model=str(tmp), dtype="bfloat16", max_batch_size=max(args.batch), max_seq_len=512,
              use_speculative_decoding=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(2, 8192, (batch, 32), generator=gen)

        def ours(prompts=prompts):
            t0 = time.perf_counter()
            outs = llm.generate([p.tolist() for p in prompts], params)
            dt = time.perf_counter() - t0
            n = sum(len(o.token_ids) for o in outs)
            return {"tok_s": n / dt, "tokens": n, "seconds": dt, "first": outs[0].token_ids[:16]}

        def transformers_generate(prompts=prompts, batch=batch):
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
            dt = time.perf_counter() - t0
            n = (out.shape[1] - prompts.shape[1]) * batch
            return {"tok_s": n / dt, "tokens": n, "seconds": dt, "first": out[0, 32:48].tolist()}

        ours()  # warm-up both
        transformers_generate()
        runs = interleave({"ours": ours, "transformers": transformers_generate}, args.repeats, f"batch {batch}")
        s_ours, s_hf = summarize(runs["ours"], "tok_s"), summarize(runs["transformers"], "tok_s")
        results[str(batch)] = {"ours": s_ours, "transformers": s_hf, "ratio": s_ours["median"] / s_hf["median"],
                               "same_first_tokens": runs["ours"][0]["first"] == runs["transformers"][0]["first"]}
        print(f"batch {batch:3d}: ours {s_ours['median']:8.1f} tok/s   transformers {s_hf['median']:8.1f} tok/s"
              f"   ratio {results[str(batch)]['ratio']:.2f}x")
    path = write("engine_vs_hf", {"tokens": args.tokens, "params_m": 27.8, "dtype": "bfloat16",
                                  "results": results}, llm)
    print(f"wrote {path}")


def draw(r: dict) -> list[str]:
    m = r["machine"]
    lines = [f"**Plain decode, our engine vs transformers `generate`** — random-init {r['params_m']}M Llama, "
             f"{r['dtype']}, {r['tokens']} new tokens, {tables.host(m)}, {m['threads']} threads, torch {m['torch']} "
             "(`python -m bench hf`):", "",
             "| batch | ours tok/s | transformers tok/s | ratio |", "| --- | --- | --- | --- |"]
    for b, row in r["results"].items():
        lines.append(f"| {b} | {row['ours']['median']:.0f} | {row['transformers']['median']:.0f} | "
                     f"{row['ratio']:.2f}x |")
    return lines + [""]



if __name__ == "__main__":
    main()
