"""Benchmark workloads: held-out prompts of the shipped pair (never its training files).

- `code`: the first lines of a function or class from validation files (continue the code);
- `edit`: a function from a validation file followed by an instruction-like comment asking to
  rewrite it, so the output repeats much of the prompt (prompt lookup's best case);
- `agent`: the code and edit prompts, each followed by a fixed tool set and a request for the next
  tool calls, answered as JSON under the tool set's schema (an agent step: every answer repeats the
  structure of the others, the strings are the model's own).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
FILES = {"code": "code_val_prompts.jsonl", "edit": "edit_val_prompts.jsonl"}


STRING = {"type": "string", "maxLength": 48}
AGENT_TOOLS = {"read_file": {"path": STRING}, "search_code": {"query": STRING, "path": STRING},
               "run_tests": {"path": STRING, "verbose": {"type": "boolean"}},
               "edit_file": {"path": STRING, "old": STRING, "new": STRING}}


def agent_schema() -> dict:
    """A JSON array of 1-2 tool calls, each {"name": one of AGENT_TOOLS, "arguments": its arguments}."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": name}, "arguments": {
                  "type": "object", "properties": args, "required": list(args), "additionalProperties": False}}}
             for name, args in AGENT_TOOLS.items()]
    return {"type": "array", "minItems": 1, "maxItems": 2, "items": {"anyOf": calls}}


def agent_prompts() -> list[str]:
    """The agent workload's prompts (code, then edit), each ending in the tool set and a request."""
    tools = "; ".join(f"{name}({', '.join(args)})" for name, args in AGENT_TOOLS.items())
    return [f"{p}\n# Tools: {tools}\n# Next tool calls (JSON):\n" for p in load_prompts("code") + load_prompts("edit")]


def load_prompts(workload: str, n: int | None = None) -> list[str]:
    if workload not in FILES:
        raise ValueError(f"workload must be one of {sorted(FILES)}, got {workload!r}")
    rows = [json.loads(line)["prompt"] for line in (DATA / FILES[workload]).read_text().splitlines()]
    return rows[:n] if n is not None else rows
