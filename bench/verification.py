"""Block vs token verification: accepted tokens per round and speed, batch 1, sampled.

    python -m bench verification [--temperature 0.8] [--k 4] [--prompts 8] [--tokens 96] [--repeats 5]

The shipped pair, EAGLE-3 head and draft model, each at fixed K and adaptive, held-out code prompts
one at a time, each decoded by every variant back to back on the same seed (bench.common.
interleave_prompts; each repeat its own seeds, so the spread over repeats is the spread over
seeds). Figures: accepted tokens per round and tok/s, block ÷ token (goals >= 1.0), per repeat and
pooled over every repeat. Beside the accepted tokens each rule drew, both rules' expected accepted
tokens are computed for every sampled round from its p, q and proposal: a comparison on the same
rounds, free of acceptance noise (its time is taken out of the decode's).
"""

from __future__ import annotations

import statistics
import time

import torch

from bench import tables
from bench.common import adaptive, fixed, interleave_prompts, parser, pooled, write
from bench.workloads import load_prompts


class ExpectedAcceptance:
    """Both rules' expected accepted tokens, summed over every round the engine verifies by sampling
    (rejection.verify / verify_block wrapped), by (variant, repeat) as `switch` last set: token
    rule Σ_i Π_{j<=i} min(1, p/q); block rule Σ_i i h_i Π_{j>i} (1 - h_j). The seconds this
    bookkeeping took are kept too, to take out of the variant's decode time."""

    def __init__(self):
        self.sums: dict[tuple[str, int], dict[str, float]] = {}
        self.key = ("", 0)

    def switch(self, name: str, repeat: int) -> None:
        self.key = (name, repeat)

    def install(self) -> None:
        import engine.speculative.verify.chain as rejection

        for name in ("verify", "verify_block"):
            real = getattr(rejection, name)

            def wrapped(p, q, draft, num_proposed, uniforms, real=real):
                self.observe(p, q, draft, num_proposed)
                return real(p, q, draft, num_proposed, uniforms)
            setattr(rejection, name, wrapped)

    def observe(self, p, q, draft, num_proposed) -> None:
        from engine.speculative.verify.chain import acceptance_ratios, block_acceptance

        t0 = time.perf_counter()
        s = self.sums.setdefault(self.key, dict.fromkeys(("token", "block", "rounds", "seconds"), 0.0))
        K = p.shape[1] - 1
        if K > 0:
            p, q = p.double(), q.double()
            ratio = acceptance_ratios(p, q, draft).clamp(max=1)  # [N, K]
            in_range = torch.arange(K)[None, :] < num_proposed[:, None]  # [N, K]
            s["token"] += float((ratio * in_range).cumprod(-1).sum())
            _, h = block_acceptance(p, q, draft, num_proposed)  # [N, K + 1]
            for i in range(1, K + 1):
                s["block"] += float((i * h[:, i] * (1 - h[:, i + 1:]).prod(-1)).sum())
            s["rounds"] += int((num_proposed > 0).sum())
        s["seconds"] += time.perf_counter() - t0

    def of(self, name: str, repeat: int) -> dict:
        s = self.sums.get((name, repeat), {"token": 0.0, "block": 0.0, "rounds": 0, "seconds": 0.0})
        rounds = s["rounds"] or 1
        return {"expected_token": s["token"] / rounds, "expected_block": s["block"] / rounds,
                "bookkeeping_seconds": s["seconds"]}


def _parser():
    ap = parser("verification", __doc__, tokens=96, models=False)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--k", type=int, default=4, help="K of the fixed-K variants")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--methods", nargs="+", default=["eagle", "draft"], choices=["eagle", "draft"])
    ap.set_defaults(repeats=5)
    return ap


def measured_runs(llm, specs: dict, prompts: list, params, repeats: int, method: str,
                  expected: ExpectedAcceptance) -> dict[str, list[dict]]:
    """One warm-up repeat, then `repeats` measured ones; each run gets both rules' expected accepted
    tokens, and its seconds and tok/s without the time that bookkeeping took."""
    interleave_prompts(llm, specs, prompts, params, 1, f"{method} warm-up")
    expected.sums.clear()
    runs = interleave_prompts(llm, specs, prompts, lambda r: params(r + 1), repeats, method,
                              switch=expected.switch)
    for name, per_repeat in runs.items():
        for r, run in enumerate(per_repeat):
            run.update(expected.of(name, r))
            run["seconds"] -= run["bookkeeping_seconds"]  # the decode's own time
            run["tok_s"] = run["tokens"] / run["seconds"]
    return runs


def block_over_token(runs: dict[str, list[dict]], shape: str) -> dict:
    """One shape's figures: each rule's accepted tokens per round and tok/s, block ÷ token per
    repeat and pooled, and the expected ratio on the same rounds."""
    token, block = runs[f"{shape} token"], runs[f"{shape} block"]
    accepted = [b["accepted_per_round"] / t["accepted_per_round"] for t, b in zip(token, block)]
    speed = [b["tok_s"] / t["tok_s"] for t, b in zip(token, block)]
    pooled_speed = {rule: pooled(runs[f"{shape} {rule}"], "tokens", "seconds") for rule in ("token", "block")}
    same_rounds = [r["expected_block"] / r["expected_token"] for r in token + block if r["expected_token"]]
    pooled_accepted = {rule: pooled(runs[f"{shape} {rule}"], "accepted", "rounds") for rule in ("token", "block")}
    return {
        "accepted_per_round": {rule: statistics.median(r["accepted_per_round"] for r in runs[f"{shape} {rule}"])
                               for rule in ("token", "block")},
        "block_over_token_accepted": {"median": statistics.median(accepted), "min": min(accepted),
                                      "max": max(accepted), "per_seed": accepted},
        "block_over_token_accepted_pooled": pooled_accepted["block"] / pooled_accepted["token"],
        "block_over_token_tok_s": {"median": statistics.median(speed), "min": min(speed), "max": max(speed),
                                   "pooled": pooled_speed["block"] / pooled_speed["token"]},
        "expected_block_over_token_same_rounds": {"median": statistics.median(same_rounds),
                                                  "min": min(same_rounds), "max": max(same_rounds)},
        "tok_s": {rule: statistics.median(r["tok_s"] for r in runs[f"{shape} {rule}"]) for rule in ("token", "block")},
    }


def print_shape(method: str, shape: str, entry: dict) -> None:
    """One shape's block ÷ token figures, one line."""
    accepted, speed = entry["block_over_token_accepted"], entry["block_over_token_tok_s"]
    same_rounds = entry["expected_block_over_token_same_rounds"]
    print(f"{method} {shape}: accepted/round token {entry['accepted_per_round']['token']:.3f} "
          f"block {entry['accepted_per_round']['block']:.3f} -> x{accepted['median']:.3f} "
          f"[{accepted['min']:.3f}, {accepted['max']:.3f}] (pooled x{entry['block_over_token_accepted_pooled']:.3f}); "
          f"tok/s x{speed['median']:.3f} [{speed['min']:.3f}, {speed['max']:.3f}] (pooled x{speed['pooled']:.3f}); "
          f"expected on the same rounds x"
          f"{same_rounds['median']:.3f} [{same_rounds['min']:.3f}, {same_rounds['max']:.3f}]", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams

    prompts = load_prompts("code")[:args.prompts]
    expected = ExpectedAcceptance()
    expected.install()
    results = {}

    def params(r: int) -> list:  # repeat r's seeds, the same for every variant
        return [SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True,
                               seed=1000 * r + i) for i in range(len(prompts))]

    for method in args.methods:
        llm = LLM(speculative_method=method, max_batch_size=1, max_seq_len=1024)
        shapes = {f"K={args.k}": fixed(method, args.k), "adaptive": adaptive(method)}
        specs = {f"{shape} {rule}": {**spec, "verification": rule} for shape, spec in shapes.items()
                 for rule in ("token", "block")}
        runs = measured_runs(llm, specs, prompts, params, args.repeats, method, expected)
        row = {}
        for shape in shapes:
            row[shape] = block_over_token(runs, shape)
            print_shape(method, shape, row[shape])
        results[method] = {"variants": list(specs), **row}
    path = write("verification", {"temperature": args.temperature, "k": args.k, "prompts": args.prompts,
                                  "tokens": args.tokens, "repeats": args.repeats, "results": results})
    print(f"wrote {path}")


def draw(r: dict) -> list[str]:
    lines = [f"**Block vs token verification** — the shipped pair at T = {r['temperature']}, {r['prompts']} code "
             f"prompts x {r['tokens']} tokens one at a time (batch 1), {r['repeats']} repeats with their own seeds, "
             f"each prompt decoded by both rules back to back; {tables.host(r['machine'])} (`python -m bench verification`). "
             "*Expected on the same rounds*: both rules' expected accepted tokens computed from each verified round's "
             "p, q and proposal, free of the draws' noise (goals: block ÷ token at least 1.0).", "",
             "| proposer | K | accepted/round token → block | block ÷ token, accepted | expected on the same rounds | "
             "block ÷ token, tok/s |", "| --- | --- | --- | --- | --- | --- |"]
    for method, row in r["results"].items():
        for shape in (n for n in row if n != "variants"):
            e = row[shape]
            accepted = dict(e["block_over_token_accepted"])
            if "block_over_token_accepted_pooled" in e:
                accepted["pooled"] = e["block_over_token_accepted_pooled"]
            lines.append(f"| {method} | {shape.removeprefix('K=')} | {e['accepted_per_round']['token']:.2f} → "
                         f"{e['accepted_per_round']['block']:.2f} | {tables.spread(accepted)} | "
                         f"{tables.spread(e['expected_block_over_token_same_rounds'])} | {tables.spread(e['block_over_token_tok_s'])} |")
    return lines + [""]



def page_targets(row: tables.Row) -> None:
    """The block-verification targets: accepted tokens and tok/s against token verification."""
    if (r := tables.load("verification")) is not None:
        for key, what in (("block_over_token_accepted", "accepted tokens per round"), ("block_over_token_tok_s", "tok/s")):
            ratios = {f"{m} {shape}": e[key]["median"] for m, row_ in r["results"].items()
                      for shape, e in row_.items() if shape != "variants"}
            row(f"block ÷ token verification >= 1.0, {what} (batch 1, T = {r['temperature']})", tables.span(ratios),
                min(ratios.values()) >= 1.0)


if __name__ == "__main__":
    main()
