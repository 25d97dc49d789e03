"""Structured outputs: constrained vs unconstrained decoding, speculation off and on, batch 1 and 16.

    python -m bench structured [--batches 1 16] [--tokens 128] [--repeats 3]

The same held-out code prompts decode either freely (ignore_eos) or under a JSON schema (an index
of functions: six objects with names, argument lists and return types, longer than --tokens, so
both kinds emit --tokens tokens). For each kind, plain decoding and adaptive speculation (draft,
hybrid) run interleaved; the figure of merit is how much of the unconstrained speedup survives
the grammar: (constrained spec / constrained plain) / (free spec / free plain), goal >= 0.90.
The grammar's own time (masks filled, walks, accepts, masking logits) is timed around each call
and reported as a share of the step time.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from bench import tables
from bench.batch_run import run_batch
from bench.common import PLAIN, adaptive, interleave, parser, summarize, write
from bench.workloads import load_prompts

SCHEMA = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "returns": {"enum": ["int", "str", "None", "list", "dict", "bool"]}},
    "required": ["name", "args", "returns"]}}
SPECULATION = {"plain": PLAIN, "draft adaptive": adaptive("draft"), "hybrid adaptive": adaptive("hybrid")}
GRAMMAR_CALLS = [("engine.runner", "mask_rows"), ("engine.speculative.proposers.draft_model", "mask_rows"),
                 ("engine.speculative.proposers.drafting", "_walk"),
                 ("engine.speculative.step", "cut_proposals"), ("engine.speculative.step", "mask_logits")]


class GrammarClock:
    """Wall time inside the grammar's calls (module-level names patched, matchers' commit wrapped)."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def install(self) -> None:
        import importlib

        from engine.grammar import GrammarMatcher

        for module_name, fn in GRAMMAR_CALLS:
            module = importlib.import_module(module_name)
            setattr(module, fn, self._timed(f"{module_name.split('.')[-1]}.{fn}", getattr(module, fn)))
        GrammarMatcher.commit = self._timed("commit", GrammarMatcher.commit)

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def main(argv: list[str] | None = None) -> None:
    ap = parser("structured", __doc__, tokens=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams
    from engine.structured_output import StructuredOutput

    clock = GrammarClock()
    clock.install()
    pool = load_prompts("code") + load_prompts("edit")
    llm = LLM(model=args.target, draft_model=args.draft, forward_plan=args.forward_plan,
              use_speculative_decoding=True, max_batch_size=max(args.batches), max_seq_len=1024,
              enable_prefix_caching=False, max_num_batched_tokens=2048)
    kinds = {"free": SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True),
             "constrained": SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                           structured_output=StructuredOutput.json_schema(SCHEMA))}
    results = {}
    for b in args.batches:
        prompts = pool[:b]

        def variant(spec, params, prompts=prompts):
            def go():
                llm.engine.reconfigure_speculation(**spec)
                clock.take()
                t0 = time.perf_counter()
                run = run_batch(llm, prompts, params)
                run["grammar_share"] = sum(clock.take().values()) / (time.perf_counter() - t0)
                del run["tokens"]
                return run
            return go

        variants = {f"{kind} {name}": variant(spec, params) for kind, params in kinds.items()
                    for name, spec in SPECULATION.items()}
        for fn in variants.values():
            fn()  # warm-up: every shape once
        runs = interleave(variants, args.repeats, f"batch {b}")
        row = {name: {"tok_s": summarize(rs, "tok_s_end_to_end"),
                      "grammar_share": statistics.median(r["grammar_share"] for r in rs),
                      "acceptance": statistics.median(r["acceptance"] or 0.0 for r in rs),
                      "k_steps": rs[-1]["k_steps"]} for name, rs in runs.items()}
        for name in SPECULATION:
            if name == "plain":
                continue
            speedup = {kind: row[f"{kind} {name}"]["tok_s"]["median"] / row[f"{kind} plain"]["tok_s"]["median"]
                       for kind in kinds}
            row[f"{name} speedup"] = {**speedup, "kept": speedup["constrained"] / speedup["free"]}
            print(f"batch {b:2d} {name}: free {speedup['free']:.2f}x, constrained {speedup['constrained']:.2f}x "
                  f"-> kept {speedup['constrained'] / speedup['free']:.3f}; grammar share "
                  f"{row[f'constrained {name}']['grammar_share']:.3f} (plain {row['constrained plain']['grammar_share']:.3f})")
        results[str(b)] = row
    path = write("structured", {"tokens": args.tokens, "repeats": args.repeats, "schema": SCHEMA,
                                "results": results}, llm)
    print(f"wrote {path}")


def draw(r: dict) -> list[str]:
    lines = [f"**Structured outputs** — the code prompts decoded freely or under a JSON schema (six objects of "
             f"names, argument lists and return types), {r['tokens']} tokens a request, greedy, {tables.host(r['machine'])}, "
             f"{tables.plan(r)}; tokens/s end to end, medians of {r['repeats']} interleaved repeats with their range "
             "(`python -m bench structured`). *Kept*: constrained speedup ÷ free speedup. *Grammar*: the share of "
             "wall time inside grammar calls (masks filled and applied, walks ahead, commits).", "",
             "| batch | speculation | free tok/s | constrained tok/s | free speedup | constrained speedup | kept | "
             "grammar share |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b, row in r["results"].items():
        for name in [n.removeprefix("free ") for n in row if n.startswith("free ")]:
            free, con = row[f"free {name}"], row[f"constrained {name}"]
            gain = row.get(f"{name} speedup")
            cells = ["", "", ""] if gain is None else [f"{gain['free']:.2f}x", f"{gain['constrained']:.2f}x",
                                                       f"{gain['kept']:.3f}"]
            lines.append(f"| {b} | {name} | {free['tok_s']['median']:.0f} ({free['tok_s']['min']:.0f}–"
                         f"{free['tok_s']['max']:.0f}) | {con['tok_s']['median']:.0f} ({con['tok_s']['min']:.0f}–"
                         f"{con['tok_s']['max']:.0f}) | " + " | ".join(cells) + f" | {con['grammar_share']:.1%} |")
    return lines + [""]



def page_targets(row: tables.Row) -> None:
    """The structured-output target: the share of the free speedup kept."""
    if (r := tables.load("structured")) is not None:
        kept = {f"batch {b} {n.removesuffix(' speedup')}": v["kept"] for b, row_ in r["results"].items()
                for n, v in row_.items() if n.endswith(" speedup")}
        worst = min(kept, key=kept.get)
        row("structured outputs: constrained speculation keeps >= 90% of the free speedup",
            f"{min(kept.values()):.3f} ({worst}) to {max(kept.values()):.3f}", min(kept.values()) >= 0.9)


if __name__ == "__main__":
    main()
