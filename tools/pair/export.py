"""Stage 5: write both checkpoints to models/ in HF format (bf16 safetensors + tokenizer)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

log = logging.getLogger("recipe.export")


def export_model(model, tokenizer, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(model).to(torch.bfloat16)  # the caller's model stays as it is
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    log.info("exported %s (%.1f MiB)", out, size)
