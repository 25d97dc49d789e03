"""bench policy: its variants, the ratios it judges by (best fixed K held out), its table, and a
smoke run of the grid's code on the embedded pair."""

from __future__ import annotations

import json

import pytest

from bench import policy


def _runs(values: dict[str, list[float]]) -> dict[str, list[dict]]:
    return {n: [{"tok_s": v, "tok_s_end_to_end": v / 2} for v in vs] for n, vs in values.items()}


def test_the_one_k_variants_never_inherit_a_per_request_setting():
    v = policy.variants("hybrid")
    assert v[policy.ADAPTIVE]["k_per_request"] is False and v[policy.AA] == v[policy.ADAPTIVE]
    assert v[policy.PER_REQUEST]["k_per_request"] is True
    assert all(v[f"K={k}"]["spec_policy"] == "fixed" and v[f"K={k}"]["k_per_request"] is False
               for k in policy.FIXED_KS)


def test_the_best_fixed_k_is_picked_on_the_other_repeats():
    """Judged on repeat 0, the pick is K=2 (best on repeats 1-2), not K=1, which repeat 0 alone
    favours (picked on the same run, adaptive would read 0.8 there); on repeats 1 and 2, K=1."""
    runs = _runs({"plain": [100, 100, 100], "K=1": [150, 100, 100], "K=2": [90, 140, 140],
                  policy.ADAPTIVE: [120, 130, 130], policy.AA: [120, 130, 130]})
    r = policy.ratios(runs)["end_to_end"]
    assert r["adaptive_vs_best_fixed"]["max"] == pytest.approx(120 / 90)  # repeat 0 against K=2, held out
    assert r["adaptive_vs_best_fixed"]["median"] == pytest.approx(1.3)
    assert r["adaptive_vs_plain"]["median"] == pytest.approx(1.3)
    assert r["aa"] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 3}


def test_the_table_leads_with_end_to_end_and_gives_the_geometric_means():
    runs = _runs({"plain": [100, 100], "K=1": [110, 110], policy.ADAPTIVE: [120, 121]})
    payload = {"tokens": 4, "repeats": 2, "cells": {"hybrid:mix:16": {"ratios": policy.ratios(runs)}}}
    text = "\n".join(policy.table(payload))
    assert "| hybrid | mix | 16 | 1.205" in text and "adaptive ÷ plain 1.205" in text
    machine = {"cpu": "AMD EPYC", "cpu_flags": ["avx2"], "time": "2026-12-02 23:07:51"}
    assert "AMD EPYC [avx2], measured 2026-12-02." in "\n".join(policy.table({**payload, "machine": machine}))


def test_a_smoke_run_of_the_grid(tmp_path, monkeypatch):
    monkeypatch.setattr("bench.common.RESULTS", tmp_path)
    policy.main(["--smoke", "--variants", "plain", "K=1", "adaptive", "per-request", "--out", "policy_smoke"])
    r = json.loads((tmp_path / "policy_smoke.json").read_text())
    assert set(r["cells"]) == {"hybrid:mix:2"}
    for row in r["cells"].values():
        assert set(row["variants"]) == {"plain", "K=1", "adaptive", "per-request"}
        assert row["ratios"]["end_to_end"]["adaptive_vs_plain"]["n"] == 2
