"""One command that reproduces the embedded default model pair in models/.

    python tools/make_default_pair.py            # all stages, resumable
    python tools/make_default_pair.py --work DIR # where corpus, tokens and checkpoints live

Stages: corpus -> tokenizer -> target (from scratch) -> draft (distilled on corpus windows) ->
target generations -> draft fine-tuned on them (on-policy distillation) -> a second round on
fresh generations (new prompts, two thirds greedy) -> export -> model card
(measured with our engine; validation prompts saved to bench/data/code_val_prompts.jsonl).
Every stage skips itself when its output exists and training resumes from its last checkpoint,
so rerunning the same command after an interruption continues where it stopped.
Run it in the background:  nohup python tools/make_default_pair.py > recipe.log 2>&1 &
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pair.card import write_card  # noqa: E402
from pair.corpus import build_corpus  # noqa: E402
from pair.export import export_model  # noqa: E402
from pair.generations import generate_rows, mixed_batches  # noqa: E402
from pair.prompts import write_all  # noqa: E402
from pair.tokenizer import encode_splits, train_tokenizer  # noqa: E402
from pair.train import DRAFT, DRAFT_ONPOLICY, DRAFT_ONPOLICY2, TARGET, train_stage  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "specserve-recipe")
    parser.add_argument("--out", type=Path, default=REPO / "models")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)

    build_corpus(args.work)
    tokenizer = train_tokenizer(args.work)
    encode_splits(args.work, tokenizer)
    target = train_stage(args.work, TARGET, tokenizer)
    for p in target.parameters():
        p.requires_grad_(False)
    export_model(target, tokenizer, args.out / "target")
    train_stage(args.work, DRAFT, tokenizer, teacher=target)
    rows = generate_rows(args.work, args.out / "target")
    torch.set_num_threads(args.threads)
    draft = train_stage(args.work, DRAFT_ONPOLICY, tokenizer, teacher=target,
                        init_from=args.work / DRAFT.name / "final",
                        batches=mixed_batches(args.work, rows))
    rows2 = generate_rows(args.work, args.out / "target", n_rows=2048, seed=11, name="generations2", sampled_every=3)
    torch.set_num_threads(args.threads)
    draft = train_stage(args.work, DRAFT_ONPOLICY2, tokenizer, teacher=target,
                        init_from=args.work / DRAFT_ONPOLICY.name / "final",
                        batches=mixed_batches(args.work, rows2))
    export_model(draft, tokenizer, args.out / "draft")
    prompts = write_all(args.work / "corpus" / "val.jsonl", REPO / "bench" / "data")
    write_card(args.work, args.out, prompts)


if __name__ == "__main__":
    main()
