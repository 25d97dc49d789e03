"""Command line: generate with the engine in-process (no Ray).

    python -m serve_app.cli --prompt "def fib(n):" --max-tokens 64
    python -m serve_app.cli --model path/to/target --draft-model path/to/draft --speculative-decoding

Every EngineConfig field is a flag (`--spec-length 4`, `--kv-cache-backend slotted`, ...);
with no --model the embedded target is used with speculation on (its EAGLE-3 head; its draft
model with --speculative-method draft).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import types
import typing

from engine.config import EngineConfig, SpecConfig
from engine.sampling_params import SamplingParams

_DEFAULT_PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef"]
_ALIASES = {"use_speculative_decoding": "--speculative-decoding"}


def _flag_type(owner: type, field: dataclasses.Field):
    hint = typing.get_type_hints(owner)[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return str
    return hint


def forward_plan_arg(value: str):
    """--forward-plan: auto, torch, or a JSON object such as '{"draft": {"dtype": "float32"}}'."""
    return value if value in ("auto", "torch") else json.loads(value)


def config_fields() -> list[tuple[type, dataclasses.Field]]:
    """Every field a flag sets: EngineConfig's own, then SpecConfig's (flat, as LLM takes them)."""
    own = [(EngineConfig, f) for f in dataclasses.fields(EngineConfig) if f.name != "speculative"]
    return own + [(SpecConfig, f) for f in dataclasses.fields(SpecConfig)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve-generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for owner, f in config_fields():
        flag = _ALIASES.get(f.name, "--" + f.name.replace("_", "-"))
        kind = forward_plan_arg if f.name == "forward_plan" else _flag_type(owner, f)
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None)
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None,
                        help="per-request sampling seed (--seed seeds the engine)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per output")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine import LLM

    names = {f.name for _, f in config_fields()}
    kwargs = {k: v for k, v in vars(args).items() if k in names and v is not None}
    try:
        llm = LLM(**kwargs)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.sampling_seed)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or _DEFAULT_PROMPTS
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for prompt, o in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": o.text, "finish_reason": o.finish_reason,
                              "num_tokens": len(o.token_ids), "acceptance_rate": o.acceptance_rate}))
        else:
            print(f"--- {prompt!r} ({len(o.token_ids)} tokens, {o.finish_reason}"
                  + (f", acceptance {o.acceptance_rate:.2f}" if o.acceptance_rate is not None else "") + ")")
            print(prompt + o.text)
    total = sum(len(o.token_ids) for o in outs)
    print(f"# {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s); model {llm.config.model}"
          + (f", draft {llm.config.draft_model}" if llm.config.use_speculative_decoding else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
