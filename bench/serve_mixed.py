"""The mixed batch through the server: `serve run serve_config.yaml` (one replica) and two guidellm
clients at once, one sending the edit prompts greedily and one the code prompts at T = 0.8
(guidellm's temperature is one per client), each with half the concurrency.

    python -m bench serve-mixed [--concurrency 8 32] [--tokens 128] [--repeats 3]

Modes, applied live through `serve deploy` (user_config), in turn per repeat (the order rotated):
plain, fixed K = 1-3 with `hybrid`, one K a step (the adaptive policy with `hybrid`, as in-process
`bench mixed`), and a K per request (`k_per_request`). Reported per level and mode, medians over
repeats: output tokens/s of both clients together, and each client's; one K ÷ plain per repeat
and one K ÷ the best fixed K, that best picked on the other repeats (sweep.held_out_ratios).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import yaml
from tqdm import tqdm

from bench.common import RESULTS, fixed, host_class, machine, parser, write
from bench.mixed import HIGH_TEMPERATURE
from bench.serve import REPO, WORKERS_ENV, LiveServer, figures, guidellm_command
from bench.sweep import held_out_ratios
from bench.workloads import load_prompts

RUNS = RESULTS / "serve_runs"
CLIENTS = {"edit": 0.0, "code": HIGH_TEMPERATURE}  # workload -> its client's temperature
FIXED_KS = (1, 2, 3)


def modes(shipped: dict) -> dict[str, dict]:
    one_k = {**shipped, "use_speculative_decoding": True, "speculative_method": "hybrid", "spec_length": 8,
             "spec_policy": "adaptive", "k_per_request": False}
    return {"plain": {"use_speculative_decoding": False},
            **{f"K={k}": {**shipped, **fixed("hybrid", k)} for k in FIXED_KS},
            "one K": one_k, "per-request K": {**one_k, "k_per_request": True}}


def run_clients(live: LiveServer, level: int, tokens: int, data: dict[str, Path], out: Path) -> dict:
    """Both clients at once, each with level / 2 streams; their figures and the sum of tok/s."""
    procs = {}
    for workload, temperature in CLIENTS.items():
        streams = max(1, level // 2)
        command = guidellm_command(live.server.url, live.model, streams, max(4, 4 * streams), data[workload],
                                   out / f"{workload}.json", {"ttft_ms": 1e6, "tpot_ms": 1e6})
        command = [a.replace("extras.body.temperature=0", f"extras.body.temperature={temperature}") for a in command]
        procs[workload] = subprocess.Popen(command, env={**os.environ, **WORKERS_ENV}, cwd=out,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for workload, proc in procs.items():
        if proc.wait() != 0:
            raise RuntimeError(f"guidellm ({workload}) exited with {proc.returncode}")
    each = {w: figures(json.loads((out / f"{w}.json").read_text())) for w in CLIENTS}
    return {"tok_s": sum(f["tok_s"] for f in each.values()), "clients": each}


def main(argv: list[str] | None = None) -> None:
    ap = parser("serve-mixed", __doc__, tokens=128, models=False)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--config", type=Path, default=REPO / "serve_config.yaml")
    ap.set_defaults(repeats=5)
    args = ap.parse_args(argv)
    from bench.local_server import local_server

    cfg = yaml.safe_load(args.config.read_text())
    app, deployment = cfg["applications"][0], cfg["applications"][0]["deployments"][0]
    deployment.pop("autoscaling_config", None)
    deployment["num_replicas"] = 1
    mode_configs = modes(dict(deployment.get("user_config") or {}))
    work = Path(tempfile.mkdtemp(prefix="bench-serve-mixed-"))
    data = {}
    for workload in CLIENTS:
        data[workload] = work / f"{workload}.jsonl"
        data[workload].write_text("".join(json.dumps({"prompt": p, "output_tokens_count": args.tokens}) + "\n"
                                          for p in load_prompts(workload)))
    results: dict = {}
    names = list(mode_configs)
    with local_server(cfg, work) as server:
        live = LiveServer(server, app["args"].get("served_model_name", "specserve-default"))
        with tqdm(total=len(args.concurrency) * args.repeats * len(names), desc="serve-mixed", unit="run") as bar:
            for level in args.concurrency:
                for rep in range(args.repeats):
                    for name in names[rep % len(names):] + names[:rep % len(names)]:
                        live.apply(mode_configs[name], work)
                        out = RUNS / f"mixed_c{level}_{name.replace(' ', '_')}_r{rep}"
                        out.mkdir(parents=True, exist_ok=True)
                        fig = run_clients(live, level, args.tokens, data, out)
                        results.setdefault(str(level), {}).setdefault(name, []).append(fig)
                        bar.set_postfix_str(f"c={level} {name}: {fig['tok_s']:.0f} tok/s")
                        bar.update(1)
    rows = {}
    for level, by_mode in results.items():
        med = {n: statistics.median(r["tok_s"] for r in runs) for n, runs in by_mode.items()}
        paired = [p["tok_s"] / o["tok_s"] for p, o in zip(by_mode["per-request K"], by_mode["one K"])]
        rows[level] = {"tok_s": med, "tok_s_range": {n: [min(r["tok_s"] for r in runs), max(r["tok_s"] for r in runs)]
                                                     for n, runs in by_mode.items()},
                       "over_plain": {n: v / med["plain"] for n, v in med.items()},
                       "per_request_over_one_k": _spread(paired),
                       "one_k_over_plain": _spread([a["tok_s"] / p["tok_s"]
                                                    for a, p in zip(by_mode["one K"], by_mode["plain"])]),
                       "one_k_over_best_fixed": _spread(held_out_ratios(
                           {n: runs for n, runs in by_mode.items() if n.startswith("K=") or n == "one K"}, "one K"))
                       if args.repeats > 1 else None,
                       "by_client": {n: {w: statistics.median(r["clients"][w]["tok_s"] for r in runs) for w in CLIENTS}
                                     for n, runs in by_mode.items()}}
        best = rows[level]["one_k_over_best_fixed"]
        print(f"c={level:>2}: " + "  ".join(f"{n} {v:.0f} tok/s" for n, v in med.items())
              + f"  | one K ÷ plain {rows[level]['one_k_over_plain']['median']:.3f}"
              + (f", ÷ best fixed {best['median']:.3f}" if best else "")
              + f"; per-request ÷ one K {rows[level]['per_request_over_one_k']['median']:.3f}")
    path = write("serve_mixed", {"host": host_class(machine()), "tokens": args.tokens, "repeats": args.repeats,
                                 "clients": CLIENTS, "modes": mode_configs, "results": rows, "raw": results})
    print(f"wrote {path}")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    main()
