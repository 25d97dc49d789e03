"""Quantized checkpoints in each published layout (tests/quantized_checkpoints.py: packed by
compressed-tensors, or by GPTQ's and AWQ's documented layouts) run in our forward without being
dequantized into a dense model: logits against transformers on the same checkpoint where it reads
the format (FP8, compressed-tensors), else against the weights the layout stands for; the bit
layouts pinned word by word; the bytes they take; speculation over them exact."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelPlan
from engine.model.linears import onednn_reorders
from engine.model.loader import load_model
from engine.model.passes import forward_chunks
from engine.model.quant.layouts import _awq_unpack
from engine.model.quant.linear import QuantLinear, word_values
from tests import quantized_checkpoints as qc
from tests.exactness import chi2_pvalue, exact_marginals, make_pair, sample_speculative
from tests.helpers import greedy, make_eagle3_head, make_model, pool_for

TRANSFORMERS_READS = ("qwen_fp8", "ct_fp8_dynamic", "ct_w4a16", "ct_w4a16_asym", "ct_w8a16")


@pytest.fixture(scope="module")
def dense(tmp_path_factory, tok_dir):
    path = tmp_path_factory.mktemp("dense")
    make_model(path, tok_dir, seed=3, **qc.SHAPE)
    return path


@pytest.fixture(scope="module")
def checkpoints(dense, tmp_path_factory):
    """layout -> (quantized checkpoint, dense reference)."""
    out = tmp_path_factory.mktemp("quantized")
    return {layout: qc.write(dense, out, layout) for layout in qc.LAYOUTS}


def _reference(layout: str, quantized, reference):
    """transformers on the quantized checkpoint itself where it reads the format, else on the dense weights."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    if layout not in TRANSFORMERS_READS:
        return AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    config = FineGrainedFP8Config(dequantize=True) if layout == "qwen_fp8" else CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32, quantization_config=config).eval()


@pytest.mark.parametrize("layout", qc.LAYOUTS)
def test_logits_match_the_reference_under_teacher_forcing(checkpoints, layout):
    quantized, reference = checkpoints[layout]
    ours = load_model(quantized, ModelPlan("float32"), "cpu", max_positions=256)
    assert ours.quantized
    hf = _reference(layout, quantized, reference)
    ids = torch.randint(0, hf.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits  # [2, 96, vocab]
    pool = pool_for(ours, "paged", block_size=8)
    slots = [pool.allocate_slot([])[0] for _ in range(2)]
    got = [forward_chunks(ours, pool, slots, [ids[i, :64].tolist() for i in range(2)], [0, 0], all_logits=True)]
    got += [forward_chunks(ours, pool, slots, [[ids[i, p].item()] for i in range(2)], [p] * 2)[:, None]
            for p in range(64, 96)]  # decode steps, one token a row
    got = torch.cat(got, dim=1)  # [2, 96, vocab]
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    error = (got - expected).abs().max().item()
    print(f"{layout}: top-1 agreement {agreement:.4f}, largest logit error {error:.2e}")
    assert agreement >= 0.99 and error < 1e-3


def test_the_bit_layouts_word_by_word():
    """Single words as each layout documents them (element i in bits 4i; AWQ's nibble order)."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert word_values(word, 4, 8).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]  # GPTQ down the inputs, ct along them
    assert _awq_unpack(word, 8).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]  # nibble i -> column AWQ_ORDER[i]
    assert word_values(torch.tensor([[0x04030201]], dtype=torch.int32), 8, 4).tolist() == [[1, 2, 3, 4]]
    assert qc.to_words(torch.tensor([[0, 4, 1, 5, 2, 6, 3, 7]]), qc.AWQ_ORDER).tolist() == [[0x76543210]]


def test_a_quantized_linear_runs_its_stored_form_not_a_dense_copy(checkpoints):
    """On CPU, 4-bit groups of 128 and symmetric 8-bit channels run torch's int kernels: no
    float weight is kept; FP8 keeps its e4m3 bytes."""
    forms = {}
    for layout in ("ct_w4a16", "gptq", "ct_w8a16", "qwen_fp8"):
        model = load_model(checkpoints[layout][0], ModelPlan("float32"), "cpu", 256)
        down = model.layers[0].down
        assert isinstance(down, QuantLinear)
        forms[layout] = {t.dtype for t in (down._prepared or (down.data,))}
    assert torch.uint8 in forms["ct_w4a16"] and torch.uint8 in forms["gptq"]  # int4 packed for the kernel
    assert torch.int8 in forms["ct_w8a16"]
    assert forms["qwen_fp8"] == {torch.float8_e4m3fn}


@pytest.mark.parametrize("layout,most", [("qwen_fp8", 0.52), ("ct_fp8_dynamic", 0.52), ("ct_w4a16", 0.28),
                                         ("gptq", 0.28), ("awq", 0.28)])
def test_quantized_linears_take_their_share_of_the_bf16_bytes(checkpoints, layout, most):
    """Bytes of the quantized linears with their scales and zero points, against bf16, as loaded for bf16."""
    model = load_model(checkpoints[layout][0], ModelPlan("bfloat16"), "cpu", 256)
    linears = [w for lw in model.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    ratio = sum(w.nbytes for w in linears) / sum(2 * w.numel() for w in linears)
    whole = model.weight_bytes / (2 * model.num_parameters)
    print(f"{layout}: linears {ratio:.3f} of bf16, whole model {whole:.3f}")
    assert ratio <= most


@pytest.mark.parametrize("layout", ["gptq_act_order_asym", "qwen_fp8"])
def test_speculation_over_a_quantized_target_equals_its_plain_greedy_output(checkpoints, dense, tiny_draft, tmp_path,
                                                                              layout):
    """A float draft (chains, trees, the adaptive policy) and a float EAGLE-3 head over a quantized
    target: the target's own greedy tokens."""
    target = str(checkpoints[layout][0])
    head = tmp_path / "head"
    make_eagle3_head(head, dense, seed=3, aux=[0, 1, 1])
    prompts = ["def add(a, b):", "for i in range(10):\n", "x"]
    plain = [o.token_ids for o in LLM(model=target, dtype="float32", max_seq_len=128).generate(prompts, greedy(24))]
    runs = [dict(draft_model=str(tiny_draft[0]), spec_policy="fixed"),
            dict(draft_model=str(tiny_draft[0]), spec_policy="fixed", tree_width=3, tree_tokens=8),
            dict(draft_model=str(tiny_draft[0]), spec_policy="adaptive"),
            dict(draft_model=str(head), speculative_method="eagle", spec_policy="fixed")]
    for run in runs:
        llm = LLM(model=target, spec_length=3, dtype="float32", max_seq_len=128, **run)
        out = llm.generate(prompts, greedy(24))
        assert [o.token_ids for o in out] == plain, run


def test_sampled_speculation_over_a_quantized_target_follows_its_distribution(tmp_path, tok_dir):
    """Chi-square against the quantized target's exact marginals (transformers on the weights the
    AWQ layout stands for, groups of 32 as its inputs are 32 wide); the same samples against the
    dense model the quantization came from are rejected: the test tells the two apart."""
    from transformers import AutoModelForCausalLM

    make_pair(tmp_path / "t", tmp_path / "d", tok_dir, "qwen3")
    quantized, reference = qc.write(tmp_path / "t", tmp_path, "awq", group_size=32)
    params = SamplingParams(temperature=1.0)
    m2, m3 = exact_marginals(AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval(), params)
    tokens, acceptance = sample_speculative(quantized, tmp_path / "d", params)
    assert 0.1 < acceptance < 0.95
    p_quantized = min(chi2_pvalue(tokens[:, 1], m2), chi2_pvalue(tokens[:, 2], m3))
    dense2, dense3 = exact_marginals(AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32), params)
    p_dense = min(chi2_pvalue(tokens[:, 1], dense2), chi2_pvalue(tokens[:, 2], dense3))
    print(f"p against the quantized target {p_quantized:.3g}, against the dense one {p_dense:.3g}")
    assert p_quantized > 1e-3 and p_dense < 1e-3


def test_the_weights_bytes_and_format_are_reported(checkpoints, dense):
    quantized = LLM(model=str(checkpoints["ct_w4a16"][0]), dtype="bfloat16", max_seq_len=64)
    plain = LLM(model=str(dense), dtype="bfloat16", max_seq_len=64)
    weights = quantized.engine.stats()["weights"]["target"]
    computes = "bfloat16" if onednn_reorders(torch.bfloat16) else "float32"  # a CPU without bf16 kernels computes in float32
    assert weights == {"bytes": quantized.engine.model.weight_bytes, "format": f"int4 group 128 + {computes}"}
    assert weights["bytes"] < 0.5 * plain.engine.stats()["weights"]["target"]["bytes"]


@pytest.mark.parametrize("form", ["fp8 block", "fp8 channel", "int4 group", "int4 act-order"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_gpu_kernels_read_the_stored_form(form, rows):
    """The Triton kernels CUDA runs for decode and verify widths (here under Triton's interpreter)
    against the dequantized weight."""
    from engine.model.kernels import quant
    from engine.model.quant.linear import int4_words

    g = torch.Generator().manual_seed(rows)
    N, K = 192, 256
    if form.startswith("fp8"):
        data = (torch.randn(N, K, generator=g) * 100).to(torch.float8_e4m3fn)
        block = (128, 128) if form == "fp8 block" else (1, K)
        scale = torch.rand(-(-N // block[0]), K // block[1], generator=g) / 100
        layer = QuantLinear("fp8", data, scale, (N, K), block=block)
    else:
        q = torch.randint(0, 16, (N, K), generator=g)
        perm = torch.randperm(K, generator=g) if form == "int4 act-order" else None
        layer = QuantLinear("int", int4_words(q), torch.rand(N, 2, generator=g).half(), (N, K), bits=4,
                            zero=torch.randint(0, 16, (N, 2), generator=g, dtype=torch.uint8), group=128, perm=perm)
    x = torch.randn(rows, K, generator=g)
    kernel = quant.fp8_linear if form.startswith("fp8") else quant.int4_linear
    got = kernel(x if layer.perm is None else x[:, layer.perm], layer)
    expected = (x if layer.perm is None else x[:, layer.perm]) @ layer.dequantize().T
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


def test_act_order_without_its_g_idx_is_refused(checkpoints, tmp_path):
    """desc_act says the groups follow g_idx: without it the input order is unknown, not assumed."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "no_g_idx"
    shutil.copytree(checkpoints["gptq_act_order_asym"][0], path)
    tensors = {n: t for n, t in load_file(path / "model.safetensors").items() if not n.endswith("g_idx")}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"quantization_config\.desc_act is true but .*g_idx is missing"):
        load_model(path, ModelPlan("float32"), "cpu", 64)
