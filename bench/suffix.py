"""Suffix decoding against prompt lookup, EAGLE-3 and plain decoding on the shipped target.

    python -m bench suffix [--warm 40] [--measure 16] [--tokens 160] [--repeats 3] [--batches 1 16]
                           [--temperature 0.3] [--skip-code]
    python -m bench suffix --soak 600 [--cache-tokens 4000]

1. agent (bench/workloads.py: JSON tool calls under a fixed tool set's schema, T = --temperature,
   0.3 by default: agents sample tool calls cool; at 0 the shipped model's answers are all alike): the suffix
   cache is warmed with --warm requests answered with suffix decoding; then every variant answers
   the other --measure requests from that same warm cache (restored before each run, so a run
   learns only from its own answers), one at a time (batch 1) and all at once (batch 16): plain,
   n-gram, EAGLE-3, suffix chains, suffix trees, hybrid EAGLE-3 + suffix, all adaptive (K <= 16).
2. code prompts (greedy): warmed with the first --warm, the rest measured: adaptive EAGLE-3 with
   and without suffix (hybrid), adaptive n-gram and suffix (it must not cost where nothing repeats).
3. proposal time: our suffix cache and arctic-inference's C++ suffix tree (when importable) on the
   warm agent cache, the same contexts.
--soak: the engine answering agent requests for that many seconds with a small cache; the tokens
and bytes the cache holds after every request, against its bound.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch
from tqdm import tqdm

from bench.common import PLAIN, adaptive, generate_each, interleave, parser, write
from bench.workloads import agent_prompts, agent_schema, load_prompts

K_MAX = 16


def variants_for(methods: list[str]) -> dict[str, dict]:
    shapes = {"plain": PLAIN, "ngram": adaptive("ngram", K_MAX), "eagle": adaptive("eagle", K_MAX),
              "suffix": {**adaptive("suffix", K_MAX), "tree_width": 1},
              "suffix trees": {**adaptive("suffix", K_MAX), "tree_width": 3, "tree_tokens": 24},
              "hybrid eagle+suffix": {**adaptive("hybrid", K_MAX), "hybrid_lookup": "suffix"}}
    return {name: {"tree_width": 1, **shapes[name]} for name in methods}


def run_once(llm, warm_cache, spec: dict, prompts: list[str], params: list, batch: int) -> dict:
    """The variant on a copy of the warm cache: tok/s (batch 1: one request at a time; else all
    submitted at once), accepted tokens per round."""
    speculation = llm.engine.speculation
    speculation.suffix_cache = copy.deepcopy(warm_cache)
    llm.engine.reconfigure_speculation(**spec)
    t0 = time.perf_counter()
    if batch == 1:
        outs, _ = generate_each(llm, prompts, params)
    else:
        outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    rounds = sum(o.num_spec_rounds for o in outs)
    return {"tok_s": sum(len(o.token_ids) for o in outs) / seconds,
            "accepted_per_round": sum(o.num_accepted_tokens for o in outs) / rounds if rounds else 0.0}


def compare(llm, warm_cache, names: list[str], prompts, params, batch: int, repeats: int, desc: str) -> dict:
    variants = {n: (lambda s=s: run_once(llm, warm_cache, s, prompts, params, batch))
                for n, s in variants_for(names).items()}
    for fn in variants.values():
        fn()  # warm-up: the adaptive policy's calibration at this batch size and K_MAX
    runs = interleave(variants, repeats, desc)
    row = {n: {k: statistics.median(r[k] for r in runs[n]) for k in ("tok_s", "accepted_per_round")} for n in names}
    row["runs"] = runs
    return row


def ratio(runs: dict, a: str, b: str) -> dict:
    values = [x["tok_s"] / y["tok_s"] for x, y in zip(runs[a], runs[b])]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def warm(llm, prompts, params) -> object:
    llm.engine.reconfigure_speculation(**adaptive("suffix", K_MAX))
    for p, sp in tqdm(list(zip(prompts, params)), desc="warming the suffix cache", unit="request"):
        llm.generate(p, sp)
    return copy.deepcopy(llm.engine.speculation.suffix_cache)


def proposal_times(llm, cache, prompts: list[str], params) -> dict:
    """Microseconds per proposal (depth 16, 24 nodes, width 3): ours and arctic-inference's, each
    request's context grown token by token over its own answer."""
    from engine.speculative.proposers.suffix import DraftLimits, SuffixProposer

    tokenizer = llm.engine.tokenizer
    llm.engine.reconfigure_speculation(**adaptive("suffix", K_MAX))
    answers = [o.token_ids for o in llm.generate(prompts, params)]
    contexts = [(tokenizer.encode(p), a) for p, a in zip(prompts, answers)]
    ours = SuffixProposer(cache, "all", 0, "cpu")

    class Req:  # what a lookup reads of a request
        def __init__(self, ids):
            self.all_token_ids, self.params = ids, params[0]

    t, n = 0.0, 0
    for prompt, answer in contexts:
        for j in range(len(answer)):
            r = Req(prompt + answer[:j])
            t0 = time.perf_counter()
            ours.draft(r, DraftLimits(K_MAX, 24, 3))
            t += time.perf_counter() - t0
            n += 1
    out = {"ours_us": t / n * 1e6, "proposals": n}
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        out["arctic_us"] = None
        return out
    arctic = SuffixDecodingCache(24, -1)
    for i, text in enumerate(cache_texts(cache)):
        arctic.start_request(f"w{i}", [])
        arctic.add_active_response(f"w{i}", text)
        arctic.stop_request(f"w{i}")
    t = 0.0
    for i, (prompt, answer) in enumerate(contexts):
        t0 = time.perf_counter()
        arctic.start_request(f"m{i}", prompt)
        for j in range(len(answer)):
            arctic.speculate(f"m{i}", prompt + answer[:j], 24, use_tree_spec=True)
            arctic.add_active_response(f"m{i}", answer[j:j + 1])
        arctic.stop_request(f"m{i}")
        t += time.perf_counter() - t0
    out["arctic_us"] = t / n * 1e6  # its own text's tree updated as it grows, included
    return out


def cache_texts(cache) -> list[list[int]]:
    texts = []
    for part in cache._scopes.values():
        for start, end in part.spans:
            texts.append(part.buffer[start + 1 - part.base:end - part.base].tolist())
    return texts


def resident_mb() -> float:
    """The process's resident memory now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(args) -> None:
    from serve_app.kernel_caches import bound_kernel_caches

    kernel_caches = bound_kernel_caches()  # as a replica runs (before any model): RSS then measures the engine
    from engine import LLM, SamplingParams
    from engine.structured_output import StructuredOutput

    llm = LLM(speculative_method=args.method, spec_length=K_MAX, suffix_cache_tokens=args.cache_tokens,
              max_batch_size=8, max_seq_len=1024, enable_prefix_caching=False)
    cache = llm.engine.speculation.suffix_cache
    prompts, schema = agent_prompts(), StructuredOutput.json_schema(agent_schema())
    engine, samples, rss, i = llm.engine, [], [], 0
    start = time.monotonic()
    end = start + args.soak
    with tqdm(total=args.soak, desc="soak", unit="s") as bar:
        while time.monotonic() < end:
            while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 8:
                engine.add_request(prompts[i % len(prompts)], SamplingParams(
                    temperature=0.8, seed=i, max_tokens=args.tokens, structured_output=schema))
                i += 1
            for out in engine.step():
                if out.finished:
                    engine.release(out.request_id)
                    samples.append((cache.num_tokens, cache.nbytes, cache.num_texts))
            if not rss or time.monotonic() - start >= len(rss) * args.soak / 10:
                rss.append(resident_mb())
            bar.n = min(args.soak, round(args.soak - (end - time.monotonic())))
            bar.refresh()
    tokens, nbytes, texts = (max(s[k] for s in samples) for k in range(3))
    result = {"method": args.method, "seconds": args.soak, "requests": len(samples), "cache_tokens_bound": args.cache_tokens,
              "max_tokens_held": tokens, "max_bytes_held": nbytes, "max_texts_held": texts,
              "bound_held": tokens <= args.cache_tokens, "evictions": len(samples) - cache.num_texts,
              "rss_mb_every_tenth": rss + [resident_mb()], "kernel_caches": kernel_caches}
    print(result)
    path = write("suffix_soak" if args.method == "suffix" else f"suffix_soak_{args.method}", result, llm)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    ap = parser("suffix", __doc__, tokens=160, models=False)
    ap.add_argument("--warm", type=int, default=40, help="requests answered into the cache before measuring")
    ap.add_argument("--measure", type=int, default=16, help="requests measured (after the warm ones)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--temperature", type=float, default=0.3, help="the agent workload's sampling temperature")
    ap.add_argument("--skip-code", action="store_true", help="the agent workload only")
    ap.add_argument("--soak", type=int, default=0, help="seconds of the memory soak instead of the comparison")
    ap.add_argument("--cache-tokens", type=int, default=4000, help="the soak's suffix_cache_tokens")
    ap.add_argument("--method", default="suffix", help="the soak's speculative_method (another: its memory beside)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.soak:
        return soak(args)
    from engine import LLM, SamplingParams
    from engine.structured_output import StructuredOutput

    llm = LLM(max_batch_size=max(args.batches), max_seq_len=1024, enable_prefix_caching=False)
    results: dict = {}
    # 1. agent
    prompts, schema = agent_prompts(), StructuredOutput.json_schema(agent_schema())
    params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.tokens, structured_output=schema)
              for i in range(len(prompts))]
    warm_cache = warm(llm, prompts[:args.warm], params[:args.warm])
    measured, measured_params = prompts[args.warm:args.warm + args.measure], params[args.warm:args.warm + args.measure]
    names = ["plain", "ngram", "eagle", "suffix", "suffix trees", "hybrid eagle+suffix"]
    for b in args.batches:
        row = compare(llm, warm_cache, names, measured, measured_params, b, args.repeats, f"agent, batch {b}")
        runs = row.pop("runs")
        row["ratios"] = {f"{a} / {c}": ratio(runs, a, c) for a, c in [
            ("suffix", "ngram"), ("suffix", "plain"), ("suffix trees", "ngram"), ("suffix trees", "plain"),
            ("suffix trees", "suffix"), ("suffix", "eagle"), ("hybrid eagle+suffix", "eagle")]}
        results[f"agent batch {b}"] = row
        print(f"agent batch {b}: " + "; ".join(f"{n} {row[n]['tok_s']:.1f} tok/s ({row[n]['accepted_per_round']:.2f}/round)"
                                                for n in names))
        print("  " + "; ".join(f"{k} x{v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]" for k, v in row["ratios"].items()))
    results["proposal_time"] = proposal_times(llm, warm_cache, measured, measured_params)
    print(f"proposal time (us): {results['proposal_time']}")
    # 2. code prompts, greedy
    code = [] if args.skip_code else load_prompts("code")
    greedy = [SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)] * len(code)
    code_warm = warm(llm, code[:args.warm], greedy[:args.warm]) if code else None
    code_measured = code[args.warm:args.warm + args.measure]
    names = ["ngram", "suffix", "eagle", "hybrid eagle+suffix"]
    for b in args.batches if code else []:
        row = compare(llm, code_warm, names, code_measured, greedy[:len(code_measured)], b, args.repeats,
                      f"code, batch {b}")
        runs = row.pop("runs")
        row["ratios"] = {f"{a} / {c}": ratio(runs, a, c) for a, c in [("suffix", "ngram"), ("hybrid eagle+suffix", "eagle")]}
        results[f"code batch {b}"] = row
        print(f"code batch {b}: " + "; ".join(f"{n} {row[n]['tok_s']:.1f} tok/s" for n in names) + "\n  " +
              "; ".join(f"{k} x{v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]" for k, v in row["ratios"].items()))
    name = "suffix" if args.temperature == 0.3 and code else f"suffix_agent_t{args.temperature:g}"
    path = write(name, {"warm": args.warm, "temperature": args.temperature, "measure": args.measure, "tokens": args.tokens, "k_max": K_MAX,
                            "repeats": args.repeats, "threads": os.environ.get("OMP_NUM_THREADS"),
                            "results": results}, llm)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
