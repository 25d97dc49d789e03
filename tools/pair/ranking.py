"""Stage: rank the vocabulary by how often each token occurs in the training split.

The engine can let the draft score only the most frequent tokens (`draft_vocab_size`): the
draft's output layer is then a fraction of its size, so each draft step reads far fewer
weights, while speculation stays exact (the proposer's distribution q is simply zero outside
the kept set). The ranking ships beside the draft checkpoint as `token_ranking.json`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger("recipe.ranking")

RANKING_FILE = "token_ranking.json"  # the name engine/spec/draft_vocab.py reads


def write_ranking(counts: np.ndarray, source: str, path: Path) -> Path:
    """counts [vocab] -> `path`, every id most frequent first (ties: lower id first)."""
    order = np.argsort(-counts, kind="stable")
    total = int(counts.sum())
    coverage = {str(n): round(float(counts[order[:n]].sum()) / max(total, 1), 4)
                for n in (512, 1024, 2048, 4096, 16384, 32768) if n < len(counts)}
    path.write_text(json.dumps({
        "description": f"token ids most frequent first, counted on {source}; used by the engine's draft_vocab_size",
        "tokens_counted": total,
        "coverage_of_top_n": coverage,
        "token_ids": [int(i) for i in order],
    }))
    log.info("token ranking over %d tokens written to %s (coverage %s)", total, path, coverage)
    return path


def write_token_ranking(work: Path, vocab_size: int, out_dir: Path) -> Path:
    """The recipe's stage: counts tokens in work/tokens/train.u16, writes out_dir/token_ranking.json."""
    stream = np.fromfile(work / "tokens" / "train.u16", dtype=np.uint16)
    counts = np.bincount(stream, minlength=vocab_size)[:vocab_size]  # [vocab]
    return write_ranking(counts, "the recipe's training split", out_dir / RANKING_FILE)


if __name__ == "__main__":
    import argparse

    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description="Rank a draft checkpoint's vocabulary by token frequency in "
                                             "text files (for the engine's draft_vocab_size).")
    ap.add_argument("--model", type=Path, required=True, help="the draft checkpoint directory (tokenizer)")
    ap.add_argument("files", type=Path, nargs="+", help="representative text of the traffic to serve")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    for f in args.files:
        ids = tokenizer(f.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=len(counts))[:len(counts)]
    write_ranking(counts, f"{len(args.files)} text files", args.model / RANKING_FILE)
