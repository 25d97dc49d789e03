"""Third-party clients as their users run them, against `serve run serve_config.yaml`:

- lm-evaluation-harness (`lm_eval`, model `local-completions`) scoring a small local multiple-choice
  task (bench/data/lm_eval, no download) by loglikelihood (echo + logprobs), with speculation on
  and then off (switched live by user_config); the scores must be identical.
- the openai-agents SDK (chat completions model): an agent with one function tool, the first turn
  forced to call it (`tool_choice: required`), the tool's result sent back as a `tool` message, then
  the model's answer.

    pip install "lm_eval[api]" openai-agents     # not project dependencies
    python -m bench clients [--skip-lm-eval] [--skip-agents]

Writes bench/results/clients.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import write

REPO = Path(__file__).resolve().parents[1]
TASK_DATA = REPO / "bench" / "data" / "lm_eval" / "specserve_mc.jsonl"
TASK = "specserve_mc"
MODEL = "specserve-default"


def task_yaml(data: Path) -> str:
    """An lm_eval task over the local JSONL: question, four choices, the answer's index."""
    return yaml.safe_dump({
        "task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]})


def lm_eval_scores(url: str, work: Path, label: str) -> dict:
    """Runs the `lm_eval` CLI against the server; the task's metrics and the per-document logprobs."""
    tasks = work / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{TASK}.yaml").write_text(task_yaml(TASK_DATA))
    out = work / f"lm_eval_{label}"
    model_args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer={REPO / 'models' / 'target'},"
                  "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    command = [str(Path(sys.executable).parent / "lm_eval"), "run", "--model", "local-completions",
               "--model_args", model_args, "--include_path", str(tasks), "--tasks", TASK,
               "--output_path", str(out), "--log_samples"]
    t0 = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO, timeout=1800)
    seconds = time.perf_counter() - t0
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()]
    metrics = {k.split(",")[0]: v for k, v in results["results"][TASK].items() if not k.endswith("stderr,none")
               and k != "alias"}
    logprobs = [[r[0][0] if isinstance(r[0], list) else r[0] for r in s["resps"]] for s in
                sorted(samples, key=lambda s: s["doc_id"])]
    return {"metrics": metrics, "seconds": seconds, "loglikelihoods": logprobs,
            "command": " ".join(command).replace(str(REPO) + "/", "")}


def agent_exchange(url: str) -> dict:
    """A two-step tool exchange with the openai-agents SDK: the tool is called, its result goes
    back as a `tool` message, the model answers."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export (no network)
    calls: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Today's weather in a city."""
        calls.append({"city": city})
        return json.dumps({"city": city, "forecast": "sunny", "celsius": 21})

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    agent = Agent(name="weather", instructions="Answer questions about the weather; use the tool.",
                  tools=[get_weather], model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                               max_tokens=64, temperature=0.0))
    t0 = time.perf_counter()
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [item.type for item in result.new_items]
    return {"seconds": time.perf_counter() - t0, "items": kinds, "tool_calls": calls,
            "final_output": result.final_output,
            "completed": "tool_call_item" in kinds and "tool_call_output_item" in kinds
            and kinds[-1] == "message_output_item"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench clients", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-lm-eval", action="store_true")
    ap.add_argument("--skip-agents", action="store_true")
    args = ap.parse_args(argv)
    from bench.local_server import local_server
    from bench.serve import LiveServer

    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, local_server(config, Path(tmp) / "serve") as server:
        work = Path(tmp)
        live = LiveServer(server, MODEL)
        spec_on = config["applications"][0]["deployments"][0]["user_config"]
        if not args.skip_agents:
            out["agents"] = agent_exchange(server.url)
            print(json.dumps(out["agents"], indent=1), flush=True)
        if not args.skip_lm_eval:
            runs = {"speculation_on": lm_eval_scores(server.url, work, "on")}
            live.apply({"use_speculative_decoding": False}, work)
            runs["speculation_off"] = lm_eval_scores(server.url, work, "off")
            live.apply(spec_on, work)
            on, off = runs["speculation_on"], runs["speculation_off"]
            out["lm_eval"] = {**runs, "identical_metrics": on["metrics"] == off["metrics"],
                              "identical_loglikelihoods": on["loglikelihoods"] == off["loglikelihoods"]}
            print(json.dumps({k: v["metrics"] for k, v in runs.items()}, indent=1),
                  "identical:", out["lm_eval"]["identical_metrics"], out["lm_eval"]["identical_loglikelihoods"])
    path = write("clients", out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
