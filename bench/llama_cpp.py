"""llama.cpp on the same weights: plain greedy decode and its prompt-lookup draft, vs our engine.

    python -m bench llamacpp [--workload code edit] [--prompts 8] [--tokens 96] [--repeats 3]

Needs `llama-cpp-python` (built from its PyPI sdist; not part of the bench extra because the
build takes ~15 min on 2 cores):

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d build/llama-cpp
    CMAKE_BUILD_PARALLEL_LEVEL=2 pip install build/llama-cpp/llama_cpp_python-0.3.36.tar.gz sentencepiece

The shipped checkpoints are converted to GGUF (bf16, no quantisation) with the converter vendored
in that same sdist. Our tokenizer is byte-level BPE with GPT-2's pre-tokenizer regex but is not in
the converter's table of known tokenizers (it identifies them by hashing a test encoding), so the
conversion tells it the pre-tokenizer is "gpt-2" -- which is exactly what our tokenizer.json says.
Both engines decode the same token-id prompts, greedy, EOS ignored, batch 1, 2 threads.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from bench import tables
from bench.common import batch1_llm, interleave, ours_variant, parser, summarize, write
from bench.peers import OURS_VARIANTS
from bench.workloads import load_prompts

REPO = Path(__file__).resolve().parents[1]
SDIST_VERSION = "0.3.36"
BUILD = REPO / "build" / "llama-cpp"

_CONVERT = """
import runpy, sys
sys.path.insert(0, {vendor!r}); sys.path.insert(1, {vendor!r} + '/gguf-py')
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'  # ByteLevel BPE, GPT-2 regex
sys.argv = ['convert_hf_to_gguf.py', {src!r}, '--outtype', 'bf16', '--outfile', {dst!r}]
runpy.run_path({vendor!r} + '/convert_hf_to_gguf.py', run_name='__main__')
"""


def converter_dir() -> Path:
    """The llama.cpp tree vendored in the llama-cpp-python sdist (downloaded from PyPI if absent)."""
    vendor = BUILD / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
    if (vendor / "convert_hf_to_gguf.py").exists():
        return vendor
    BUILD.mkdir(parents=True, exist_ok=True)
    sdist = BUILD / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={SDIST_VERSION}", "--no-deps",
                        "--no-binary", ":all:", "-d", str(BUILD)], check=True)
    prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (
            m.name == prefix + "convert_hf_to_gguf.py" or m.name.startswith(prefix + "conversion/")
            or m.name.startswith(prefix + "gguf-py/"))]
        tar.extractall(BUILD, members=members, filter="data")
    return vendor


def to_gguf(model_dir: Path) -> Path:
    out = BUILD / f"{model_dir.name}-bf16.gguf"
    if not out.exists():
        script = _CONVERT.format(vendor=str(converter_dir()), src=str(model_dir), dst=str(out))
        subprocess.run([sys.executable, "-c", script], check=True)
    return out


def _parser():
    ap = parser("llamacpp", __doc__, tokens=96, workloads=True)
    ap.add_argument("--lookup-tokens", type=int, default=10)
    return ap


def cpp_variant(model, prompts: list, tokens: int):
    """One llama.cpp run: greedy decode of each prompt alone, stopped at `tokens` new tokens; tok/s
    and the tokens."""
    def go():
        out_tokens = []
        t0 = time.perf_counter()
        for p in prompts:
            model.reset()
            out = []
            for tok in model.generate(p, top_k=1, temp=0.0, reset=True):
                out.append(tok)
                if len(out) == tokens:
                    break
            out_tokens.append(out)
        dt = time.perf_counter() - t0
        return {"tok_s": sum(map(len, out_tokens)) / dt, "tokens": out_tokens}
    return go


def workload_table(workload: str, runs: dict[str, list[dict]]) -> dict:
    """One workload's table (speed over llama.cpp plain, tokens the same as its), printed."""
    base = runs["llama.cpp plain"][0]["tokens"]
    cpp_plain = summarize(runs["llama.cpp plain"], "tok_s")["median"]
    table = {}
    for name, rs in runs.items():
        s = summarize(rs, "tok_s")
        same = sum(a == b for x, y in zip(rs[0]["tokens"], base) for a, b in zip(x, y)) / sum(map(len, base))
        table[name] = {"tok_s": s, "vs_llama_cpp_plain": s["median"] / cpp_plain,
                       "same_as_llama_cpp_plain": same}
        print(f"{workload:5s} {name:32s} {s['median']:8.1f} tok/s  {s['median'] / cpp_plain:5.2f}x llama.cpp plain"
              f"  same tokens as llama.cpp plain {same:.1%}")
    return table


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        status = f"not measured: llama-cpp-python is not installed ({e}); see `python -m bench llamacpp --help`"
        print(status)
        write("llama_cpp", {"status": status})
        return
    torch.set_num_threads(args.threads)
    from engine import SamplingParams
    from engine.model.loader import resolve_model_path

    gguf = to_gguf(resolve_model_path(args.target))
    common = {"model_path": str(gguf), "n_ctx": 1024, "n_threads": args.threads, "n_threads_batch": args.threads,
              "verbose": False, "seed": 0}
    plain_cpp = llama_cpp.Llama(**common)
    lookup_cpp = llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens))
    llm = batch1_llm(args.target, args.draft, args.forward_plan)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    for workload in args.workload:
        prompts = [llm.engine.tokenizer.encode(p) for p in load_prompts(workload, args.prompts)]
        variants = {
            "llama.cpp plain": cpp_variant(plain_cpp, prompts, args.tokens),
            f"llama.cpp prompt lookup ({args.lookup_tokens})": cpp_variant(lookup_cpp, prompts, args.tokens),
            **{name: ours_variant(llm, OURS_VARIANTS[name], prompts, params)
               for name in ("ours plain", "ours ngram (adaptive)", "ours hybrid (adaptive)")},
        }
        for fn in variants.values():
            fn()  # warm-up
        runs = interleave(variants, args.repeats, f"llama.cpp ({workload})")
        results[workload] = workload_table(workload, runs)
    path = write("llama_cpp", {"status": "measured", "llama_cpp_python": llama_cpp.__version__, "gguf": "bf16",
                               "prompts": args.prompts, "tokens": args.tokens, "repeats": args.repeats,
                               "workloads": results})
    print(f"wrote {path}")


def draw(r: dict) -> list[str]:
    if r.get("status") != "measured":
        return [f"**llama.cpp**: {r.get('status')}", ""]
    lines = [f"**llama.cpp** (llama-cpp-python {r['llama_cpp_python']}, the shipped target converted to GGUF "
             f"{r['gguf']}, batch 1, greedy, {r['tokens']} new tokens, {tables.host(r['machine'])}, "
             f"{r['machine']['threads']} threads; `python -m bench llamacpp`):", "",
             "| workload | variant | tok/s | vs llama.cpp plain | same tokens as llama.cpp plain |",
             "| --- | --- | --- | --- | --- |"]
    for w, table in r["workloads"].items():
        for name, e in table.items():
            lines.append(f"| {w} | {name} | {e['tok_s']['median']:.0f} | {e['vs_llama_cpp_plain']:.2f}x | "
                         f"{e['same_as_llama_cpp_plain']:.0%} |")
    return lines + [""]



if __name__ == "__main__":
    main()
