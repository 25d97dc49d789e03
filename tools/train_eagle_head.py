"""Train an EAGLE-3 head for the shipped target and write it to models/eagle3 (published layout).

The shipped head is these seven commands in turn (each resumable; nohup ... > eagle.log 2>&1 &):

    python tools/train_eagle_head.py --aux-layers 2,4,5                  # 750 steps, ~50 min on 2 cores
    python tools/train_eagle_head.py --aux-layers 2,4,5 --steps 1500     # resumed, the schedule stretched
    python tools/train_eagle_head.py --aux-layers 2,4,5 --steps 2250     # (~50 min each)
    python tools/train_eagle_head.py --run eagle3-r2 --init-from models/eagle3 --steps 300
    python tools/train_eagle_head.py --run eagle3-r3 --init-from models/eagle3 --steps 1200 \
        --lr 5e-4 --extra-generations 2048 --generated-per-batch 6    # ~90 min
    python tools/train_eagle_head.py --run eagle3-r4 --init-from models/eagle3 --steps 1800 \
        --lr 3e-4 --draft-vocab 4096 --extra-generations 2048 --generated-per-batch 6   # ~80 min
    python tools/train_eagle_head.py --run eagle3-r6 --init-from models/eagle3 --steps 800 \
        --lr 4e-4 --draft-vocab 4096 --generations 0 --more-generations 2048 --generated-per-batch 6

Run 1 reads EAGLE-3's own choice of layers (2, L/2, L-3); runs 2 and 3 start from the exported
head and read layers 1, L/2 and L-1 (the default; why: recipe_aux_layers), fc's three slices
taken in order. Run 3 adds 2,048 sequences the target wrote (two thirds greedy) and takes 6 of
each 8 windows from the target's writing. Run 4 keeps the output rows of the 4,096 most frequent
ids (95% of the training tokens; EAGLE-3's Llama heads keep 32k of 128k): each drafting step reads
27% fewer weights. On resuming a run, the learning rate rises again and agreement dips for
~100 steps before it passes where it was. Run 6 (72 min on an AVX2-only CPU, in float32: --dtype
auto times both) learns from 2,048 more sequences the target wrote (other new prompts) alone;
run 5 (more steps on run 3's data) lowered α and was not shipped, nor was run 7 (650 steps from
run 6 on 2,048 sequences of yet other prompts, --generations 0 --generated-set 59:2048): α
0.867 -> 0.862 and 0.863 -> 0.864 (`python -m bench alpha`, 8 and 48 prompts), a plateau. Run 8
(--draft-vocab 6144 from run 6, on run 7's data: wider_vocabulary) read α 0.853 and 0.876 with a
19% dearer step, not shipped, nor run 9 (--draft-vocab 5120: 0.865 and 0.873; batch 1 K = 5 at
par, adaptive 0.93x) (docs/performance-notes.md, "where its rejections fall").

Data: corpus windows and sequences the target wrote itself (on-policy, as for the draft), the
target's features (inputs of the --aux-layers) and its distributions computed on the fly with
transformers' LlamaForCausalLM. Loss: cross-entropy of the head's distribution against the
target's (restricted to the draft vocabulary) at every step of a training-time-test rollout,
later steps weighted less. Needs the corpus and tokens of tools/make_default_pair.py in --work.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pair.eagle_head import (  # noqa: E402
    TrainableEagle3Head,
    chosen_layers,
    cosine_lr,
    exported_vocabulary,
    load_exported,
    step_weights,
    wider_vocabulary,
)
from pair.generations import generate_rows, mixed_batches  # noqa: E402
from pair.train import apply_update, autocast, resume, training_dtype  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("recipe.eagle")


def by_frequency(stream: np.ndarray, rows: np.ndarray, vocab: int, eos: int) -> tuple[torch.Tensor, np.ndarray]:
    """Target ids, most frequent in the training text first (EOS first of all), and the counts [vocab]."""
    counts = np.bincount(stream, minlength=vocab) + np.bincount(rows, minlength=vocab)  # [vocab]
    counts[eos] = counts.max() + 1
    return torch.from_numpy(np.argsort(-counts, kind="stable").astype(np.int64)), counts


def draft_vocabulary(stream: np.ndarray, rows: np.ndarray, vocab: int, size: int, eos: int,
                     exported: torch.Tensor | None) -> torch.Tensor:
    """d2t, sorted: an exported head's own vocabulary when `size` is its size; all of it and the
    most frequent others when larger; else (a fresh head, or a smaller vocabulary) the `size` most
    frequent token ids of the training text (EOS always in)."""
    if exported is not None and size == len(exported):
        return exported
    order, counts = by_frequency(stream, rows, vocab, eos)
    wider = exported is not None and size > len(exported)
    top = wider_vocabulary(exported, order, size) if wider else order[:size].sort().values
    covered = counts[top.numpy()].sum() / counts.sum()
    log.info("draft vocabulary: %d ids cover %.2f%% of training tokens", size, 100 * covered)
    return top


def target_pass(target, ids: torch.Tensor, aux: list[int], dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """features [B, W, 3H] (inputs of the aux layers), embeddings [B, W, H], logits [B, W, V]."""
    with torch.no_grad(), autocast(dtype):
        out = target(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states  # hs[i]: the input of layer i
    return torch.cat([hs[i] for i in aux], dim=-1).float(), hs[0].float(), out.logits.float()


def rollout_loss(head, feats, embeds, logits, d2t, steps, weights, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, list[float], list[float]]:
    """Weighted loss over the rollout, and per step the argmax agreement with the target and the
    expected acceptance sum(min(p, q)) at temperature 1."""
    T = feats.shape[1] - steps
    with autocast(dtype):
        outs = head.rollout(feats[:, :T], embeds[:, 1:], steps)
    loss = feats.new_zeros(())
    agree, accept = [], []
    for s, (logit_d, w) in enumerate(zip(outs, weights)):
        t_logits = logits[:, s + 1:s + 1 + T]  # [B, T, V]: the target's distribution of token i + s + 2
        p_d = t_logits[..., d2t].softmax(-1)  # [B, T, Vd]
        logq = logit_d.float().log_softmax(-1)
        loss = loss + w * -(p_d * logq).sum(-1).mean()
        with torch.no_grad():
            agree.append((d2t[logit_d.argmax(-1)] == t_logits.argmax(-1)).float().mean().item())
            p_full = t_logits.softmax(-1)
            accept.append(torch.minimum(p_full[..., d2t], logq.exp()).sum(-1).mean().item())
    return loss / steps, agree, accept


def generated_set(value: str) -> tuple[int, int]:
    """--generated-set SEED:ROWS -> (seed, rows)."""
    seed, sep, rows = value.partition(":")
    if not sep or not seed.isdigit() or not rows.isdigit() or int(rows) < 1:
        raise argparse.ArgumentTypeError(f"--generated-set wants SEED:ROWS (two integers, ROWS >= 1), got {value!r}")
    return int(seed), int(rows)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "specserve-recipe")
    ap.add_argument("--target", type=Path, default=REPO / "models" / "target")
    ap.add_argument("--out", type=Path, default=REPO / "models" / "eagle3")
    ap.add_argument("--steps", type=int, default=750)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--generations", type=int, default=512, help="target-written rows (0: corpus only)")
    ap.add_argument("--extra-generations", type=int, default=0,
                    help="rows of a second target-written set (new prompts, two thirds greedy)")
    ap.add_argument("--more-generations", type=int, default=0,
                    help="rows of a third target-written set (other new prompts, two thirds greedy)")
    ap.add_argument("--generated-set", type=generated_set, action="append", default=[], metavar="SEED:ROWS",
                    help="another target-written set: ROWS rows from prompts drawn with SEED (two thirds greedy); "
                    "repeatable")
    ap.add_argument("--generated-per-batch", type=int, default=None, help="rows of a batch the target wrote "
                    "(default: half the batch)")
    ap.add_argument("--run", default="eagle3", help="checkpoint and log folder under --work (one per run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="autocast dtype (auto: the faster on this CPU, timed at start)")
    ap.add_argument("--aux-layers", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="target layers whose inputs the head reads, e.g. 1,4,7 (default: recipe_aux_layers)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start a new run from an exported head's weights (fc slices taken in order: low, mid, high)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (and export) after this long")
    return ap


def target_written(args) -> tuple[list[Path], np.ndarray]:
    """The target-written sets the options ask for (generated on first use): their files and all
    their tokens as one stream."""
    sets = [(args.generations, 23, "generations_eagle", 2),  # (rows, seed, folder, sampled_every)
            (args.extra_generations, 31, "generations_eagle2", 3),
            (args.more_generations, 47, "generations_eagle3", 3),
            *((n, seed, f"generations_seed{seed}", 3) for seed, n in args.generated_set)]
    written = [generate_rows(args.work, args.target, n_rows=n, seed=seed, name=name, sampled_every=every)
               for n, seed, name, every in sets if n]
    torch.set_num_threads(args.threads)
    rows = np.concatenate([np.fromfile(p, dtype=np.uint16) for p in written]) if written else np.zeros(0, np.uint16)
    return written, rows


def validation_windows(work: Path, window: int) -> torch.Tensor:
    """16 fixed windows of the validation tokens [16, window] (seed 99)."""
    val_stream = np.fromfile(work / "tokens" / "val.u16", dtype=np.uint16)
    vrng = np.random.default_rng(99)
    return torch.from_numpy(np.stack([val_stream[s:s + window] for s in
                                      vrng.integers(0, val_stream.size - window, 16)]).astype(np.int64))


def load_models(target_dir: Path, target_cfg: dict, draft_vocab: int, d2t: torch.Tensor) -> tuple:
    """The target (float32, eval) and a new head of the target's shape, warm-started from it."""
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    H = target_cfg["hidden_size"]
    head = TrainableEagle3Head(H, target_cfg["intermediate_size"], target_cfg["num_attention_heads"],
                               target_cfg["num_key_value_heads"], target_cfg.get("head_dim") or H // target_cfg["num_attention_heads"],
                               draft_vocab, H, target_cfg["rms_norm_eps"],
                               (target_cfg.get("rope_parameters") or target_cfg).get("rope_theta", 10000.0))
    with torch.no_grad():  # warm start: the target's own output layer and final norm (the head predicts into its space)
        head.lm_head.weight.copy_(target.lm_head.weight[d2t])
        head.norm.copy_(target.model.norm.weight)
    return target, head


@dataclass
class Training:
    """What the training loop reads: the models, optimizer, data and where the run's files go."""
    target: object
    head: TrainableEagle3Head
    opt: torch.optim.Optimizer
    rng: np.random.Generator
    aux: list[int]
    d2t: torch.Tensor
    target_cfg: dict
    stream: np.ndarray
    batches: object  # mixed_batches' draw (rng -> ids), or None: corpus windows only
    val: torch.Tensor
    weights: list[float]
    dtype: torch.dtype
    ckpt: Path
    log_path: Path


def train_step(run: Training, args, step: int) -> tuple[torch.Tensor, list[float], list[float]]:
    """One optimizer step on a fresh batch at step's learning rate: the loss, agreement, acceptance."""
    for g in run.opt.param_groups:
        g["lr"] = cosine_lr(step, args.steps, args.lr, 50)
    if run.batches is not None:
        ids = run.batches(run.rng)
    else:
        starts = run.rng.integers(0, run.stream.size - args.seq - 1, args.batch)
        ids = torch.from_numpy(np.stack([run.stream[s:s + args.seq] for s in starts]).astype(np.int64))
    feats, embeds, logits = target_pass(run.target, ids, run.aux, run.dtype)
    loss, agree, accept = rollout_loss(run.head, feats, embeds, logits, run.d2t, args.ttt_steps, run.weights, run.dtype)
    apply_update(loss, run.head, run.opt)
    return loss, agree, accept


def validate(run: Training, ttt_steps: int, step: int) -> dict:
    """The head's agreement and expected acceptance by rollout step on the validation windows (logged)."""
    with torch.no_grad():
        vf, ve, vl = target_pass(run.target, run.val, run.aux, run.dtype)
        _, vagree, vaccept = rollout_loss(run.head, vf, ve, vl, run.d2t, ttt_steps, run.weights, run.dtype)
    log.info("step %d: val argmax agreement by step %s, expected acceptance %s", step,
             [round(a, 3) for a in vagree], [round(a, 3) for a in vaccept])
    return {"val_agree": vagree, "val_accept": vaccept}


def save_checkpoint(run: Training, step: int, elapsed: float) -> None:
    """Head, optimizer, step, time trained, layers, vocabulary and data RNG, written atomically."""
    tmp = run.ckpt.with_suffix(".tmp")
    torch.save({"model": run.head.state_dict(), "opt": run.opt.state_dict(), "step": step, "elapsed": elapsed,
                "aux": run.aux, "d2t": run.d2t,
                "rng": run.rng.bit_generator.state}, tmp)
    tmp.replace(run.ckpt)


def train(run: Training, args, step: int, elapsed: float) -> None:
    """Trains from `step` to --steps (or for --max-minutes), a log record every step, validation every
    100 steps, a checkpoint and an export every 5 minutes and at the end."""
    from tqdm import tqdm

    last_ckpt, started = time.monotonic(), time.monotonic()
    bar = tqdm(total=args.steps, initial=step, desc="train eagle3 head", unit="step")
    while step < args.steps:
        t0 = time.monotonic()
        loss, agree, accept = train_step(run, args, step)
        step += 1
        elapsed += time.monotonic() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", agree1=f"{agree[0]:.3f}")
        record = {"step": step, "loss": loss.item(), "agree": agree, "accept": accept, "elapsed_s": round(elapsed, 1)}
        if step % 100 == 0 or step == args.steps:
            record.update(validate(run, args.ttt_steps, step))
        with open(run.log_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        out_of_time = args.max_minutes is not None and time.monotonic() - started > 60 * args.max_minutes
        if time.monotonic() - last_ckpt > 300 or step == args.steps or out_of_time:
            save_checkpoint(run, step, elapsed)
            last_ckpt = time.monotonic()
            run.head.export(args.out, run.d2t, run.target_cfg["vocab_size"], run.target_cfg, run.aux)
        if out_of_time:
            log.info("stopping at step %d after %.0f min (--max-minutes)", step, args.max_minutes)
            break
    bar.close()


def main() -> None:
    args = _parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    work = args.work / args.run
    work.mkdir(parents=True, exist_ok=True)
    target_cfg = json.loads((args.target / "config.json").read_text())
    ckpt = work / "ckpt.pt"
    saved = torch.load(ckpt, weights_only=False) if ckpt.exists() else {}  # a run resumes on its own layers and vocabulary
    aux = chosen_layers(args.aux_layers, target_cfg["num_hidden_layers"], saved.get("aux"))
    stream = np.memmap(args.work / "tokens" / "train.u16", dtype=np.uint16, mode="r")
    written, rows = target_written(args)
    exported = exported_vocabulary(args.init_from) if args.init_from else None
    d2t = saved["d2t"] if "d2t" in saved else draft_vocabulary(
        np.asarray(stream), rows, target_cfg["vocab_size"], args.draft_vocab, target_cfg["eos_token_id"], exported)
    window = args.seq  # chains: the first seq - ttt_steps positions
    generated = args.batch // 2 if args.generated_per_batch is None else args.generated_per_batch
    batches = mixed_batches(args.work, written, batch=args.batch, generated=generated, seq=window) if written else None
    val = validation_windows(args.work, window)
    target, head = load_models(args.target, target_cfg, args.draft_vocab, d2t)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    rng = np.random.default_rng(5)
    step, elapsed = resume(ckpt, head, opt, rng)
    if not step and args.init_from:
        load_exported(head, args.init_from, d2t)
        log.info("weights from %s", args.init_from)
    if step:
        log.info("resumed at step %d (%.0f s trained)", step, elapsed)
    log.info("head: %.2fM parameters; aux layers %s; %d steps of %d x %d, rollout %d", sum(
        p.numel() for p in head.parameters()) / 1e6, aux, args.steps, args.batch, args.seq, args.ttt_steps)
    run = Training(target, head, opt, rng, aux, d2t, target_cfg, stream, batches, val, step_weights(args.ttt_steps),
                   training_dtype(args.dtype), ckpt, work / "log.jsonl")
    train(run, args, step, elapsed)
    head.export(args.out, d2t, target_cfg["vocab_size"], target_cfg, aux)
    log.info("exported %s", args.out)


if __name__ == "__main__":
    main()
