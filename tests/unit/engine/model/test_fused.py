"""The fused kernels (engine/model/kernels/fused.py, on CPU under Triton's interpreter) against the
eager forward: every family's greedy tokens and logits to float32 tolerance, alone, batched,
speculative and from captured passes; the aten operations a decode step dispatches per layer,
counted before and after; the load-time check's fallback, with its warning."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM
from engine.config import EngineConfig, ModelPlan
from engine.model.fused_check import fused_on
from engine.model.loader import load_model
from engine.model.passes import forward_chunks
from tests.helpers import FAMILIES, greedy, make_model, pool_for

PROMPTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    def", "for i in range(10):\n"]
COMMON = dict(dtype="float32", max_seq_len=128, max_batch_size=4, forward_plan="torch")


@pytest.fixture(scope="module")
def families(tmp_path_factory, tok_dir):
    out = {}
    for name, kw in FAMILIES.items():
        path = tmp_path_factory.mktemp(f"fused_{name}")
        make_model(path, tok_dir, seed=2, **{**kw, "head_dim": 16})
        out[name] = path
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fused_logits_and_greedy_tokens_equal_eager(families, name):
    path = families[name]
    eager, fused = (load_model(path, ModelPlan("float32"), "cpu", 256) for _ in range(2))
    fused.fused = True
    ids = [[5, 9, 2, 17, 3, 8], [7, 7, 21, 6, 40, 2]]
    got, want = [], []
    for model, out in ((eager, want), (fused, got)):
        pool = pool_for(model, "paged", block_size=4)
        slots = [pool.allocate_slot([])[0] for _ in ids]
        out.append(forward_chunks(model, pool, slots, ids, [0, 0], all_logits=True))  # prefill [2, 6, V]
        out.append(forward_chunks(model, pool, slots, [[3], [4]], [6, 6]))  # a decode step [2, V]
        out.append(forward_chunks(model, pool, slots, [[1, 2, 3], [9, 9, 9]], [7, 7], all_logits=True))  # a verify
        out.append(forward_chunks(model, pool, slots, [[5, 6, 7], [8]], [10, 10], all_logits=True))  # packed
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
    plain = LLM(model=str(path), fused_kernels="off", **COMMON)
    on = LLM(model=str(path), fused_kernels="on", **COMMON)
    assert on.engine.fused_kernels == {"target": "fused"} and on.engine.model.fused
    assert [o.token_ids for o in on.generate(PROMPTS, greedy(16))] == \
        [o.token_ids for o in plain.generate(PROMPTS, greedy(16))]


def test_speculative_and_captured_passes_with_fused_kernels_equal_plain(tiny_model, tiny_draft):
    plain = [o.token_ids for o in LLM(model=str(tiny_model[0]), **COMMON).generate(PROMPTS, greedy(20))]
    llm = LLM(model=str(tiny_model[0]), draft_model=str(tiny_draft[0]), spec_policy="fixed", spec_length=3,
              fused_kernels="on", cuda_graphs="on", **COMMON)
    assert llm.engine.fused_kernels == {"target": "fused", "draft": "fused"}
    outs = llm.generate(PROMPTS, greedy(20))
    assert [o.token_ids for o in outs] == plain and sum(o.num_spec_rounds for o in outs) > 0
    assert llm.engine.model.graphs.replays > 0


VIEWS = {"view", "reshape", "transpose", "unsqueeze", "squeeze", "select", "slice", "expand", "permute", "t", "alias",
         "_unsafe_view", "detach", "split", "chunk", "unbind", "as_strided", "split_with_sizes"}
ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided"}


class Launches(TorchDispatchMode):
    """Counts each aten operation dispatched by its name, and each fused kernel launched as one
    (its interpreter's own torch calls, CPU only, not counted)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class CountedLaunch:
    def __init__(self, kernel, mode: Launches):
        self.kernel, self.mode = kernel, mode

    def __getitem__(self, grid):
        from torch.utils._python_dispatch import _disable_current_modes

        def launch(*args, **kwargs):
            self.mode.ops["fused kernel"] += 1
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)
        return launch


def decode_step_ops(path, fused: bool, monkeypatch) -> Counter:
    """What one batch-2 decode step of the checkpoint at `path` dispatches."""
    from engine.model.kernels import fused as kernels

    model = load_model(path, ModelPlan("float32"), "cpu", 256)
    model.fused = fused
    pool = pool_for(model, "paged", block_size=4)
    slots = [pool.allocate_slot([])[0] for _ in range(2)]
    forward_chunks(model, pool, slots, [[5, 9, 2], [7, 7, 21]], [0, 0])
    mode, real = Launches(), kernels.kernels()
    monkeypatch.setattr(kernels, "kernels", lambda: tuple(CountedLaunch(k, mode) for k in real))
    with mode:
        forward_chunks(model, pool, slots, [[3], [4]], [3, 3])
    monkeypatch.setattr(kernels, "kernels", lambda: real)
    return mode.ops


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_decode_step_dispatches_fewer_operations_per_layer(tmp_path, tok_dir, monkeypatch, name):
    """The proxy for kernels per step that CPU can count: a layer's share of a decode step (a
    two-layer model's operations less a one-layer one's), every aten operation and those that
    compute (no views, no allocations; a fused kernel counts one), eager against fused."""
    for layers in (1, 2):
        make_model(tmp_path / str(layers), tok_dir, seed=2, layers=layers, **{**FAMILIES[name], "head_dim": 16})
    per_layer = {}
    for fused in (False, True):
        one, two = (decode_step_ops(tmp_path / str(n), fused, monkeypatch) for n in (1, 2))
        layer = two - one
        per_layer[fused] = (sum(layer.values()),
                            sum(n for op, n in layer.items() if op not in VIEWS | ALLOCATIONS))
    print(f"{name}: aten operations per layer per decode step, all / computing: eager {per_layer[False]}, "
          f"fused {per_layer[True]}")
    assert per_layer[True][0] <= 0.65 * per_layer[False][0] and per_layer[True][1] <= 0.5 * per_layer[False][1]


def test_the_setting_is_validated_and_auto_fuses_on_cuda_only():
    with pytest.raises(ValueError, match="fused_kernels"):
        EngineConfig(fused_kernels="yes")
    assert fused_on("auto", "cuda:0") and fused_on("on", "cpu") and not fused_on("auto", "cpu")
    assert not fused_on("off", "cuda")


@pytest.mark.parametrize("fault", ["raises", "differs"])
def test_a_kernel_that_fails_or_differs_leaves_the_model_eager(tiny_model, monkeypatch, caplog, fault):
    from engine.model.kernels import fused as kernels

    def broken(gate_up):
        if fault == "raises":
            raise RuntimeError("no kernel for these inputs")
        return torch.zeros(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    monkeypatch.setattr(kernels, "silu_mul", broken)
    with caplog.at_level(logging.WARNING, logger="engine.startup"):
        llm = LLM(model=str(tiny_model[0]), fused_kernels="on", **COMMON)
    why = llm.engine.fused_kernels["target"]
    assert why.startswith("eager: ") and ("no kernel" if fault == "raises" else "differs from eager") in why
    assert not llm.engine.model.fused
    assert any("runs eager" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert llm.generate(PROMPTS[0], greedy(8))[0].token_ids
