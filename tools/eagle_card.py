"""Measure the shipped EAGLE-3 head beside the shipped draft model and write models/eagle3/README.md.

    python tools/eagle_card.py            # ~5 min on 2 CPU cores

For each proposer and K = 1..8 (fixed K, greedy, 96 new tokens, the held-out validation prompts
of bench/data/code_val_prompts.jsonl, all in one batch: acceptance does not depend on batching
under greedy decoding): per-token α (accepted / (accepted + rejections)), acceptance at each
draft position (rounds whose j-th proposal was accepted / rounds that proposed a j-th token),
tokens per round, and Leviathan et al.'s Thm 3.8 bound with the proposer's c; c itself is timed
batch 1, target and proposer interleaved (tools/pair/card.py's method). Plus the training curves
from the recipe's log (tools/train_eagle_head.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pair.card import TIMING_REPEATS, _decode_seconds_per_token  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KS = range(1, 9)


def acceptance_by_k(llm, prompts: list[str]) -> dict[int, dict]:
    from engine import SamplingParams

    out = {}
    for k in KS:
        llm.engine.reconfigure_speculation(spec_policy="fixed", spec_length=k)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
        rounds = [(a, p) for o in outs for a, p in zip(o.accepted_per_round, o.proposed_per_round)]
        accepted = sum(a for a, _ in rounds)
        rejections = sum(a < p for a, p in rounds)
        by_position = [sum(a > j for a, p in rounds if p > j) / max(1, sum(p > j for _, p in rounds)) for j in range(k)]
        out[k] = {"alpha_per_token": accepted / max(1, accepted + rejections), "by_position": by_position,
                  "tokens_per_round": (accepted + len(rounds)) / max(1, len(rounds)), "rounds": len(rounds)}
    return out


def measure(models: Path, prompts: list[str]) -> dict:
    import torch

    from engine import LLM
    from engine.model.plan import host_info

    torch.set_num_threads(2)
    engines = {name: LLM(model=str(models / "target"), draft_model=str(models / name), use_speculative_decoding=True,
                         speculative_method=method, max_seq_len=512, max_batch_size=len(prompts),
                         enable_prefix_caching=False)  # each K decodes the prompts afresh
               for name, method in (("draft", "draft"), ("eagle3", "eagle"))}
    timed = {"target": engines["draft"].engine.model, "draft": engines["draft"].engine.draft_model,
             "eagle3": engines["eagle3"].engine.draft_model}
    for model in timed.values():
        _decode_seconds_per_token(model, 16)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in timed}
    for _ in range(TIMING_REPEATS):  # interleaved
        for name, model in timed.items():
            times[name].append(_decode_seconds_per_token(model))
    target_ms = statistics.median(times["target"]) * 1e3
    figures = {"cpu": host_info()["cpu"], "cpu_flags": host_info()["flags"], "torch": torch.__version__,
               "prompts": len(prompts), "target_ms_per_token": target_ms,
               "forward_plan": engines["eagle3"].engine.forward_plan}
    for name, llm in engines.items():
        ms = statistics.median(times[name]) * 1e3
        figures[name] = {"ms_per_token": ms, "c": ms / target_ms, "by_k": acceptance_by_k(llm, prompts),
                         # the head's own: its shared embedding is the target's
                         "parameters": llm.engine.draft_model.num_parameters
                         - (llm.engine.draft_model.embed.numel() if name == "eagle3" else 0)}
    return figures


def theory(alpha: float, k: int, c: float) -> float:
    tokens = (k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


RUNS = ("eagle3", "eagle3-r2", "eagle3-r3", "eagle3-r4", "eagle3-r6")  # the shipped head's runs (tools/train_eagle_head.py's commands)


def joined_logs(paths: list[Path]) -> list[dict]:
    """The records of several runs, each continuing the last: steps and training time counted on
    from where the previous run stopped, each record tagged with its run (0, 1, ...). A log this
    card wrote (training_log.jsonl: runs already joined, tagged) may come first."""
    out: list[dict] = []
    for path in paths:
        step0, seconds0, run0 = (out[-1]["step"], out[-1]["elapsed_s"], out[-1]["run"] + 1) if out else (0, 0.0, 0)
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out.append({**r, "run": run0 + r.get("run", 0), "step": r["step"] + step0,
                        "elapsed_s": r["elapsed_s"] + seconds0})
    return out


def plot(log: list[dict], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in log]
    a.plot(steps, [r["loss"] for r in log], lw=0.6)
    a.set_xlabel("step")
    a.set_ylabel("rollout loss (nats/token)")
    a.set_title("training loss")
    a.grid(alpha=0.3)
    val = [r for r in log if "val_agree" in r]
    for j in range(len(val[0]["val_agree"]) if val else 0):
        b.plot([r["step"] for r in val], [r["val_agree"][j] for r in val], "o-", ms=3, label=f"step {j + 1}")
    for ax in (a, b):  # where each run after the first started
        for r0, r1 in zip(log, log[1:]):
            if r1.get("run", 0) != r0.get("run", 0):
                ax.axvline(r0["step"], color="grey", ls=":", lw=1)
    b.set_xlabel("training step (dotted: a new run)")
    b.set_ylabel("argmax agreement with the target")
    b.set_title("validation, by rollout step")
    b.grid(alpha=0.3)
    b.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def card(f: dict, log: list[dict], config: dict) -> str:
    from engine.model.plan import label

    flags = [x for x in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if x in f["cpu_flags"]]
    last = [r for r in log if "val_agree" in r][-1] if any("val_agree" in r for r in log) else {}
    lines = ["# EAGLE-3 head for the embedded target", "",
             "A one-layer EAGLE-3 draft head trained for `models/target`, in the layout published for EAGLE-3 heads "
             "(docs/speculative/eagle3-heads.md): it reads the inputs of target layers "
             f"{config['eagle_config']['eagle_aux_hidden_state_layer_ids']} and the embedding of the next token "
             "(shared with the target) and proposes over "
             f"{config['draft_vocab_size']} of the target's {config['vocab_size']} tokens.", "",
             "Reproduce: the commands at the top of `tools/train_eagle_head.py` (needs the corpus of "
             "`tools/make_default_pair.py`), then `python tools/eagle_card.py` (this card).", "",
             "## Training", "",
             f"{log[-1]['step']} steps in {1 + log[-1].get('run', 0)} runs (ending at steps "
             + ", ".join(str(r["step"]) for i, r in enumerate(log)
                         if i == len(log) - 1 or log[i + 1].get("run", 0) != r.get("run", 0))
             + ") of 8 windows of 256 tokens (sequences the target wrote and corpus windows), a "
             f"{len(log[-1]['agree'])}-step training-time-test rollout per position, "
             f"{log[-1]['elapsed_s'] / 60:.0f} min on 2 CPU cores. Validation argmax agreement with the target by "
             "rollout step: " + ", ".join(f"{a:.3f}" for a in last.get("val_agree", [])) + "; expected acceptance "
             "at temperature 1 (Σ min(p, q)): " + ", ".join(f"{a:.3f}" for a in last.get("val_accept", [])) + ".", "",
             "![training](loss_curves.png)", "",
             f"## Speculation figures (our engine, this machine: {f['cpu']} [{', '.join(flags)}], 2 cores; "
             "forward plan " + ", ".join(f"{role}: {label(p)}" for role, p in f["forward_plan"].items()) + ")", "",
             f"Greedy, 96 new tokens, {f['prompts']} validation prompts, fixed K. α: accepted ÷ (accepted + "
             "rejections); by position: share of rounds that proposed a j-th token in which it was accepted; "
             "tokens per round include the target's own token; c: proposer ÷ target time per token, batch 1 "
             f"(medians of {TIMING_REPEATS} interleaved runs; target {f['target_ms_per_token']:.2f} ms/token).", "",
             "| proposer | parameters | ms/token | c |", "| --- | --- | --- | --- |"]
    for name in ("draft", "eagle3"):
        lines.append(f"| {name} | {f[name]['parameters'] / 1e6:.2f} M | {f[name]['ms_per_token']:.3f} | {f[name]['c']:.3f} |")
    lines += ["", "| K | proposer | α | tokens per round | Thm 3.8 | acceptance by position |",
              "| --- | --- | --- | --- | --- | --- |"]
    for k in KS:
        for name in ("draft", "eagle3"):
            r = f[name]["by_k"][str(k)] if str(k) in f[name]["by_k"] else f[name]["by_k"][k]
            lines.append(f"| {k} | {name} | {r['alpha_per_token']:.3f} | {r['tokens_per_round']:.2f} | "
                         f"{theory(r['alpha_per_token'], k, f[name]['c']):.2f}x | "
                         + " ".join(f"{a:.2f}" for a in r["by_position"]) + " |")
    lines += ["", "Raw numbers: `measurements.json`.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", type=Path, default=REPO / "models")
    work = Path.home() / ".cache" / "specserve-recipe"
    ap.add_argument("--log", type=Path, nargs="+", default=[work / run / "log.jsonl" for run in RUNS],
                    help="the training logs of the head's runs, in order")
    ap.add_argument("--card-only", action="store_true", help="rewrite README.md from the saved measurements.json")
    args = ap.parse_args()
    head = args.models / "eagle3"
    prompts = [json.loads(x)["prompt"] for x in (REPO / "bench" / "data" / "code_val_prompts.jsonl").read_text().splitlines()]
    if args.card_only:
        log = [json.loads(x) for x in (head / "training_log.jsonl").read_text().splitlines()]
        figures = json.loads((head / "measurements.json").read_text())
        (head / "README.md").write_text(card(figures, log, json.loads((head / "config.json").read_text())))
        return
    log = joined_logs(args.log)
    (head / "training_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log if "val_agree" in r))
    plot(log, head / "loss_curves.png")
    figures = measure(args.models, prompts)
    (head / "measurements.json").write_text(json.dumps(figures, indent=2))
    (head / "README.md").write_text(card(figures, log, json.loads((head / "config.json").read_text())))
    print((head / "README.md").read_text())


if __name__ == "__main__":
    main()
