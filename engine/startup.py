"""Start-up: what an engine is built from, in order (checkpoints and shapes, the models with their
forward plans, KV pools sized from free memory, in-place attention and CUDA graphs each behind a
load-time check, speculation with its calibrated costs), each phase timed and logged."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.kv import KVManager
from engine.kv.features import MAX_PENDING, FeatureCache
from engine.kv_sizing import activation_bytes, default_max_seq_len, kv_bytes_per_token, pool_blocks
from engine.model.attention import FEW_QUERY_ROWS
from engine.model.cuda_graphs import (
    Capture,
    CaptureReport,
    PassKind,
    capture_checked,
    default_capture,
    graphs_on,
    head_pass,
    target_pass,
    tolerance,
)
from engine.model.eagle3 import Eagle3Head, is_eagle3, load_eagle3, read_head_shape
from engine.model.fused_check import check_fused, fused_on
from engine.model.invariance import choose_invariance
from engine.model.loader import read_shape, resolve_model_path
from engine.model.paged_attention import PagedAttention, check_inplace, inplace_on
from engine.model.passes import padded_length, pool_for
from engine.model.plan import cache_file, device_memory, load_planned, load_planned_head, summary
from engine.model.transformer import Transformer
from engine.model.weight_kernels import choose_moe, choose_quant
from engine.runner import ModelRunner
from engine.speculative.policy.calibration import Calibration
from engine.speculative.policy.costs import REFIT_EVERY, MeasuredCosts
from engine.speculative.proposers.draft_model import check_compatible
from engine.speculative.proposers.registry import ProposerSources
from engine.speculative.proposers.suffix import SuffixCache
from engine.speculative.step import SpeculativeDecoder
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class _PhaseClock:
    """Times start-up phases one after another, logging each as it ends."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def done(self, phase: str, message: str, *args) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self.last, 3)
        self.last = now
        log.info(f"start-up: {message} in %.2f s", *args, self.seconds[phase])

    def total(self) -> float:
        return time.perf_counter() - self.started


@dataclass
class EngineParts:
    """What start-up built, for LLMEngine."""

    tokenizer: Tokenizer
    model: Transformer
    draft_model: Transformer | Eagle3Head | None
    kv: KVManager
    runner: ModelRunner
    forward_plan: dict  # each model's plan (engine/model/plan.py), as stats report it
    paged_attention: dict[str, str]  # model role -> "inplace", or why it gathers ({}: gather)
    fused_kernels: dict[str, str]  # model role -> "fused", or why it runs eager ({}: off)
    batch_invariant: str  # "on", or "off: why" (engine/model/invariance.py)
    weight_kernels: dict[str, dict[str, str]]  # model role -> {"quant" / "moe": the path its layers took}
    weights: dict[str, dict]  # model role -> {"bytes": on the device, "format": e.g. "int4 group 128 + bfloat16"}
    cuda_graphs: dict[str, CaptureReport]  # model role -> what capture did ({}: off)
    speculation: SpeculativeDecoder | None
    seconds: dict[str, float] = field(default_factory=dict)  # each phase's


def build(config: EngineConfig, free_memory: Callable[[str], int], defer_calibration: bool = False,
          graph_capture: Capture | None = None) -> EngineParts:
    """The engine's parts for `config` (written back into it: resolved paths, max_seq_len,
    num_kv_blocks). free_memory(device): bytes the device can still allocate; defer_calibration:
    measure the adaptive policy's costs at batch 1 now and its other calibration sizes later; graph_capture:
    how a CUDA graph is recorded (tests inject failing ones)."""
    return _Startup(config).run(free_memory, defer_calibration, graph_capture)


class _Startup:
    def __init__(self, config: EngineConfig):
        self.config = config

    def run(self, free_memory: Callable[[str], int], defer_calibration: bool,
            graph_capture: Capture | None) -> EngineParts:
        config = self.config
        if config.device == "cpu" and config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        clock = _PhaseClock()
        self.tokenizer, model_path, draft_path = self._resolve_checkpoints()
        clock.done("checkpoints", "resolved %s (tokenizer, shapes, max_seq_len %d)", model_path, config.max_seq_len)
        self.model, self.draft_model = self._load_models(model_path, draft_path)
        self.weights = {role: {"bytes": m.weight_bytes, "format": m.weight_format}
                        for role, m in (("target", self.model), ("draft", self.draft_model)) if m is not None}
        clock.done("models", "loaded the target%s, each with its forward plan; weights: %s",
                   " and the draft" if self.draft_model is not None else "",
                   ", ".join(f"{r} {w['bytes'] / 2**20:.1f} MiB ({w['format']})" for r, w in self.weights.items()))
        self.weight_kernels = self._choose_weight_kernels()  # before any probe runs a pass
        if self.weight_kernels:
            clock.done("weight_kernels", "weight kernels: %s", self.weight_kernels)
        config.num_kv_blocks = self._kv_blocks(free_memory(config.device))
        pool = functools.partial(pool_for, max_slots=config.max_batch_size, max_seq_len=config.max_seq_len,
                                 backend=config.kv_cache_backend, block_size=config.block_size,
                                 num_blocks=config.num_kv_blocks)  # the draft's is never shared: no prefix cache
        self.kv = KVManager(pool(self.model, prefix_caching=config.enable_prefix_caching),
                            pool(self.draft_model) if self.draft_model is not None else None,
                            FeatureCache() if isinstance(self.draft_model, Eagle3Head) else None)
        self.runner = ModelRunner(self.model, self.kv, config.logprobs_mode)
        clock.done("kv_pools", "KV pools: %s blocks of %d tokens each model", config.num_kv_blocks, config.block_size)
        self.paged_attention = self._read_in_place()  # model role -> "inplace", or why it gathers ({}: gather)
        if self.paged_attention:
            clock.done("paged_attention", "paged_attention: %s", self.paged_attention)
        self.fused_kernels = self._fuse()  # model role -> "fused", or why eager ({}: off)
        if self.fused_kernels:
            clock.done("fused_kernels", "fused_kernels: %s", self.fused_kernels)
        self.batch_invariant = choose_invariance(self.model, config.batch_invariant, config.use_speculative_decoding,
                                                 self._rule_cost_cache())
        clock.done("batch_invariant", "batch_invariant: %s (the target's rows %s)", self.batch_invariant,
                   "independent of their pass: speculation = plain bitwise" if self.batch_invariant == "on"
                   else "may differ with their pass")
        self.cuda_graphs = self._capture_graphs(graph_capture)  # model role -> what capture did ({}: off)
        if self.cuda_graphs:
            clock.done("cuda_graphs", "cuda_graphs: %s", ", ".join(
                f"{role} {r.graphs} graphs" if r.fallback is None else f"{role} eager" for role, r in self.cuda_graphs.items()))
        self.speculation = self._build_speculation(defer_calibration) if config.use_speculative_decoding else None
        calibration = self.speculation.planner.calibration if self.speculation is not None else None
        if calibration is not None:
            clock.done("calibration", "adaptive policy's costs %s (%d passes%s)", calibration.source,
                       calibration.passes, f"; batch {calibration.pending} when first needed" if calibration.pending else "")
        log.info("engine built in %.1f s (%s)", clock.total(),
                 ", ".join(f"{name} {seconds:.1f} s" for name, seconds in clock.seconds.items()))
        return EngineParts(self.tokenizer, self.model, self.draft_model, self.kv, self.runner, self.forward_plan,
                           self.paged_attention, self.fused_kernels, self.batch_invariant, self.weight_kernels, self.weights, self.cuda_graphs, self.speculation, clock.seconds)

    def _resolve_checkpoints(self):
        """Resolves model paths (written back into the config), the tokenizer and max_seq_len."""
        config = self.config
        model_path = resolve_model_path(config.model)
        config.model = str(model_path)
        target_shape = read_shape(model_path)  # refuses what the forward does not implement, before anything reads it
        tokenizer = Tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer else model_path)
        draft_path = None
        if config.use_speculative_decoding and config.speculative.needs_draft_model:
            draft_path = resolve_model_path(config.draft_model)
            config.speculative.draft_model = str(draft_path)
        shapes = [target_shape] + ([] if draft_path is None else [
            read_head_shape(draft_path) if is_eagle3(draft_path) else read_shape(draft_path)])
        if draft_path is not None and not is_eagle3(draft_path):  # a head speaks the target's vocabulary by construction
            check_compatible(tokenizer, Tokenizer(draft_path), config.model, config.draft_model)
        if config.max_seq_len is None:  # on CPU the plan may compute (and cache) in float32
            value_bytes = 4 if config.device == "cpu" else getattr(torch, config.dtype).itemsize
            config.max_seq_len = default_max_seq_len(shapes, value_bytes, config.max_batch_size,
                                                     device_memory(config.device))
            if config.kv_cache_backend == "paged" and config.num_kv_blocks is not None:
                config.max_seq_len = min(config.max_seq_len, config.num_kv_blocks * config.block_size)
        if config.max_seq_len > shapes[0].max_sequence:
            window = shapes[0].max_sequence < shapes[0].max_position_embeddings
            raise ValueError(f"max_seq_len {config.max_seq_len} exceeds the model's " + (
                f"sliding_window {shapes[0].max_sequence}: sliding-window attention is not implemented, so sequences "
                "are kept within the window" if window else f"max_position_embeddings {shapes[0].max_sequence}"))
        if config.kv_cache_backend == "paged" and config.num_kv_blocks is not None \
                and config.num_kv_blocks * config.block_size < config.max_seq_len:
            raise ValueError(f"num_kv_blocks * block_size = {config.num_kv_blocks * config.block_size} "
                             f"tokens cannot hold one sequence of max_seq_len {config.max_seq_len}")
        return tokenizer, model_path, draft_path

    def _kv_blocks(self, free_bytes: int) -> int | None:
        """Blocks per pool: num_kv_blocks if given, else what kv_cache_memory_fraction of the free
        memory holds for both models, less a head's pending features and the activations of the
        largest pass (slotted pools: checked to fit, one block per slot)."""
        c = self.config
        if c.num_kv_blocks is not None and c.kv_cache_backend == "paged":
            return c.num_kv_blocks
        if isinstance(self.draft_model, Eagle3Head):  # target features a head has yet to read, at their bound
            free_bytes -= c.max_batch_size * MAX_PENDING * self.draft_model.feature_width * self.model.dtype.itemsize
        models = [m for m in (self.model, self.draft_model) if m is not None]
        shapes, value_bytes = [m.shape for m in models], [m.dtype.itemsize for m in models]
        per_token = kv_bytes_per_token(shapes, value_bytes)
        reserve = activation_bytes(shapes, value_bytes, c.max_batch_size,
                                   c.speculative.spec_length if c.use_speculative_decoding else 0,
                                   c.max_num_batched_tokens, c.max_seq_len)
        blocks = pool_blocks(free_bytes, c.kv_cache_memory_fraction, per_token, c.block_size, c.max_batch_size,
                             c.max_seq_len, paged=c.kv_cache_backend == "paged", reserve_bytes=reserve)
        return blocks if c.kv_cache_backend == "paged" else None

    def _rule_cost_cache(self) -> Path | None:
        """Where the invariant rule's measured cost is kept (its plan's key): a plain-only engine's
        decode passes, or on CUDA a speculative engine's decode and verify passes."""
        role = "speculative_rule" if self.config.use_speculative_decoding else "plain_only_rule"
        try:
            return cache_file(Path(self.config.model), role, str(self.model.dtype), self.model.device.type)
        except OSError:
            return None

    def _load_models(self, model_path, draft_path) -> tuple[Transformer, Transformer | None]:
        """Both models, each with its forward plan (engine/model/plan.py)."""
        config = self.config
        explicit = config.explicit_plan()
        model, target_plan = load_planned(model_path, "target", config.dtype, config.device, config.max_seq_len,
                                          explicit["target"], plain=not config.use_speculative_decoding)
        self.forward_plan = {"target": target_plan.as_dict()}
        draft = None
        if draft_path is not None and is_eagle3(draft_path):  # computes in its target's dtype
            draft, draft_plan = load_planned_head(
                draft_path, read_head_shape(draft_path),
                lambda p: load_eagle3(draft_path, model, config.max_seq_len, p.token_step, p.token_step_rows),
                target_plan.plan.dtype, config.device, config.max_seq_len, explicit["draft"])
            self.forward_plan["draft"] = draft_plan.as_dict()
        elif draft_path is not None:
            draft, draft_plan = load_planned(draft_path, "draft", config.dtype, config.device, config.max_seq_len,
                                             explicit["draft"])
            self.forward_plan["draft"] = draft_plan.as_dict()
        log.info("forward plan: %s", summary(self.forward_plan))
        return model, draft

    def _read_in_place(self) -> dict[str, str]:
        """Each model's decode and verify attention reading its pool in place, where paged_attention
        asks for it on this device and a probe agrees with the gather; else it gathers, with a warning."""
        c = self.config
        if not inplace_on(c.paged_attention, c.device):
            return {}
        chosen = {}
        for role, model, pool in [("target", self.model, self.kv.target), ("draft", self.draft_model, self.kv.draft)]:
            if model is None:
                continue
            model.paged = PagedAttention(pool.storage, pool.block_size, FEW_QUERY_ROWS)
            try:
                problem = check_inplace(model, pool, tolerance(model.dtype))
            except Exception as e:  # a kernel that does not compile or run here: the gather
                problem = f"{type(e).__name__}: {e}"
            if problem is not None:
                log.warning("paged_attention: the %s gathers its keys: %s", role, problem)
                model.paged = None
            chosen[role] = "inplace" if problem is None else f"gather: {problem}"
        return chosen

    def _choose_weight_kernels(self) -> dict[str, dict[str, str]]:
        """Each model's quantized linears and experts on their Triton kernels or the fallback
        (engine/model/weight_kernels.py); roles and families without such layers are left out."""
        c, chosen = self.config, {}
        for role, model in [("target", self.model), ("draft", self.draft_model)]:
            if model is None or isinstance(model, Eagle3Head):
                continue
            paths = {"quant": choose_quant(model, c.quant_kernels, role), "moe": choose_moe(model, c.moe_kernels, role)}
            paths = {k: v for k, v in paths.items() if v is not None}
            if paths:
                chosen[role] = paths
        return chosen

    def _fuse(self) -> dict[str, str]:
        """Each model's layers on the fused kernels, where fused_kernels asks for them on this device
        and a probe agrees with eager; else eager, with a warning (an EAGLE-3 head runs its own step)."""
        c = self.config
        if not fused_on(c.fused_kernels, c.device):
            return {}
        chosen = {}
        for role, model, pool in [("target", self.model, self.kv.target), ("draft", self.draft_model, self.kv.draft)]:
            if model is None or isinstance(model, Eagle3Head):
                continue
            problem = check_fused(model, pool, tolerance(model.dtype))
            if problem is not None:
                log.warning("fused_kernels: the %s runs eager: %s", role, problem)
            chosen[role] = "fused" if problem is None else f"eager: {problem}"
        return chosen

    def _capture_graphs(self, capture: Capture | None) -> dict[str, CaptureReport]:
        """Each model's one-token passes, and with speculation its passes up to K + 1 tokens (verify,
        a draft's catch-up), captured per batch and key bucket and checked against eager
        (engine/model/cuda_graphs.py); {} where cuda_graphs is off on this device."""
        c = self.config
        if not graphs_on(c.cuda_graphs, c.device):
            return {}
        capture = capture or default_capture(self.model.device)
        spec = c.speculative
        widths = [1] + ([padded_length(spec.spec_length + 1)] if c.use_speculative_decoding else [])
        # token trees: the verify pass and the drafting passes over a tree's newest nodes, under its mask
        trees = [PassKind(padded_length(spec.tree_tokens + 1), tree=True)] \
            if c.use_speculative_decoding and spec.tree_width > 1 else []
        head = self.draft_model if isinstance(self.draft_model, Eagle3Head) else None
        layers = head.aux_layers if head is not None else ()  # the target's features the head reads
        common = dict(max_batch=c.max_batch_size, max_seq_len=c.max_seq_len, capture=capture)
        reports = {}
        self.model.graphs, reports["target"] = self._capture_role("target", self.model, lambda: capture_checked(
            "target", self.model, self.kv.target, target_pass(self.model, layers),
            [PassKind(w) for w in widths] + trees, layers=layers, **common))
        if head is not None:  # its own steps feed back its state; a round's first pass reads target features
            kinds = [PassKind(1, head.shape.hidden_size)] + [PassKind(w, head.feature_width) for w in widths[1:]] \
                + [PassKind(k.width, head.shape.hidden_size, tree=True) for k in trees]
            head.graphs, reports["draft"] = self._capture_role("draft", head, lambda: capture_checked(
                "EAGLE-3 head", head, self.kv.draft, head_pass(head), kinds, **common))
        elif self.draft_model is not None:
            draft = self.draft_model
            draft.graphs, reports["draft"] = self._capture_role("draft", draft, lambda: capture_checked(
                "draft", draft, self.kv.draft, target_pass(draft, ()), [PassKind(w) for w in widths] + trees,
                **common))
        return reports

    def _capture_role(self, role: str, model, capture):
        """capture() of one model's graphs; where it fails reading its pool in place, the model
        gathers instead and is captured again: in place is dropped, never the graphs."""
        graphs, report = capture()
        if report.fallback is not None and model.paged is not None:
            log.warning("paged_attention: the %s gathers its keys: its graphs did not capture in place (%s)",
                        role, report.fallback)
            self.paged_attention[role] = f"gather: graph capture failed in place: {report.fallback}"
            model.paged = None
            graphs, report = capture()
        return graphs, report

    def _build_speculation(self, defer_calibration: bool) -> SpeculativeDecoder:
        """The speculative decoder: its proposer from the registry, and for the adaptive policy its
        costs (cached, or measured now)."""
        costs = MeasuredCosts(refit_every=REFIT_EVERY)
        settings = self.config.speculative
        sources = ProposerSources(self.draft_model, self.kv, costs, self.model.shape.vocab_size, self.model.device,
                                  SuffixCache(settings.suffix_cache_tokens))
        decoder = SpeculativeDecoder(self.runner, self.kv, settings, sources, costs)
        if settings.spec_policy == "adaptive":
            decoder.planner.calibration = Calibration(costs, (self.model, self.kv.target),
                                              (self.draft_model, self.kv.draft) if self.draft_model is not None else None,
                                              max(settings.spec_length, 8) + 1, self.config.max_batch_size,
                                              settings.speculative_method)
            decoder.planner.calibration.start(defer=defer_calibration)
        return decoder

