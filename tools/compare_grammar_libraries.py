"""Per-token mask cost of llguidance and xgrammar on the shipped tokenizer (why engine/grammar.py
uses llguidance). Walks the JSON document of `bench structured`'s schema token by token and times
filling the next-token bitmask at each position, both libraries interleaved.

    pip install llguidance xgrammar   # xgrammar is not a dependency of the project
    python tools/compare_grammar_libraries.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import llguidance
    import llguidance.hf
    import xgrammar
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from bench.structured import SCHEMA
    from engine.structured_output import closed

    hf = AutoTokenizer.from_pretrained(ROOT / "models" / "target")
    vocab = json.loads((ROOT / "models" / "target" / "config.json").read_text())["vocab_size"]
    schema = json.dumps(closed(SCHEMA))
    doc = json.dumps([{"name": "parse_header", "args": ["text", "strict"], "returns": "dict"}] * 6,
                     separators=(",", ":"))
    ids = hf.encode(doc, add_special_tokens=False)
    eos = hf.eos_token_id

    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=[eos])
    llg_grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    xinfo = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    xcompiled = xgrammar.GrammarCompiler(xinfo, max_threads=1).compile_json_schema(
        schema, any_whitespace=False, separators=(",", ":"))
    bitmask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)

    def walk_llg() -> list[float]:
        m, out = llguidance.LLMatcher(lltok, llg_grammar, log_level=0), []
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            out.append(time.perf_counter() - t0)
            assert m.consume_token(t), hf.decode([t])
        return out

    def walk_xgr() -> list[float]:
        m, out = xgrammar.GrammarMatcher(xcompiled), []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            out.append(time.perf_counter() - t0)
            assert m.accept_token(t), hf.decode([t])
        return out

    times: dict[str, list[float]] = {"llguidance": [], "xgrammar": []}
    for _ in range(args.repeats):
        times["llguidance"] += walk_llg()
        times["xgrammar"] += walk_xgr()
    from importlib.metadata import version

    versions = {name: version(name) for name in times}
    print(f"{len(ids)} tokens x {args.repeats} walks, torch threads {torch.get_num_threads()}")
    for name, ts in times.items():
        ts_us = sorted(t * 1e6 for t in ts)
        print(f"{name:11s} {versions[name]}: mask fill median {statistics.median(ts_us):.1f} us, "
              f"mean {statistics.fmean(ts_us):.1f} us, p90 {ts_us[int(0.9 * len(ts_us))]:.1f} us")


if __name__ == "__main__":
    main()
