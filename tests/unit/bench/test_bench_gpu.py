"""The one-command GPU check runs end to end on CPU at toy sizes, so the one shot on a GPU cannot
die on a typo: the first plan (`python -m bench gpu --plan first --device cpu --smoke`, with the
kernel checks under Triton's interpreter, which the suite's conftest turns on) and then every other
section, each in its own process, complete and pass their checks in the order given, and record
their goals and the budget accounting; the plans' budgets fit one GPU call; the pieces a GPU run
trusts (the kernel checks' teeth, the quantized section's reference, the realistic pair, the
per-token alpha, the section time limit) are tested on their own."""

from __future__ import annotations

import json
import time

import pytest
import torch

from bench.common import per_token_alpha, theoretical
from bench.gpu import check as gpu_check
from bench.gpu import main
from bench.gpu.check import PLANS, SECTIONS, STARTUP_S, chosen, run_sections
from bench.gpu.context import SectionTimeout, time_limit
from bench.gpu.stats import chi_square_pvalue

FIRST = ["environment", "correctness", "step", "realistic_8b", "quantized", "moe"]
SECOND = ["paged_attention", "realistic_1b", "trees", "suffix", "per_request"]
KERNEL_CHECKS = 8  # fused add_rms_norm x2, rope_qk_write x2, silu_mul; fp8_linear, int4_linear, moe experts


def _bad(sections: dict) -> dict:
    return {name: (s["status"], s.get("error"), s.get("failed_checks")) for name, s in sections.items()
            if s["status"] != "ok"}


def test_the_first_plan_smoke_run_completes_in_order_with_its_budget_accounting(tmp_path):
    main(["--device", "cpu", "--smoke", "--plan", "first", "--out", str(tmp_path), "--budget-scale", "5"])
    report = json.loads((tmp_path / "gpu_cpu_smoke.json").read_text())
    sections = report["sections"]
    assert report["plan"] == "first" and list(sections) == report["order"] == FIRST
    assert not _bad(sections), _bad(sections)
    on_gpu = report["plan_accounting"]  # what the plan takes on the GPU, whatever this run's size
    assert on_gpu["fits"] and on_gpu["sum_s"] <= 480 and on_gpu["startup_sum_s"] == STARTUP_S * len(FIRST)
    assert list(on_gpu["sections"]) == list(report["budget"]["sections"]) == FIRST  # and this run's, scaled
    assert all(s["startup_s"] > 0 and s["allotted_s"] > s["startup_s"] for s in sections.values())
    correctness = sections["correctness"]
    assert "kernels_skipped" not in correctness and len(correctness["kernels"]) == KERNEL_CHECKS
    assert sum(name.startswith("kernel ") for name in correctness["checks"]) == KERNEL_CHECKS
    assert len(correctness["greedy_parity"]) == 16  # 4 proposers x 2 backends x batch 1, 8
    assert sections["realistic_8b"]["pair"]["eps"] > 0 and sections["realistic_8b"]["goals"]
    assert set(sections["realistic_8b"]["speculative"]) == {"adaptive", "K=2", "K=4", "K=6"}
    assert "largest excess" in sections["realistic_8b"]["cause"]
    assert set(sections["step"]["1b"]["modes"]) == {"fused off", "fused on"} and sections["step"]["8b"]["bytes_read"]
    quantized = sections["quantized"]["formats"]
    assert set(quantized) == {"bf16", "int8", "int4"}  # CPU: no fp8 kernel
    assert quantized["int4"]["linear_bytes_over_bf16"] <= 0.28
    for layout in ("int8", "int4"):
        against = quantized[layout]["against_dequantized"]
        assert set(against["layers"]) == {"qkv", "o", "gate_up", "down"} and against["worst"] <= 2e-2, against
        assert {"cuda_graphs", "fused_kernels"} <= set(quantized[layout]["paths"])
    assert set(sections["moe"]["batches"]) == {"1", "4"} and sections["moe"]["pair"]["eps"] > 0
    assert all(c["ok"] for c in sections["moe"]["checks"].values()) and len(sections["moe"]["checks"]) == 2
    md = (tmp_path / "gpu_cpu_smoke.md").read_text()
    assert "# GPU check" in md and "on a GPU the plan takes: plan first: environment 10+10" in md


def test_every_other_section_smoke_run_completes_in_the_order_given(tmp_path):
    """The sections outside the first plan, given in reverse: they run as given."""
    rest = [s.name for s in SECTIONS if s.name not in FIRST][::-1]
    main(["--device", "cpu", "--smoke", "--out", str(tmp_path), "--sections", *rest, "--budget-scale", "5"])
    report = json.loads((tmp_path / "gpu_cpu_smoke.json").read_text())
    sections = report["sections"]
    assert list(sections) == rest and report["plan"] is None and "plan_accounting" not in report
    assert not _bad(sections), _bad(sections)
    for name in ("realistic_1b", "trees"):  # the pair was calibrated, the goals recorded
        assert sections[name]["pair"]["eps"] > 0 and sections[name]["goals"], name
    assert set(sections["realistic_1b"]["batches"]) == {"1", "4"}
    assert {"block_16", "block_64", "auto"} <= set(sections["paged_attention"])
    assert {"trees_over_chains", "block_over_token", "verify_ms_graphs"} <= set(sections["trees"])
    assert set(sections["suffix"]["variants"]) == {"plain", "ngram", "suffix"}
    assert len(sections["cuda_graphs"]["checks"]) == 2 + 6
    assert set(sections["per_request"]["batches"]) == {"4"}
    assert set(sections["per_request"]["batches"]["4"]["tok_s"]) == {"plain", "one K", "per-request K"}
    assert all(c["ok"] for c in sections["per_request"]["checks"].values())


def test_the_plans_fit_one_gpu_call_and_cover_every_section_once():
    first, second = PLANS["first"], PLANS["second"]
    assert [s.name for s in first.sections] == FIRST and [s.name for s in second.sections] == SECOND
    for plan in (first, second):
        accounting = plan.accounting()
        assert accounting["fits"] and accounting["sum_s"] <= plan.total_s <= 480
        assert accounting["sum_s"] == sum(b for _, b in plan.budgets) + STARTUP_S * len(plan.budgets)
    assert first.accounting()["sum_s"] == 480  # the whole call's section time, start-ups included
    assert not set(FIRST) & set(SECOND) and len({s.name for s in SECTIONS}) == len(SECTIONS)
    assert [s.name for s in chosen(None)] == FIRST  # the default: the first plan


def test_sections_run_in_the_order_given_each_once():
    assert [s.name for s in chosen(["quantized", "environment", "moe", "quantized"])] == ["quantized", "environment",
                                                                                          "moe"]
    assert [s.name for s in chosen(["all"])] == [s.name for s in SECTIONS]
    with pytest.raises(SystemExit, match="unknown"):
        chosen(["environment", "nope"])
    with pytest.raises(SystemExit):  # one or the other
        main(["--device", "cpu", "--smoke", "--plan", "first", "--sections", "environment"])


def test_a_plan_run_allots_each_section_its_budget_and_start_up_in_order(tmp_path, monkeypatch):
    """No child started, each using all it is allotted on a fake clock: each section's allotment,
    counted from its launch, is the plan's budget plus the start-up allowance, in the plan's order,
    the whole within 480 s; under a smaller total the last is cut to what is left."""
    clock, launched = [0.0], []

    def fake_child(section, device, smoke, work, report, allowed, elapsed):
        launched.append((section.name, round(allowed, 6)))
        clock[0] += allowed
        return {"status": "ok", "seconds": allowed, "startup_s": 1.0}

    monkeypatch.setattr(gpu_check, "_run_child", fake_child)
    monkeypatch.setattr(gpu_check, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0]),
                                                              "strftime": staticmethod(time.strftime)}))
    plan = PLANS["first"]
    report = run_sections("cuda", False, tmp_path, plan.sections, plan.total_s, lambda r: None, plan=plan)
    assert launched == [(name, b + STARTUP_S) for name, b in plan.budgets] and clock[0] == 480
    assert report["budget"]["sum_s"] == 480 and report["budget"]["fits"] and report["order"] == FIRST
    assert all(s["status"] == "ok" for s in report["sections"].values())
    clock[0], launched[:] = 0.0, []
    run_sections("cuda", False, tmp_path, plan.sections, 400, lambda r: None, plan=plan)
    assert [n for n, _ in launched] == FIRST and launched[-1] == ("moe", 400 - (480 - plan.budgets[-1][1] - STARTUP_S))


def test_the_kernel_checks_fail_a_wrong_kernel_and_name_one_that_raises(tmp_path, monkeypatch):
    """Under Triton's interpreter: a silu_mul that returns silu(gate) alone fails its check, an
    int4_linear that raises fails its own check with the error, and every other kernel passes."""
    from bench.gpu import kernels
    from bench.gpu.context import Context
    from engine.model.kernels import fused, quant

    real = fused.silu_mul
    monkeypatch.setattr(fused, "silu_mul", lambda gate_up: torch.nn.functional.silu(real(gate_up) * 0 + gate_up.chunk(
        2, dim=-1)[0]))

    def broken(x, layer, *args, **kwargs):
        raise RuntimeError("no kernel for these inputs")
    monkeypatch.setattr(quant, "int4_linear", broken)
    out: dict = {}
    kernels.run(Context("cpu", True, tmp_path), out)
    failed = {name for name, c in out["checks"].items() if not c["ok"]}
    assert failed == {"kernel fused silu_mul, float32 = eager within 0.0001",
                      "kernel int4_linear, float32 = dequantized within 0.0001"}, failed
    assert "no kernel for these inputs" in out["kernels"]["kernel int4_linear, float32"]["error"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    skipped: dict = {}
    kernels.run(Context("cpu", True, tmp_path), skipped)
    assert "TRITON_INTERPRET" in skipped["kernels_skipped"] and not skipped.get("checks")


@pytest.mark.parametrize("layout", ["fp8", "int4", "int8"])
def test_the_quantized_sections_reference_is_the_layers_own_dequantized_weight(tmp_path, monkeypatch, layout):
    """The reference the `quantized` section builds from the checkpoint's stored tensors (on CPU,
    where torch's kernels replace the stored form at load) equals the loaded layers' dequantize()
    (taken as they are prepared), and the check sees a layer off by 5%."""
    from bench.gpu import quantized as q
    from bench.gpu.context import Context
    from bench.random_checkpoints import SMOKE_8B, checkpoint_dir, weights_in_memory
    from engine.config import ModelPlan
    from engine.model.loader import load_model
    from engine.model.quant.linear import QuantLinear

    before, prepare = {}, QuantLinear.prepare

    def keep_stored_form(self, *args, **kwargs):
        before[id(self)] = self.dequantize(torch.float32)
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(QuantLinear, "prepare", keep_stored_form)
    path = checkpoint_dir(tmp_path / layout, {**SMOKE_8B, "quantization_config": q.CONFIGS[layout]})
    tensors = q.QuantizedTensors(SMOKE_8B, layout, torch.bfloat16, "cpu")
    with weights_in_memory({str(path): tensors}):
        model = load_model(path, ModelPlan("bfloat16"), "cpu", 256)
    for attr, modules in q.CHECKED.items():
        layer = getattr(model.layers[0], attr)
        parts = getattr(layer, "parts", [layer])
        got = q.dequantized(layer)
        if got is None:  # prepared for torch's CPU kernel: the weight as it was before
            got = torch.cat([before[id(p)] for p in parts])
        want = torch.cat([q.stored_weight(tensors, layout, f"model.layers.0.{m}") for m in modules])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ctx = Context("cpu", True, tmp_path)
    assert q.kernels_against_dequantized(ctx, model, tensors, layout)["worst"] <= 2e-2
    down = model.layers[0].down
    model.layers[0].down = lambda x: down(x) * 1.05
    assert q.kernels_against_dequantized(ctx, model, tensors, layout)["worst"] > 2e-2


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
    from bench.random_checkpoints import SMOKE_1B, hf_model, hf_tensors, target_and_prefix_draft, weights_in_memory
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
