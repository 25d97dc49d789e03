"""The one-command GPU check runs end to end on CPU at toy sizes (`python -m bench gpu --device cpu
--smoke`), so the one shot on a GPU cannot die on a typo: every section completes and passes its
checks, and the report says so."""

from __future__ import annotations

import json

import torch

from bench.gpu import main
from bench.gpu.stats import chi_square_pvalue


def test_the_smoke_run_completes_every_section_and_passes_its_checks(tmp_path):
    main(["--device", "cpu", "--smoke", "--out", str(tmp_path), "--budget", "1800", "--budget-scale", "10"])
    report = json.loads((tmp_path / "gpu_cpu_smoke.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["environment", "attention", "correctness", "syncs", "llama_1b", "cuda_graphs",
                              "paged_attention", "trees", "llama_8b", "faults"]
    bad = {name: (s["status"], s.get("error"), s.get("failed_checks")) for name, s in sections.items()
           if s["status"] != "ok"}
    assert not bad, bad
    assert sections["correctness"]["checks"] and all(c["ok"] for c in sections["correctness"]["checks"].values())
    assert len(sections["correctness"]["greedy_parity"]) == 16  # 4 proposers x 2 backends x batch 1, 8
    assert set(sections["llama_1b"]["plain"]) == {"1", "8", "32"}
    for name in ("cuda_graphs", "paged_attention"):  # on ÷ off, plain and speculative, each batch; kept at load
        assert set(sections[name]["plain"]) == set(sections[name]["speculative"]) == {"1", "8", "32"}, name
        assert len(sections[name]["checks"]) == 2 + 6 and all(c["ok"] for c in sections[name]["checks"].values())
    trees = sections["trees"]
    assert set(trees["verify_ms_graphs"]["1"]) == set(trees["verify_ms_eager"]["1"]) == {"chain", "tree"}
    assert len(trees["checks"]) == 2 and all(c["ok"] for c in trees["checks"].values())  # graphs replayed; parity
    assert "# GPU check" in (tmp_path / "gpu_cpu_smoke.md").read_text()


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
