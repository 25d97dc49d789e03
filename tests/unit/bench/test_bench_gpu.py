"""The one-command GPU check runs end to end on CPU at toy sizes (`python -m bench gpu --device cpu
--smoke --sections all`), so the one shot on a GPU cannot die on a typo: every section, each in
its own process, completes and passes its checks, and records its goals; the pieces a GPU run
trusts (the realistic pair, the per-token alpha, the section time limit) are tested on their own."""

from __future__ import annotations

import json
import time

import pytest
import torch

from bench.common import per_token_alpha, theoretical
from bench.gpu import main
from bench.gpu.check import SECTIONS
from bench.gpu.context import SectionTimeout, time_limit
from bench.gpu.stats import chi_square_pvalue

DEFAULT = ["environment", "correctness", "step", "realistic_8b", "paged_attention", "realistic_1b", "trees", "suffix"]


def test_the_smoke_run_completes_every_section_and_passes_its_checks(tmp_path):
    main(["--device", "cpu", "--smoke", "--out", str(tmp_path), "--sections", "all", "--budget-scale", "5"])
    report = json.loads((tmp_path / "gpu_cpu_smoke.json").read_text())
    sections = report["sections"]
    assert [s.name for s in SECTIONS if s.default] == DEFAULT and list(sections) == [s.name for s in SECTIONS]
    bad = {name: (s["status"], s.get("error"), s.get("failed_checks")) for name, s in sections.items()
           if s["status"] != "ok"}
    assert not bad, bad
    assert len(sections["correctness"]["greedy_parity"]) == 16  # 4 proposers x 2 backends x batch 1, 8
    for name in ("realistic_8b", "realistic_1b", "trees"):  # the pair was calibrated, the goals recorded
        assert sections[name]["pair"]["eps"] > 0 and sections[name]["goals"], name
    assert set(sections["realistic_8b"]["speculative"]) == {"adaptive", "K=2", "K=4", "K=6"}
    assert "largest excess" in sections["realistic_8b"]["cause"]
    assert set(sections["step"]["1b"]["modes"]) == {"fused off", "fused on"} and sections["step"]["8b"]["bytes_read"]
    assert set(sections["realistic_1b"]["batches"]) == {"1", "4"}
    assert {"block_16", "block_64", "auto"} <= set(sections["paged_attention"])
    assert {"trees_over_chains", "block_over_token", "verify_ms_graphs"} <= set(sections["trees"])
    assert set(sections["suffix"]["variants"]) == {"plain", "ngram", "suffix"}
    assert len(sections["cuda_graphs"]["checks"]) == 2 + 6
    assert set(sections["quantized"]["formats"]) == {"bf16", "int8", "int4"}  # CPU: no fp8 kernel
    assert sections["quantized"]["formats"]["int4"]["linear_bytes_over_bf16"] <= 0.28
    assert set(sections["moe"]["batches"]) == {"1", "4"} and sections["moe"]["pair"]["eps"] > 0
    assert all(c["ok"] for c in sections["moe"]["checks"].values()) and len(sections["moe"]["checks"]) == 2
    assert set(sections["per_request"]["batches"]) == {"4"}
    assert set(sections["per_request"]["batches"]["4"]["tok_s"]) == {"plain", "one K", "per-request K"}
    assert all(c["ok"] for c in sections["per_request"]["checks"].values())
    assert "# GPU check" in (tmp_path / "gpu_cpu_smoke.md").read_text()


class _Output:
    def __init__(self, accepted, proposed):
        self.accepted_per_round, self.proposed_per_round = accepted, proposed


def test_the_bound_takes_the_per_token_alpha_not_accepted_over_drafted():
    """K = 4: a round accepting all four, one rejecting the first. Per token: 4 accepted, 1 rejection,
    alpha 0.8; accepted ÷ drafted is 0.5, and would price the bound at 1.36x instead of 2.4x."""
    from bench.gpu.realistic import _row

    outs = [_Output([4, 0], [4, 4])]
    assert per_token_alpha(outs) == pytest.approx(0.8)
    spec = [{"tok_s": 2.0, "alpha": per_token_alpha(outs), "acceptance": 0.5, "mean_k": 4.0, "k_per_step": {4: 2}}]
    row = _row(spec, [{"tok_s": 1.0}], c=0.1, fixed_k=4)
    assert row["bound"] == pytest.approx(theoretical(0.8, 4, 0.1)) and row["bound"] > 2.3
    assert per_token_alpha([_Output([], [])]) is None


def test_a_section_time_limit_is_not_swallowed_by_a_broad_except():
    def busy():
        while True:
            try:
                time.sleep(0.01)
            except Exception:  # what the engine and the sections do around their work
                pass

    with pytest.raises(SectionTimeout), time_limit(0.2):
        busy()


def test_the_pair_reaches_a_chosen_acceptance_through_the_engine(tmp_path):
    """A toy Llama (6 layers, untied) made into a target whose 2-layer prefix agrees greedily at
    0.8: speculation by that prefix through the engine's acceptance rule sees alpha within 0.05."""
    from bench.gpu.decode import random_prompts
    from bench.gpu.pair import PrefixPair, calibrate
    from bench.gpu.weights import SMOKE_1B, hf_model, hf_tensors, target_and_prefix_draft, weights_in_memory
    from engine import LLM, SamplingParams

    config = {**SMOKE_1B, "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}
    pair = PrefixPair(hf_model(config, torch.float32, "cpu"), keep=2)
    found = calibrate(pair, torch.tensor(random_prompts(32, 12, 512, seed=1)), 0.8, new_tokens=24, steps=10,
                      log=lambda _: None)
    assert abs(found["teacher_forced"]["greedy"] - 0.8) <= 0.02 and found["teacher_forced"]["entropy"] < 2.5
    target, draft, store = target_and_prefix_draft(tmp_path, config, hf_tensors(pair.hf), 2)
    with weights_in_memory(store):
        llm = LLM(model=str(target), draft_model=str(draft), speculative_method="draft", spec_length=4,
                  spec_policy="fixed", dtype="float32", forward_plan="torch", max_seq_len=64, max_batch_size=16)
    outs = llm.generate(random_prompts(16, 12, 512, seed=2), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    alpha = per_token_alpha(outs)
    assert abs(alpha - 0.8) <= 0.05, alpha


def test_the_chi_square_pvalue_matches_the_distribution_and_rejects_a_shifted_one():
    """gammaincc-based p-values: uniform counts drawn from the uniform pass, counts from a
    distribution 10% off in total variation are rejected at n = 4000."""
    g = torch.Generator().manual_seed(0)
    probs = torch.full((16,), 1 / 16)
    fair = torch.bincount(torch.multinomial(probs, 4000, replacement=True, generator=g), minlength=16)
    assert chi_square_pvalue(fair, probs) > 1e-3
    shifted = probs.clone()
    shifted[:4] += 0.025
    shifted[4:8] -= 0.025
    biased = torch.bincount(torch.multinomial(shifted, 4000, replacement=True, generator=g), minlength=16)
    assert chi_square_pvalue(biased, probs) < 1e-3
    assert chi_square_pvalue(torch.tensor([5, 0]), torch.tensor([1.0, 0.0])) == 1.0  # one bin left: nothing to test
    assert chi_square_pvalue(torch.tensor([5, 1]), torch.tensor([1.0, 0.0])) == 0.0  # a count where p = 0
