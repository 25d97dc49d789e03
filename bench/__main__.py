"""The benchmark CLI: `python -m bench <command> [options]` (each command's --help says more).

    spec     speculative vs plain on the shipped pair: methods x K, adaptive, theory (Thm 3.8)
    peers    transformers generate (plain / assisted / prompt lookup) vs our engine, same weights
    llamacpp llama.cpp (llama-cpp-python) plain and prompt-lookup on the same weights as GGUF
    sweep    batch sweep 1..64: plain vs fixed K vs adaptive, and the K the policy picked
    plan     the forward plan measured at load (auto) vs every plan forced, batch 1 and 16
    prefill  prefill chunk padding policies (power of two, multiples of 64 / 32, exact), batch 1
    structured  constrained (JSON schema) vs free decoding, speculation off and on, batch 1 and 16
    serve    guidellm against `serve run serve_config.yaml`: concurrency 1..32, plain / fixed K / adaptive
    hf       plain decode, our engine vs transformers on a random-init model of the target's shape
    gpu      the one-command GPU check: correctness, syncs, kernels and speed on random-weight models
             (at most ~8 minutes on one H100; `--device cpu --smoke` runs the same code on CPU)
    scale-out  2 replicas, shared-prefix multi-turn chat: one deployment vs ingress + engine, default vs
             prefix-aware router (hit rate, TTFT, tok/s); the ingress hop's cost at 1 replica
    startup  `LLM()` and `serve run` to the first answer, cold and warm caches, each in a fresh process
    compare  the default engine of two source trees (--before DIR --after DIR), alternating processes
    alpha    per-token acceptance of draft models and EAGLE-3 heads side by side, same prompts
    host-reads  tensor reads back to the host per decode step (each a sync on a GPU), plain and speculative
    suffix   suffix decoding vs n-gram, EAGLE-3 and plain on an agent workload (JSON tool calls) and code
             prompts, batch 1 and 16; proposal time vs arctic-inference; --soak: the cache's memory bound
    trees    token trees vs chains (n-gram): accepted tokens per round, speed at batch 1 and in batches
    verification  block vs token verification: accepted tokens per round and speed, batch 1, sampled
    logprobs what output logprobs cost: on vs off, plain and speculative, batch 1 and 16
    clients  third-party clients against `serve run`: lm-evaluation-harness scores (speculation on = off)
             and an openai-agents tool-calling loop (needs `pip install "lm_eval[api]" openai-agents`)
    quantized  weight-only INT8 / INT4 vs bf16, plain batch-1 decoding of a Qwen3-0.6B shape (CPU)
    policy   the adaptive policy's grid: proposer x workload x batch, plain, fixed K = 1-4, adaptive (and its
             A/A twin), per-request, end to end; adaptive ÷ plain and ÷ the best fixed K picked held out
    mixed    a mixed batch (edits greedy + code at T = 0.8, hybrid): plain, one K a step, a K per request
    packing  a packed verify pass (half the rows proposing) against the same pass padded, batch 8-64
    serve-mixed  the same mix through `serve run`: two guidellm clients (edits greedy, code at T = 0.8)
    invariance  what row-count invariance costs: batch_invariant on vs off (and an A/A twin), plain,
             EAGLE-3 and hybrid, batch 1 and 16, end to end
    exactness  greedy speculation = plain in the same engine? every proposer x chains / adaptive / trees / block,
             batch 1, 8 and 32, both pools, batch_invariant on (and off beside); a request alone = in a batch
    moe      a reduced Qwen3-MoE: plain, fixed K, adaptive, batch 1-32, beside transformers generate (CPU)
    plots    PNGs from bench/results/*.json
    report   rewrite docs/benchmarks/results.md and the README's headline table from bench/results/*.json
    all      spec, peers, llamacpp, sweep, plan, structured, serve, hf, plots, report in sequence
             (about an hour on 2 cores)
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"spec": "bench.spec_bench", "peers": "bench.peers", "llamacpp": "bench.llama_cpp",
            "sweep": "bench.sweep", "plan": "bench.plans", "structured": "bench.structured", "prefill": "bench.prefill",
            "serve": "bench.serve", "hf": "bench.engine_vs_hf", "gpu": "bench.gpu", "startup": "bench.startup",
            "compare": "bench.compare", "alpha": "bench.alpha", "host-reads": "bench.host_reads", "clients": "bench.clients", "logprobs": "bench.logprobs_cost", "verification": "bench.verification", "trees": "bench.trees", "suffix": "bench.suffix", "scale-out": "bench.scale_out",
            "quantized": "bench.quantized", "moe": "bench.moe", "invariance": "bench.invariance", "exactness": "bench.exactness", "mixed": "bench.mixed", "policy": "bench.policy", "packing": "bench.packing", "serve-mixed": "bench.serve_mixed",
            "plots": "bench.plots", "report": "bench.report"}
ALL = [("hf", []), ("spec", ["--workload", "code"]), ("spec", ["--workload", "edit"]),
       ("spec", ["--workload", "code", "--temperature", "0.8", "--ks", "2", "4", "6"]), ("peers", []),
       ("llamacpp", []), ("sweep", []), ("plan", []), ("structured", []), ("serve", []), ("plots", []), ("report", [])]


def run(command: str, argv: list[str]) -> None:
    if command not in COMMANDS:
        raise SystemExit(f"unknown command {command!r}; one of: {', '.join([*COMMANDS, 'all'])}")
    importlib.import_module(COMMANDS[command]).main(argv)


def main() -> None:
    from serve_app.kernel_caches import bound_kernel_caches

    bound_kernel_caches()  # the serving replica's kernel-cache bound, so figures match serving
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    command, argv = sys.argv[1], sys.argv[2:]
    if command == "all":
        for name, extra in ALL:
            print(f"\n=== python -m bench {name} {' '.join(extra)}", flush=True)
            run(name, extra)
    else:
        run(command, argv)


if __name__ == "__main__":
    main()
