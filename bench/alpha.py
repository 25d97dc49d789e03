"""Per-token acceptance of model proposers side by side: greedy, fixed K, the held-out code prompts.

    python -m bench alpha embedded:draft models/eagle3 path/to/another/head [--k 5] [--prompts 8 48]

For each proposer (a draft model or an EAGLE-3 head for the embedded target) and each prompt
count: α = accepted ÷ (accepted + rejections) over all rounds, tokens per round (the
target's own token included) and, for a head with a reduced vocabulary, the share of rejections
at a token it cannot propose. Comparing heads from different training runs on the same prompts
is what it is for; speed is measured by `python -m bench spec`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import per_token_alpha  # noqa: E402
from bench.workloads import load_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model.eagle3 import is_eagle3  # noqa: E402
from engine.model.loader import resolve_model_path  # noqa: E402


def alpha(outputs) -> tuple[float, float]:
    """(per-token α, tokens per round) over every round of `outputs`."""
    accepted = sum(sum(o.accepted_per_round) for o in outputs)
    rounds = sum(len(o.accepted_per_round) for o in outputs)
    return per_token_alpha(outputs) or 0.0, (accepted + rounds) / max(1, rounds)


def rejections_outside(outputs, vocabulary: set[int]) -> float:
    """Share of rejections whose target token lies outside the proposer's draft vocabulary: a
    certain rejection under greedy decoding, whatever the head learned. Rounds start after the
    prefill's token; a round yields its accepted proposals, then the target's own token. Plain
    steps may follow the rounds (the length guard's last token of a fixed-K run), but a step
    without a proposal between rounds would shift the rest: rounds that claim more tokens than
    the output has are an error."""
    rejected = outside = 0
    for o in outputs:
        at = 1
        for a, k in zip(o.accepted_per_round, o.proposed_per_round):
            if at + a >= len(o.token_ids):
                raise ValueError(f"{len(o.token_ids)} tokens, fewer than the prefill and the recorded rounds "
                                 "yield: some came from steps without a proposal")
            if a < k:
                rejected += 1
                outside += o.token_ids[at + a] not in vocabulary
            at += a + 1
    return outside / max(1, rejected)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench alpha", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("proposers", nargs="+", help="draft models or EAGLE-3 heads (paths or embedded:NAME)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 48])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=16, help="requests decoded together (max_batch_size)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for n in args.prompts:
        prompts = load_prompts("code", n)
        for proposer in args.proposers:
            method = "eagle" if is_eagle3(resolve_model_path(proposer)) else "draft"
            llm = LLM(draft_model=proposer, speculative_method=method, spec_policy="fixed", spec_length=args.k,
                      max_batch_size=args.batch)
            outputs = llm.generate(prompts, params)
            a, per_round = alpha(outputs)
            head = llm.engine.draft_model
            outside = "" if method != "eagle" or head.identity_vocab else (
                f", rejections at a token outside its {head.draft_to_target.numel()} ids "
                f"{rejections_outside(outputs, set(head.draft_to_target.tolist())):.3f}")
            print(f"{n} prompts, K={args.k}, batch {args.batch}, {proposer}: alpha {a:.3f}, tokens per round "
                  f"{per_round:.2f}{outside}", flush=True)
            del llm


if __name__ == "__main__":
    main()
