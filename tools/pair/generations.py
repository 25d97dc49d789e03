"""Stage 4b: sequences written by the target itself, for on-policy distillation of the draft.

At serving time the draft proposes continuations of text the *target* is writing, so that is the
distribution its agreement matters on. We sample prompts from the training split (never the
validation files), let the exported target continue them with our engine -- half greedy, half at
temperature 0.8, every request seeded -- and store prompt + continuation as fixed-length rows.
Resumable: finished chunks are kept and skipped on rerun.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger("recipe.generations")

PROMPT_TOKENS = 64
NEW_TOKENS = 192
ROW = PROMPT_TOKENS + NEW_TOKENS


def generate_rows(work: Path, target_dir: Path, n_rows: int = 3072, chunk: int = 256, seed: int = 7,
                  name: str = "generations", sampled_every: int = 2) -> Path:
    """Writes work/<name>/rows.u16 ([n_rows, ROW] uint16) and returns its path.

    Every `sampled_every`-th row is sampled at temperature 0.8, the others are greedy (2: half
    and half; 3: two thirds greedy)."""
    if sampled_every < 1:
        raise ValueError(f"sampled_every must be >= 1, got {sampled_every}")
    from tqdm import tqdm

    from engine import LLM, SamplingParams

    out_dir = work / name
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / "rows.u16"
    if final.exists():
        log.info("target generations already written: %s", final)
        return final
    stream = np.memmap(work / "tokens" / "train.u16", dtype=np.uint16, mode="r")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, stream.size - PROMPT_TOKENS - 1, size=n_rows)  # [n_rows]
    llm = LLM(model=str(target_dir), max_seq_len=ROW + 8, max_batch_size=32, dtype="bfloat16")
    bar = tqdm(total=n_rows, desc="target generations", unit="seq")
    parts = []
    for c0 in range(0, n_rows, chunk):
        part = out_dir / f"part{c0 // chunk:04d}.npy"
        if not part.exists():
            prompts = [stream[s:s + PROMPT_TOKENS].astype(np.int64).tolist() for s in starts[c0:c0 + chunk]]
            params = [SamplingParams(temperature=0.8 if (c0 + i) % sampled_every == sampled_every - 1 else 0.0, seed=seed * 100_000 + c0 + i,
                                     max_tokens=NEW_TOKENS, ignore_eos=True) for i in range(len(prompts))]
            outs = llm.generate(prompts, params)
            rows = np.array([o.prompt_token_ids + o.token_ids for o in outs], dtype=np.uint16)  # [chunk, ROW]
            np.save(part.with_suffix(".tmp.npy"), rows)
            part.with_suffix(".tmp.npy").replace(part)
        parts.append(part)
        bar.update(min(chunk, n_rows - c0))
    bar.close()
    rows = np.concatenate([np.load(p) for p in parts])  # [n_rows, ROW]
    rows.tofile(final.with_suffix(".tmp"))
    final.with_suffix(".tmp").replace(final)
    log.info("target generations: %d rows of %d tokens -> %s", rows.shape[0], ROW, final)
    return final


def mixed_batches(work: Path, rows_paths: Path | list[Path], batch: int = 16, generated: int = 12, seq: int = 256):
    """A batch function for train_stage: `generated` rows of target generations (drawn from all
    of `rows_paths`) plus `batch - generated` random corpus windows (so the draft keeps the
    prompt-side distribution)."""
    import torch

    paths = [rows_paths] if isinstance(rows_paths, Path) else list(rows_paths)
    rows = np.concatenate([np.fromfile(p, dtype=np.uint16).reshape(-1, ROW) for p in paths])  # [n_rows, ROW]
    stream = np.memmap(work / "tokens" / "train.u16", dtype=np.uint16, mode="r")

    def draw(rng: np.random.Generator) -> torch.Tensor:
        picked = rows[rng.integers(0, rows.shape[0], size=generated), :seq]  # [generated, seq]
        starts = rng.integers(0, stream.size - seq - 1, size=batch - generated)
        corpus = np.stack([stream[s:s + seq] for s in starts])  # [batch - generated, seq]
        return torch.from_numpy(np.concatenate([picked, corpus]).astype(np.int64))  # [batch, seq]

    return draw
