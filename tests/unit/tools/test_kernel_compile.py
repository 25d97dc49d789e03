"""Every Triton kernel compiled ahead of time for the GPUs it claims (tools/kernel_compile.py), on
this CPU-only machine: no compile error on a claimed target, no spill, shared memory within the
target's, at most 128 registers a thread, no TF32 for float32 inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tools.kernel_compile import MAX_REGISTERS, Launch, Result, judge  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """The suite's scope of the check (--quick), in its own process: the compiler, not the interpreter."""
    out = tmp_path_factory.mktemp("kernel_compile") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tools.kernel_compile", "--quick", "--json", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert out.exists(), done.stderr[-3000:]
    return {"rc": done.returncode, "stderr": done.stderr, **json.loads(out.read_text())}


def test_every_kernel_compiles_for_every_target_it_claims_within_its_limits(compiled):
    from engine.model.kernels import fused, moe, quant

    failed = [f"{r['label']} {r['target']}: {r['problems']}" for r in compiled["rows"] if r["problems"]]
    assert not failed and compiled["rc"] == 0, "\n".join(failed) or compiled["stderr"][-2000:]
    seen = {(r["kernel"], r["target"]) for r in compiled["rows"]}
    for module, prefix in ((fused, "fused"), (moe, "moe"), (quant, "quant")):
        for name, needs in module.CAPABILITIES.items():
            kernel = f"{prefix}.{'fp8' if name == 'fp8_from_bits' else name}"
            for cap in (80, 86, 89, 90):
                if (cap // 10, cap % 10) >= needs:
                    assert (kernel, f"sm_{cap}") in seen, (kernel, cap)


def test_fp8_claims_the_hardware_conversion_from_sm89_only_and_its_bits_below(compiled):
    native = {r["target"] for r in compiled["rows"] if r["kernel"] == "quant.fp8" and ", NATIVE]" in r["label"]}
    from_bits = {r["target"] for r in compiled["rows"] if r["kernel"] == "quant.fp8" and ", NATIVE]" not in r["label"]}
    assert "sm_80" not in native and "sm_86" not in native and {"sm_89", "sm_90"} <= native
    assert {"sm_80", "sm_86", "sm_89", "sm_90"} <= from_bits


def test_int4_reads_each_word_once_without_spills(compiled):
    """Before: 208-218 registers and 816-1,292 spilled bytes a thread under triton 3.9 on sm_89/90."""
    rows = [r for r in compiled["rows"] if r["kernel"] == "quant.int4" and r["target"] in ("sm_89", "sm_90")]
    assert rows and all(r["spill_bytes"] == 0 and r["registers"] <= MAX_REGISTERS for r in rows)


def test_float32_inputs_multiply_in_ieee_float32(compiled):
    rows = [r for r in compiled["rows"] if "[float32" in r["label"] and r["kernel"] in ("quant.fp8", "quant.int4",
                                                                                       "moe.grouped")]
    assert rows and not any(r["tf32"] for r in rows)


def _launch(kernel: str = "quant.int4", dtype: str = "bfloat16") -> Launch:
    import torch

    x = torch.empty(1, 16, dtype=getattr(torch, dtype), device="meta")
    return Launch(kernel, None, (1,), (x,), {}, (8, 0))


@pytest.mark.parametrize("result, problem", [
    (Result(error="CompilationError: fp8e4nv"), "does not compile"),
    (Result(registers=96, spill_bytes=8, shared=0), "spills 8 bytes"),
    (Result(registers=168, shared=0), "168 registers"),
    (Result(registers=64, shared=200_000), "shared memory 200000"),
])
def test_the_check_fails_each_limit(result, problem):
    assert any(problem in p for p in judge(_launch(), 86, result))
    assert judge(_launch(), 86, Result(registers=64, shared=1024)) == []


def test_tf32_fails_only_a_float32_kernel():
    assert judge(_launch(dtype="float32"), 90, Result(registers=64, shared=0, tf32=True))
    assert not judge(_launch(dtype="bfloat16"), 90, Result(registers=64, shared=0, tf32=True))
