"""Stages 3 and 4: train the target from scratch, then distill the draft from it.

Both stages use `transformers.LlamaForCausalLM` with bf16 autocast on CPU (float32 where bf16 is slower), random windows of
the uint16 token stream (seeded), AdamW with warmup + cosine decay, and a resumable checkpoint
(model + optimizer + step + data RNG) written atomically every `ckpt_every` seconds.

The draft is trained only to imitate the target: its loss is the forward KL divergence
KL(p_target || q_draft), which is what acceptance rewards -- first on corpus windows, then
("draft_onpolicy", then a second round "draft_onpolicy2") mostly on sequences the target generated itself (see generations.py), the
distribution the draft meets when it proposes at serving time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

log = logging.getLogger("recipe.train")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class StageConfig:
    name: str  # "target" | "draft"
    shape: ModelShape
    steps: int
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 200
    ckpt_every_s: float = 300.0
    seed: int = 0


TARGET = StageConfig(
    name="target",
    shape=ModelShape(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=1408),
    steps=3000,
)
DRAFT = StageConfig(
    name="draft",
    shape=ModelShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=704),
    steps=1000,
    lr=2e-3,
)
# continues DRAFT's weights (fresh optimizer) on target generations mixed with corpus windows
DRAFT_ONPOLICY = StageConfig(name="draft_onpolicy", shape=DRAFT.shape, steps=1500, lr=1e-3, warmup=50)
# a second on-policy round: continues DRAFT_ONPOLICY's weights on fresh target generations
# (new prompts, two thirds greedy), at a lower learning rate
DRAFT_ONPOLICY2 = StageConfig(name="draft_onpolicy2", shape=DRAFT.shape, steps=1200, lr=5e-4, warmup=50, seed=1)


def llama_config(shape: ModelShape, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **asdict(shape),
    )


def _batch(stream: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> torch.Tensor:
    starts = rng.integers(0, stream.size - seq - 1, size=batch)
    rows = np.stack([stream[s:s + seq] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)  # [batch, seq]


def _lr_at(step: int, cfg: StageConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _val_windows(work: Path, seq: int, n: int = 48) -> torch.Tensor:
    stream = np.fromfile(work / "tokens" / "val.u16", dtype=np.uint16)
    rng = np.random.default_rng(1234)
    return _batch(stream, rng, n, seq)  # [n, seq]


@torch.no_grad()
def _eval(model, teacher, windows: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    model.eval()
    losses, agree, kls = [], [], []
    for chunk in windows.split(8):
        with autocast(dtype):
            logits = model(input_ids=chunk).logits.float()  # [b, seq, vocab]
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), chunk[:, 1:].flatten()).item())
        if teacher is not None:
            with autocast(dtype):
                t_logits = teacher(input_ids=chunk).logits.float()
            agree.append((t_logits.argmax(-1) == logits.argmax(-1)).float().mean().item())
            kls.append(F.kl_div(logits.log_softmax(-1), t_logits.log_softmax(-1),
                                log_target=True, reduction="batchmean").item() / chunk.shape[1])
    model.train()
    out = {"val_loss": float(np.mean(losses))}
    if teacher is not None:
        out["val_argmax_agreement"] = float(np.mean(agree))
        out["val_kl"] = float(np.mean(kls))
    return out


def _truncate_log(path: Path, step: int) -> None:
    """Drops log records written after the checkpoint we resume from."""
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines() if json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in keep))


def training_dtype(choice: str) -> torch.dtype:
    """The autocast dtype for training: "bfloat16", "float32", or "auto" (the faster of the two on a
    matmul of training shape, timed here: bf16 is several times faster where the CPU has bf16
    instructions and several times slower where it has only AVX2)."""
    if choice in ("bfloat16", "float32"):
        return getattr(torch, choice)
    if choice != "auto":
        raise ValueError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {choice!r}")
    a, w = torch.randn(1024, 512), torch.randn(1408, 512)  # one MLP projection over a few windows
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), w.to(dtype)
        x @ y.T
        t0 = time.perf_counter()
        for _ in range(3):
            x @ y.T
        best[dtype] = time.perf_counter() - t0
    chosen = min(best, key=best.get)
    log.info("training dtype: %s (matmul %.1f ms float32, %.1f ms bfloat16)", chosen,
             1e3 * best[torch.float32] / 3, 1e3 * best[torch.bfloat16] / 3)
    return chosen


def autocast(dtype: torch.dtype):
    """Autocast to `dtype` on CPU; float32: none."""
    return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)


def apply_update(loss: torch.Tensor, model, opt) -> None:
    """One optimizer step on `loss`, gradients clipped to norm 1."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def resume(ckpt_path: Path, model, opt, rng: np.random.Generator) -> tuple[int, float]:
    """Restores model, optimizer and data RNG from a checkpoint of these training loops; returns
    (step, seconds trained), (0, 0.0) when there is none."""
    if not ckpt_path.exists():
        return 0, 0.0
    state = torch.load(ckpt_path, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    rng.bit_generator.state = state["rng"]
    return state["step"], state["elapsed"]


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


BatchFn = Callable[[np.random.Generator], torch.Tensor]  # rng -> [batch, seq] token ids


def _start(out: Path, cfg: StageConfig, tokenizer, init_from: Path | None):
    """A new model (seeded, or `init_from`'s weights), its optimizer and data RNG, restored from the
    stage's checkpoint when there is one; also the step and seconds trained so far."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg.shape, tokenizer))
    if init_from is not None:
        model.load_state_dict(LlamaForCausalLM.from_pretrained(init_from, dtype=torch.float32).state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay, fused=True)
    rng = np.random.default_rng(cfg.seed)
    step, elapsed = resume(out / "ckpt.pt", model, opt, rng)
    if step:
        log.info("%s: resumed at step %d (%.0f s trained)", cfg.name, step, elapsed)
        _truncate_log(out / "log.jsonl", step)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("%s: %.2fM parameters, %d steps of %d x %d tokens", cfg.name, n_params / 1e6,
             cfg.steps, cfg.batch_size, cfg.seq_len)
    return model, opt, rng, step, elapsed


def _loss(model, teacher, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Next-token cross-entropy on `ids` without a teacher, else KL(teacher || model) per position."""
    with autocast(dtype):
        logits = model(input_ids=ids).logits  # [batch, seq, vocab]
        if teacher is None:
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        with torch.no_grad():
            t_logp = teacher(input_ids=ids).logits.float().log_softmax(-1)
        return F.kl_div(logits.float().log_softmax(-1).flatten(0, 1), t_logp.flatten(0, 1),
                        log_target=True, reduction="batchmean")


def train_stage(work: Path, cfg: StageConfig, tokenizer, teacher=None, init_from: Path | None = None,
                batches: BatchFn | None = None):
    """Trains (or resumes) one stage; returns the trained model (float32, eval mode).

    `init_from`: an HF directory whose weights start the stage (else random init).
    `batches`: draws one training batch (else random windows of the corpus)."""
    from transformers import LlamaForCausalLM

    out = work / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    final = out / "final"
    if (final / "config.json").exists():
        log.info("%s already trained: %s", cfg.name, final)
        return LlamaForCausalLM.from_pretrained(final, dtype=torch.float32).eval()

    model, opt, rng, step, elapsed = _start(out, cfg, tokenizer, init_from)
    ckpt_path = out / "ckpt.pt"
    stream = np.memmap(work / "tokens" / "train.u16", dtype=np.uint16, mode="r")
    windows = _val_windows(work, cfg.seq_len)
    log_path = out / "log.jsonl"
    dtype = training_dtype("auto")
    last_ckpt = time.monotonic()
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {cfg.name}", unit="step")
    while step < cfg.steps:
        t0 = time.monotonic()
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        ids = batches(rng) if batches else _batch(stream, rng, cfg.batch_size, cfg.seq_len)  # [batch, seq]
        loss = _loss(model, teacher, ids, dtype)
        apply_update(loss, model, opt)
        step += 1
        elapsed += time.monotonic() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        record = {"step": step, "loss": loss.item(), "lr": _lr_at(step - 1, cfg),
                  "tokens": step * cfg.batch_size * cfg.seq_len, "elapsed_s": round(elapsed, 1)}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record.update(_eval(model, teacher, windows, dtype))
            log.info("%s step %d: %s", cfg.name, step, record)
        with open(log_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if time.monotonic() - last_ckpt > cfg.ckpt_every_s or step == cfg.steps:
            _save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                          "elapsed": elapsed, "rng": rng.bit_generator.state}, ckpt_path)
            last_ckpt = time.monotonic()
    bar.close()
    model.save_pretrained(final)
    return model.eval()
