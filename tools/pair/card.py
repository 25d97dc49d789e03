"""Stage 6: measure the exported pair with our engine and write the model card (models/README.md)."""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

log = logging.getLogger("recipe.card")

TIMING_REPEATS = 15  # c is a ratio of two timings on a shared, noisy host: more runs, steadier median


def _read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


DRAFT_STAGES = (("draft", "corpus"), ("draft_onpolicy", "on-policy"), ("draft_onpolicy2", "on-policy 2"))


def draft_log(work: Path) -> list[dict]:
    """The draft's stages as one log: corpus distillation, then two on-policy rounds (steps, tokens
    and time continue from stage to stage; each record says its stage)."""
    out: list[dict] = []
    end = {"step": 0, "tokens": 0, "elapsed_s": 0.0}
    for directory, stage in DRAFT_STAGES:
        rows = [{**r, "stage": stage, "step": r["step"] + end["step"], "tokens": r["tokens"] + end["tokens"],
                 "elapsed_s": r["elapsed_s"] + end["elapsed_s"]} for r in _read_log(work / directory / "log.jsonl")]
        out += rows
        if rows:
            end = rows[-1]
    return out


def plot_losses(work: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stage, ylabel in ((axes[0], "target", "cross-entropy (nats/token)"),
                              (axes[1], "draft", "KL(target || draft) (nats/token)")):
        rows = draft_log(work) if stage == "draft" else _read_log(work / stage / "log.jsonl")
        if not rows:
            continue
        for stage_name in ("on-policy", "on-policy 2"):
            switch = next((r["tokens"] / 1e6 for r in rows if r.get("stage") == stage_name), None)
            if switch is not None:
                ax.axvline(switch, color="gray", ls=":", lw=1)
                ax.text(switch, ax.get_ylim()[1], f" {stage_name}\n (target generations)", va="top", fontsize=8)
        tokens = [r["tokens"] / 1e6 for r in rows]
        losses = [r["loss"] for r in rows]
        window = 25
        smooth = [statistics.fmean(losses[max(0, i - window):i + 1]) for i in range(len(losses))]
        ax.plot(tokens, smooth, label="train (25-step mean)")
        val = [(r["tokens"] / 1e6, r["val_kl"] if stage == "draft" else r["val_loss"]) for r in rows
               if ("val_kl" if stage == "draft" else "val_loss") in r]
        if val:
            ax.plot(*zip(*val), "o-", label="validation")
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel(ylabel)
        ax.set_title(stage)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def _decode_seconds_per_token(model, tokens: int = 128) -> float:
    """One sequence decoded token by token through our forward and KV pool (growing context,
    no engine bookkeeping): seconds per token."""
    from engine.model.passes import forward_chunks, pool_for

    s = model.shape
    pool = pool_for(model, 1, tokens + 16)
    slot, _ = pool.allocate_slot([])
    forward_chunks(model, pool, [slot], [list(range(1, 9))], [0])  # an 8-token prompt
    t0 = time.perf_counter()
    for i in range(tokens):
        forward_chunks(model, pool, [slot], [[(7 * i) % s.vocab_size]], [8 + i])
    return (time.perf_counter() - t0) / tokens


def measure(models: Path, prompts: list[str], threads: int = 2) -> dict:
    """Acceptance (greedy, K = 5, 96 new tokens) and cost coefficient c with our engine.

    c = draft forward time per token / target forward time per token, batch 1, each model on
    the engine's forward plan for this host, decoding 128 tokens through our forward and KV pool;
    the two are timed interleaved in one loop (medians of TIMING_REPEATS)."""
    import torch

    from engine import LLM, SamplingParams
    from engine.model.plan import host_info, summary

    torch.set_num_threads(threads)
    spec = LLM(model=str(models / "target"), draft_model=str(models / "draft"), use_speculative_decoding=True,
               speculative_method="draft", spec_policy="fixed", spec_length=5, max_seq_len=512)
    outs = spec.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    rejections = sum(a < k for o in outs for a, k in zip(o.accepted_per_round, o.proposed_per_round))
    timed = {"target": spec.engine.model, "draft": spec.engine.draft_model}
    times: dict[str, list[float]] = {name: [] for name in timed}
    for model in timed.values():
        _decode_seconds_per_token(model, 16)  # warm-up
    for _ in range(TIMING_REPEATS):  # interleaved: target, draft, target, ...
        for name, model in timed.items():
            times[name].append(_decode_seconds_per_token(model))
    ratios = [d / t for d, t in zip(times["draft"], times["target"])]  # one per interleaved run
    plan = summary(spec.engine.forward_plan)
    return {"alpha_greedy_k5": accepted / drafted, "alpha_per_token": accepted / (accepted + rejections),
            "drafted": drafted, "accepted": accepted, "prompts": len(prompts), "threads": threads,
            "torch": torch.__version__, "cpu": host_info()["cpu"], "cpu_flags": host_info()["flags"],
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "forward_plan": plan,
            "target_ms_per_token": statistics.median(times["target"]) * 1e3,
            "draft_ms_per_token": statistics.median(times["draft"]) * 1e3,
            "c": statistics.median(times["draft"]) / statistics.median(times["target"]),
            "c_min": min(ratios), "c_max": max(ratios)}


def greedy_samples(models: Path, prompts: list[str], n: int = 3) -> list[tuple[str, str]]:
    from engine import LLM, SamplingParams

    llm = LLM(model=str(models / "target"), max_seq_len=512)
    outs = llm.generate(prompts[:n], SamplingParams(temperature=0.0, max_tokens=96))
    return [(p, o.text) for p, o in zip(prompts, outs)]


def measure_and_save(models: Path, prompts: list[str]) -> dict:
    """The figures, also written to models/measurements.json."""
    figures = measure(models, prompts)
    (models / "measurements.json").write_text(json.dumps(figures, indent=2))
    return figures


def _theory(f: dict, k: int = 5) -> float:
    """Expected speedup (Leviathan et al., Thm 3.8) from a figure's per-token alpha and c."""
    from engine.speculative.policy.k_choice import expected_tokens

    return expected_tokens(f["alpha_per_token"], k) / (k * f["c"] + 1)


def figures_section(f: dict) -> list[str]:
    """The model card's '## Speculation figures' section (ends with a blank line)."""
    from engine.model.plan import label

    plan = ", ".join(f"{role}: {label(p)}" for role, p in f["forward_plan"].items())
    flags = [x for x in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if x in f.get("cpu_flags", [])]
    return [f"## Speculation figures (our engine, this machine: {f['cpu']} [{', '.join(flags)}], 2 cores; "
            f"forward plan {plan})",
            "", f"K = 5, greedy, 96 new tokens, {f['prompts']} validation prompts (first lines of a function or "
            "class). α is the per-token acceptance rate (accepted ÷ (accepted + rejections), the paper's α); "
            "accepted ÷ proposed counts every proposed token, including those after a rejection. c = draft "
            "forward time per token ÷ target forward time per token, batch 1, each decoding 128 tokens through "
            f"our forward and KV pool on the engine's forward plan (medians of {TIMING_REPEATS} interleaved runs).",
            "", "| α (per token) | accepted ÷ proposed | draft ms/token | target ms/token | c | c, range over runs | "
            "Thm 3.8 at K = 5 |", "| --- | --- | --- | --- | --- | --- | --- |",
            f"| {f['alpha_per_token']:.3f} | {f['alpha_greedy_k5']:.3f} ({f['accepted']} of {f['drafted']}) | "
            f"{f['draft_ms_per_token']:.3f} | {f['target_ms_per_token']:.3f} | {f['c']:.3f} | {f['c_min']:.3f} to "
            f"{f['c_max']:.3f} | {_theory(f):.2f}x |", "",
            "c depends on the host and on the forward plan the engine measures there (see "
            "docs/deployment/cpus.md, \"The forward plan\"); α does not depend on the host beyond rounding.", "",
            "Measured by `tools/pair/card.py` (raw numbers in `measurements.json`; "
            "`python tools/pair/card.py` re-measures and rewrites this section).", ""]


def remeasure(models: Path, prompts_jsonl: Path) -> dict:
    """Re-measures the shipped pair and rewrites only the card's figures section."""
    texts = [json.loads(line)["prompt"] for line in prompts_jsonl.read_text().splitlines()]
    figures = measure_and_save(models, texts)
    card = models / "README.md"
    text = card.read_text()
    start, end = text.index("## Speculation figures"), text.index("## Training data")
    card.write_text(text[:start] + "\n".join(figures_section(figures)) + "\n" + text[end:])
    return figures


def _param_count(path: Path) -> int:
    """The parameters in a safetensors file, from its tensors' shapes."""
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                   else int(torch.tensor(f.get_slice(k).get_shape()).prod()) for k in f.keys())


def _stage_rows(models: Path, logs: dict[str, list[dict]]) -> list[tuple]:
    """Per exported model (target, draft): its name, config, parameters, last log record and last
    validation record."""
    from transformers import AutoConfig

    rows = []
    for stage in ("target", "draft"):
        cfg = AutoConfig.from_pretrained(models / stage)
        params = _param_count(models / stage / "model.safetensors")
        last = logs[stage][-1] if logs[stage] else {"tokens": 0, "elapsed_s": 0}
        vals = [r for r in logs[stage] if "val_loss" in r]
        rows.append((stage, cfg, params, last, vals[-1] if vals else {}))
    return rows


def _architecture_lines(rows: list[tuple]) -> list[str]:
    """The card's opening (what the pair is, how to reproduce it) and its architecture table."""
    lines = ["# The embedded default model pair", "",
             "Two Llama-architecture models trained from scratch on this repository's recipe, for Python code",
             "completion: a **target** and a much smaller **draft** distilled to imitate it. Same tokenizer",
             "(byte-level BPE, 8,192 tokens). Both load unmodified with `transformers.AutoModelForCausalLM` /",
             "`AutoTokenizer`. The target is what `LLM()` and `serve_config.yaml` serve by default.", "",
             "An EAGLE-3 head for the target, in the published EAGLE-3 layout, lives in `eagle3/` with its own card",
             "(`eagle3/README.md`; `speculative_method: eagle` with `draft_model: embedded:eagle3`): it is the",
             "default proposer. The draft model is used where `speculative_method: draft` is asked for.", "",
             "Reproduce everything (about 3 hours on 2 CPU cores; resumable):", "",
             "```bash", "python tools/make_default_pair.py   # corpus -> tokenizer -> target -> draft (3 stages) -> export -> card",
             "```", "", "## Architecture", "",
             "| model | parameters | hidden | layers | heads (kv) | MLP | tied embeddings | tokens seen | train time | validation loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for stage, cfg, params, last, val in rows:
        lines.append(f"| {stage} | {params / 1e6:.2f} M | {cfg.hidden_size} | {cfg.num_hidden_layers} | "
                     f"{cfg.num_attention_heads} ({cfg.num_key_value_heads}) | {cfg.intermediate_size} | "
                     f"{cfg.tie_word_embeddings} | {last['tokens'] / 1e6:.1f} M | {last['elapsed_s'] / 60:.0f} min | "
                     f"{val.get('val_loss', float('nan')):.3f} |")
    return lines


def _draft_lines(draft_log_rows: list[dict], dv: dict) -> list[str]:
    """How the draft was trained and how far it agrees with the target (dv: its last validation
    record), then the loss curves."""
    corpus_tokens = max((r["tokens"] for r in draft_log_rows if r["stage"] == "corpus"), default=0)
    return ["", "Validation loss is cross-entropy in nats per token on held-out files. The draft was trained only",
            "on the target's output distributions (forward KL(target || draft)), in three stages: first on corpus",
            f"windows ({corpus_tokens / 1e6:.1f} M tokens), then *on-policy* on 3,072 sequences the target wrote "
            "itself (64-token training-set prompts continued for 192 tokens, half greedy, half at temperature 0.8)",
            "mixed 3:1 with corpus windows -- the text the draft has to predict when it proposes at serving time --",
            "then a second on-policy round on 2,048 fresh sequences (new prompts, two thirds greedy) at half the",
            "learning rate.",
            f"On validation corpus windows its argmax agrees with the target's on "
            f"{dv.get('val_argmax_agreement', float('nan')):.1%} of positions "
            f"(KL {dv.get('val_kl', float('nan')):.3f} nats/token).", "",
            "![loss curves](loss_curves.png)", ""]


def _data_lines(manifest: dict, counts: dict[str, int], samples: list[tuple[str, str]]) -> list[str]:
    """The training data (sources, sizes, licenses), greedy samples of the target and its limits."""
    lines = ["## Training data", "",
             f"Python source from {len(manifest['packages'])} pinned PyPI packages plus the standard library of "
             f"{manifest['stdlib']}; files deduplicated by content ({manifest['duplicates_dropped']} dropped) and "
             "split into train / validation by a stable hash of their path (2% validation).", "",
             f"- train: {manifest['files']['train']} files, {manifest['bytes']['train'] / 1e6:.1f} MB, "
             f"{counts['train'] / 1e6:.1f} M tokens", f"- validation: {manifest['files']['val']} files, "
             f"{manifest['bytes']['val'] / 1e6:.1f} MB, {counts['val'] / 1e6:.2f} M tokens", "",
             "| source | version | license |", "| --- | --- | --- |"]
    lines += [f"| {p['name']} | {p['version']} | {p['license']} |" for p in manifest["packages"]]
    lines += [f"| CPython standard library | {manifest['stdlib'].split()[1]} | PSF-2.0 |", "",
              "The corpus itself is not shipped; `tools/make_default_pair.py` rebuilds it from PyPI.", "",
              "## Greedy completions of validation prompts (target alone)", ""]
    for prompt, text in samples:
        lines += ["```python", prompt + text, "```", ""]
    lines += ["## Limits", "", "A ~28M-parameter model trained for about an hour and a half on ~12M tokens: it writes",
              "plausible-looking Python with repeated idioms, not correct programs. It exists to make speculative",
              "decoding measurable offline; point `model`/`draft_model` at real checkpoints for real use.", ""]
    return lines


def write_card(work: Path, models: Path, prompts: list[dict]) -> dict:
    """Measures the exported pair, plots the losses and writes the model card (models/README.md)."""
    plot_losses(work, models / "loss_curves.png")
    texts = [p["prompt"] for p in prompts]
    figures = measure_and_save(models, texts)
    samples = greedy_samples(models, texts)
    manifest = json.loads((work / "corpus" / "manifest.json").read_text())
    counts = {s: (work / "tokens" / f"{s}.u16").stat().st_size // 2 for s in ("train", "val")}
    logs = {"target": _read_log(work / "target" / "log.jsonl"), "draft": draft_log(work)}
    rows = _stage_rows(models, logs)
    lines = [*_architecture_lines(rows), *_draft_lines(logs["draft"], rows[1][4]), *figures_section(figures),
             *_data_lines(manifest, counts, samples)]
    (models / "README.md").write_text("\n".join(lines))
    log.info("model card written: %s", models / "README.md")
    return figures


if __name__ == "__main__":
    import argparse
    import sys

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo))
    ap = argparse.ArgumentParser(description="Re-measure the shipped pair's speculation figures and "
                                             "rewrite that section of models/README.md.")
    ap.add_argument("--models", type=Path, default=repo / "models")
    ap.add_argument("--prompts", type=Path, default=repo / "bench" / "data" / "code_val_prompts.jsonl")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(remeasure(args.models, args.prompts), indent=2))
