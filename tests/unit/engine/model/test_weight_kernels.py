"""The Triton kernels that read quantized weights and experts (kernels/quant.py, kernels/moe.py),
chosen at load by the device's compute capability and checked on a probe (weight_kernels.py),
here under Triton's interpreter with the capability faked: FP8 below sm_89 converts e4m3 from its
bits; a failing kernel is reported under its own name and its layers take the dequantized path;
each row's result is the same whatever rows share the pass (the K split fixed by the weight)."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM
from engine.model import weight_kernels
from engine.model.experts import Experts
from engine.model.kernels import quant
from engine.model.quant.linear import QuantLinear, int4_words
from tests import quantized_checkpoints as qc
from tests.helpers import greedy, make_model

COMMON = dict(dtype="float32", max_seq_len=64, max_batch_size=2, cuda_graphs="off")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory, tok_dir):
    dense = tmp_path_factory.mktemp("dense")
    make_model(dense, tok_dir, seed=3, **qc.SHAPE)
    return qc.write(dense, tmp_path_factory.mktemp("fp8"), "qwen_fp8")[0]


def test_fp8_on_a_faked_sm80_loads_converts_from_the_bits_and_logs_it(fp8_checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(weight_kernels, "device_capability", lambda device: (8, 0))
    with caplog.at_level(logging.INFO):
        llm = LLM(model=str(fp8_checkpoint), quant_kernels="on", **COMMON)
    path = "triton fp8 (e4m3 from its bits)"
    assert llm.engine.stats()["weight_kernels"]["target"]["quant"] == f"fp8 block 128x128: {path}"
    assert any("weight kernels" in r.getMessage() and path in r.getMessage() for r in caplog.records)
    dequantized = LLM(model=str(fp8_checkpoint), quant_kernels="off", **COMMON)
    assert dequantized.engine.stats()["weight_kernels"]["target"]["quant"] == "fp8 block 128x128: dequantized"
    assert llm.generate(["def add(a, b):"], greedy(4))[0].token_ids == \
        dequantized.generate(["def add(a, b):"], greedy(4))[0].token_ids


@pytest.mark.parametrize("capability, path", [((8, 0), "triton fp8 (e4m3 from its bits)"), ((8, 6), "triton fp8 (e4m3 "
                                              "from its bits)"), ((8, 9), "triton fp8"), ((9, 0), "triton fp8")])
def test_the_capability_picks_the_fp8_kernel(capability, path):
    layer = _layers(torch.Generator().manual_seed(0))["fp8"]
    assert layer.prepare(torch.float32, triton=True, capability=capability).path == path
    assert layer.prepare(torch.float32, triton=False).path == "dequantized"


def test_a_failing_kernel_is_reported_under_its_own_name(fp8_checkpoint, monkeypatch):
    def broken(x, layer, native=True):
        raise RuntimeError("no kernel image for this device")
    monkeypatch.setattr(quant, "fp8_linear", broken)
    llm = LLM(model=str(fp8_checkpoint), quant_kernels="on", fused_kernels="on", **COMMON)
    stats = llm.engine.stats()
    assert stats["weight_kernels"]["target"]["quant"] == (
        "fp8 block 128x128: dequantized (triton fp8: failed: RuntimeError: no kernel image for this device)")
    assert stats["fused_kernels"] == {"target": "fused"}  # not blamed on the fused kernels
    assert len(llm.generate(["def f():"], greedy(3))[0].token_ids) == 3


def _layers(g: torch.Generator) -> dict[str, QuantLinear]:
    N, K = 192, 256
    fp8 = QuantLinear("fp8", (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn),
                      torch.rand(-(-N // 128), K // 128, generator=g) / 100, (N, K), block=(128, 128))
    int4 = QuantLinear("int", int4_words(torch.randint(0, 16, (N, K), generator=g)), torch.rand(N, 2, generator=g).half(),
                       (N, K), bits=4, zero=torch.randint(0, 16, (N, 2), generator=g, dtype=torch.uint8), group=128)
    small = QuantLinear("int", int4_words(torch.randint(0, 16, (N, K), generator=g)), torch.rand(N, 8, generator=g),
                        (N, K), bits=4, zero=torch.randint(0, 16, (N, 8), generator=g, dtype=torch.uint8), group=32)
    return {"fp8": fp8, "int4": int4, "int4 group 32": small}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["fp8 native", "fp8 from bits", "int4", "int4 group 32"])
def test_each_row_is_the_same_whatever_rows_share_the_pass(form, dtype):
    """Row r of a 33-row pass equals row r alone, bitwise, with K split (this weight splits in 2 at
    the interpreter's 4 SMs); both equal the dequantized weight's product. Half precision in fp16:
    triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 bits (a CPU-only fault)."""
    g = torch.Generator().manual_seed(1)
    layer = _layers(g)[form.removesuffix(" native").removesuffix(" from bits")]
    assert quant.splits(layer.shape[0], layer.shape[1], 64, 128, quant.INTERPRETER_SMS)[0] > 1
    x = torch.randn(33, layer.shape[1], generator=g).to(dtype)
    if form.startswith("fp8"):
        run = (lambda rows: quant.fp8_linear(rows, layer, native=form == "fp8 native"))  # noqa: E731
    else:
        run = (lambda rows: quant.int4_linear(rows, layer))  # noqa: E731
    together = run(x)
    for r in (0, 5, 16, 32):
        assert torch.equal(run(x[r:r + 1]), together[r:r + 1]), r
    assert torch.equal(run(x[:5]), together[:5])
    want = x.float() @ layer.dequantize().T
    torch.testing.assert_close(together.float(), want, **(dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32
                                                           else dict(atol=0.5, rtol=2e-2)))


def test_from_bits_reads_every_e4m3_value_as_the_hardware_does():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    every = every[~every.float().isnan()]  # [254]: e4m3fn's NaNs carry no weight
    layer = QuantLinear("fp8", every[None].repeat(16, 1)[:, :240].contiguous(), torch.ones(1, 1), (16, 240),
                        block=(16, 240))
    eye = torch.eye(240)
    torch.testing.assert_close(quant.fp8_linear(eye, layer, native=False).T, every[:240].float()[None].repeat(16, 1),
                               atol=0, rtol=0)


def test_an_8b_projection_at_batch_1_launches_twice_the_sms_in_programs():
    """H200: 132 SMs. The split is fixed by (N, K) alone: every pass of that weight splits alike."""
    for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        count, per = quant.splits(N, K, 64, 128, 132)
        assert -(-N // 64) * count >= 2 * 132 and (count - 1) * per < -(-K // 128) <= count * per


def test_the_experts_kernel_is_probed_and_a_failure_named(monkeypatch):
    g = torch.Generator().manual_seed(0)
    layer = Experts(torch.randn(16, 64, generator=g), torch.randn(16, 64, 64, generator=g) / 8,
                    torch.randn(16, 64, 32, generator=g) / 6, top_k=4, norm_topk=True)
    assert weight_kernels._probe_experts(layer, torch.float32) is None
    from engine.model.kernels import moe
    monkeypatch.setattr(moe, "experts", lambda x, ids, gate_up, down: torch.zeros(x.shape[0], ids.shape[1], x.shape[1]))
    assert "differs from the host-grouped experts" in weight_kernels._probe_experts(layer, torch.float32)
