"""Which tokens a vocabulary-restricted draft model scores (`EngineConfig.draft_vocab_size`).

The draft's output layer is usually the largest single matmul of a small draft (vocab x hidden);
scoring only the N most frequent tokens makes each draft step read a fraction of it. Exactness
is untouched: the proposer's distribution q is zero outside the kept set, the target still
scores the whole vocabulary, and the acceptance rule is exact for any q. Only acceptance
changes, on positions where the target wants a token outside the set.

The ranking comes from `token_ranking.json` beside the draft checkpoint: a JSON object whose
`token_ids` lists token ids most frequent first (tools/pair/ranking.py writes it for the
embedded pair). The tokenizer's EOS ids are always kept, so the draft can propose a stop.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

RANKING_FILE = "token_ranking.json"


def draft_output_ids(draft_dir: Path, size: int, vocab_size: int, always: set[int]) -> torch.Tensor:
    """The kept token ids [<= size + len(always)], sorted: the `size` most frequent plus `always`."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}] (the vocabulary size), got {size}")
    path = Path(draft_dir) / RANKING_FILE
    if not path.exists():
        raise ValueError(f"draft_vocab_size={size} needs a token frequency ranking at {path} "
                         "(a JSON object with 'token_ids', most frequent first); none is there")
    try:
        ranking = json.loads(path.read_text())["token_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a token ranking (a JSON object with a 'token_ids' list)") from exc
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ranking):
        raise ValueError(f"{path}: every token id must be an integer in [0, {vocab_size})")
    if len(set(ranking)) != len(ranking) or len(ranking) < size:
        raise ValueError(f"{path}: 'token_ids' must hold at least {size} distinct ids, has "
                         f"{len(set(ranking))} distinct of {len(ranking)}")
    kept = set(ranking[:size]) | {t for t in always if 0 <= t < vocab_size}
    return torch.tensor(sorted(kept), dtype=torch.long)  # [V']
