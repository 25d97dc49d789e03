"""LLMEngine (add_request / step / abort) and LLM, the offline batch API."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from engine.config import EngineConfig, SamplingParams, SpecConfig, with_embedded_defaults
from engine.faults import is_device_fault
from engine.grammar import GrammarCompiler, GrammarMatcher
from engine.kv import KVManager
from engine.kv.features import MAX_PENDING, FeatureCache
from engine.kv.sizing import activation_bytes, default_max_seq_len, free_memory, kv_bytes_per_token, pool_blocks
from engine.logprobs import TokenLogprob
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
from engine.model.loader import read_shape, resolve_model_path
from engine.model.paged_attention import PagedAttention, check_inplace, inplace_on
from engine.model.passes import padded_length, pool_for
from engine.model.plan import device_memory, load_planned, load_planned_head, summary
from engine.model.tokenizer import IncrementalText, Tokenizer
from engine.model.transformer import FEW_QUERY_ROWS, Transformer
from engine.request import Request, RequestOutput, RequestStatus, StepOutput, StepResult
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.speculative.calibration import Calibration
from engine.speculative.costs import MeasuredCosts
from engine.speculative.draft import DraftModelProposer, check_compatible
from engine.speculative.eagle import EagleProposer
from engine.speculative.step import SpeculativeDecoder
from engine.uniforms import RandomStream

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]

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


class LLMEngine:
    """The engine loop: requests in, StepOutputs out. Not thread-safe; see AsyncLLMEngine."""

    def __init__(self, config: EngineConfig, free_memory: Callable[[str], int] = free_memory,
                 defer_calibration: bool = False, graph_capture: Capture | None = None):
        """free_memory(device): bytes the device can still allocate (the KV pools are sized from it).
        defer_calibration: a cold start measures the adaptive policy's costs at batch 1 only and
        leaves the largest batch to `run_idle_work` (a server, ready sooner), decoding plainly
        beyond batch 1 until then. graph_capture: how cuda_graphs records a pass (default: CUDA
        graphs on CUDA, the emulation on CPU; tests inject failing ones)."""
        self.config = config
        if config.device == "cpu" and config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        clock = _PhaseClock()
        self.startup = clock.seconds  # each start-up phase's seconds (stats, benches)
        self.tokenizer, model_path, draft_path = self._resolve_checkpoints()
        clock.done("checkpoints", "resolved %s (tokenizer, shapes, max_seq_len %d)", model_path, config.max_seq_len)
        self.model, self.draft_model = self._load_models(model_path, draft_path)
        clock.done("models", "loaded the target%s, each with its forward plan",
                   " and the draft" if self.draft_model is not None else "")
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
        self.cuda_graphs = self._capture_graphs(graph_capture)  # model role -> what capture did ({}: off)
        if self.cuda_graphs:
            clock.done("cuda_graphs", "cuda_graphs: %s", ", ".join(
                f"{role} {r.graphs} graphs" if r.fallback is None else f"{role} eager" for role, r in self.cuda_graphs.items()))
        self.speculation = self._build_speculation(defer_calibration) if config.use_speculative_decoding else None
        calibration = self.speculation.calibration if self.speculation is not None else None
        if calibration is not None:
            clock.done("calibration", "adaptive policy's costs %s (%d passes%s)", calibration.source,
                       calibration.passes, f"; batch {calibration.pending} when first needed" if calibration.pending else "")
        spec = self.speculation
        self.scheduler = Scheduler(self.kv, config.max_batch_size, config.max_num_batched_tokens,
                                   spec.tokens_per_round if spec is not None else (lambda: 1),
                                   spec.expected_tokens_per_round if spec is not None else None)
        self._requests: dict[str, Request] = {}
        self._seed_source = random.Random(config.seed)  # seeds for requests that bring none
        self._ids = itertools.count()
        self.num_preemptions_total = 0  # requests preempted (KV freed, recomputed later) so far
        self.last_step = StepResult()
        self.fault_hook: Callable[[Request], None] | None = None  # test-only: called per request with new tokens
        self._grammars: GrammarCompiler | None = None  # made at the first structured-output request
        log.info("engine ready in %.1f s (%s)", clock.total(),
                 ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.startup.items()))

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

    def _load_models(self, model_path, draft_path) -> tuple[Transformer, Transformer | None]:
        """Both models, each with its forward plan (engine/model/plan.py)."""
        config = self.config
        explicit = config.explicit_plan()
        model, target_plan = load_planned(model_path, "target", config.dtype, config.device,
                                          config.max_seq_len, explicit["target"])
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
        costs = MeasuredCosts()
        settings = self.config.speculative
        draft = None
        if isinstance(self.draft_model, Eagle3Head):
            draft = EagleProposer(self.draft_model, self.kv, costs)
        elif self.draft_model is not None:
            draft = DraftModelProposer(self.draft_model, self.kv, costs, self.model.shape.vocab_size)
        decoder = SpeculativeDecoder(self.runner, self.kv, settings, draft, costs)
        if settings.spec_policy == "adaptive":
            decoder.calibration = Calibration(costs, (self.model, self.kv.target),
                                              (self.draft_model, self.kv.draft) if self.draft_model is not None else None,
                                              max(settings.spec_length, 8) + 1, self.config.max_batch_size,
                                              settings.speculative_method)
            decoder.calibration.start(defer=defer_calibration)
        return decoder

    def run_idle_work(self, batch: int | None = None) -> bool:
        """Runs work left from start-up while no request is in flight: the adaptive policy's
        calibration at a batch size not measured yet (with `batch`: only if a step of that many
        sequences needs it). Whether anything ran; a caller with nothing else to do calls again."""
        calibration = self.speculation.calibration if self.speculation is not None else None
        if calibration is None or self.has_unfinished_requests():
            return False
        if batch is not None and not calibration.needs(batch):
            return False
        return calibration.run_next()

    def reconfigure_speculation(self, **changes) -> SpecConfig:
        """Applies SpecConfig changes (any field but draft_model) from the next step on, under
        SpecConfig's rule (a field given turns speculation on); ValueError names a bad field. An
        engine started without speculation has none to turn on: any field but
        use_speculative_decoding=False is an error naming it."""
        if self.speculation is None:
            wanted = sorted(k for k, v in changes.items() if not (k == "use_speculative_decoding" and v is False))
            if wanted:
                raise ValueError(f"speculation was not configured for this engine at start-up, so {wanted} cannot "
                                 "take effect: start it with speculation on")
            self.config.speculative.updated(changes)  # validated all the same
            return self.config.speculative
        self.config.speculative = self.speculation.reconfigure(changes)
        return self.config.speculative

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) and prompt else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model.shape.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, shares_prompt_of: str | None = None) -> str:
        """Queues a request; returns its id. shares_prompt_of: a queued or running request with the
        same prompt (one of n samples): this one is admitted once that one's prompt is in KV, so
        with prefix caching it computes only the prompt's last, partial block."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize_prompt(prompt)
        limit = self.config.max_seq_len
        if len(ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(ids) + params.max_tokens} exceeds max_seq_len ({limit})")
        if any(t >= self.model.shape.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.model.shape.vocab_size}), got {params.stop_token_ids}")
        if params.logit_bias and max(params.logit_bias) >= self.model.shape.vocab_size:
            raise ValueError(f"logit_bias keys must be token ids in [0, {self.model.shape.vocab_size}), "
                             f"got {max(params.logit_bias)}")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(62)
        first = None
        if shares_prompt_of is not None:
            first = self._requests.get(shares_prompt_of)
            if first is None or first.prompt_token_ids != ids:
                raise ValueError(f"shares_prompt_of {shares_prompt_of!r} is not a request with the same prompt")
        req = Request(request_id, ids, params, RandomStream(seed), IncrementalText(self.tokenizer, params.stop),
                      grammar=self._grammar(params), shares_prompt_of=first)
        self._requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def _grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        """A matcher for the request's structured output (GrammarError when it does not compile)."""
        if params.structured_output is None:
            return None
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model.shape.vocab_size)
        return self._grammars.matcher(params.structured_output)

    def abort(self, request_id: str, error: str | None = None) -> StepOutput | None:
        """Ends a request now, its KV freed at once (finish reason "error" with an error message).
        Returns its final output, or None when it had already finished."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return None
        req.error = error
        return self._finish(req, "abort" if error is None else "error", "")

    def request(self, request_id: str) -> Request | None:
        """The engine's record of a request (None once released)."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[StepOutput]:
        """Schedules, runs the passes, appends the new tokens; `last_step` says what it did."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        result = self.last_step = StepResult(num_preempted=len(batch.preempted))
        self.num_preemptions_total += len(batch.preempted)
        if batch.empty:
            return []
        new_tokens = []
        if batch.prefill:
            t_prefill = time.perf_counter()
            new_tokens += self.runner.prefill(batch.prefill)
            result.phases.prefill = time.perf_counter() - t_prefill
        if batch.decode:
            if self.speculation is None:
                decoded = self.runner.decode(batch.decode)
            else:
                decoded = self.speculation.decode(batch.decode, self.scheduler.running)
            new_tokens += decoded.tokens
            result.decode = decoded.stats
            result.phases.draft, result.phases.target = decoded.draft_seconds, decoded.target_seconds
        result.outputs = self._append_all(new_tokens)
        phases = result.phases
        phases.other = max(0.0, time.perf_counter() - t0 - phases.prefill - phases.draft - phases.target)
        if self.speculation is not None and batch.decode and not batch.prefill \
                and not any(o.finished for o in result.outputs):  # finishing costs the same at any K
            self.speculation.observe_step(decoded, phases)
        return result.outputs

    def _append_all(self, new_tokens: list[tuple[Request, list[int]]]) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        now = time.monotonic()
        for req, tokens in new_tokens:
            pending, req.pending_logprobs = req.pending_logprobs, None  # one per token, in order
            try:
                if self.fault_hook is not None:
                    self.fault_hook(req)
                if not tokens and req.params.max_tokens == 0 and not req.is_finished:
                    outputs.append(self._finish(req, "length", ""))  # prompt logprobs only (echo)
                for i, token in enumerate(tokens):
                    if req.is_finished:
                        break  # tokens after a stop are dropped
                    outputs.append(self._append(req, token, now, pending[i] if pending else None))
            except Exception as exc:  # one request's failure must not touch the others
                if is_device_fault(exc):
                    raise  # the device is suspect for every request
                if not req.is_finished:
                    req.error = f"{type(exc).__name__}: {exc}"
                    outputs.append(self._finish(req, "error", ""))
        return outputs

    def _append(self, req: Request, token: int, now: float, logprob: TokenLogprob | None = None) -> StepOutput:
        if req.grammar is not None and not req.grammar.commit(token):
            raise ValueError(f"token {token} is not allowed by the request's structured output")
        req.output_token_ids.append(token)
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = now
        text = req.text
        delta = text.add(token)
        p = req.params
        if text.stopped or token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            return self._finish(req, "stop", delta, token, logprob)
        if len(req.output_token_ids) >= p.max_tokens:
            return self._finish(req, "length", delta, token, logprob)
        return StepOutput(req.request_id, token, delta, logprob=logprob)

    def _finish(self, req: Request, reason, delta: str, token: int = -1,
                logprob: TokenLogprob | None = None) -> StepOutput:
        delta += req.text.finish()
        self.scheduler.remove(req)
        if self.speculation is not None:
            self.speculation.forget(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        return StepOutput(req.request_id, token, delta, finished=True, finish_reason=reason, logprob=logprob)

    def get_output(self, request_id: str) -> RequestOutput:
        return self._requests[request_id].output()

    def release(self, request_id: str) -> None:
        """Forgets a finished request's record (the engine keeps it until then)."""
        req = self._requests.get(request_id)
        if req is not None and req.is_finished:
            del self._requests[request_id]

    def stats(self) -> dict:
        """Queue lengths, KV in use, the speculation settings and the forward plan."""
        out = {"running": self.num_running(), "waiting": self.num_waiting(), "num_kv_blocks": self.config.num_kv_blocks,
               "preemptions_total": self.num_preemptions_total, **self.kv.counts(), "forward_plan": self.forward_plan,
               "startup_s": dict(self.startup)}
        if self.speculation is not None:
            out["speculation"] = dataclasses.asdict(self.speculation.settings)
        return out


class LLM:
    """Offline batch generation: `LLM(**EngineConfig fields).generate(prompts, params)`; with no
    model given, the embedded target with speculation on by its EAGLE-3 head (or by its draft
    model, asked for with speculative_method="draft")."""

    def __init__(self, **kwargs):
        self.config = EngineConfig.from_kwargs(**with_embedded_defaults(kwargs))
        self.engine = LLMEngine(self.config)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = self._add_all(prompts, params_list)
        from tqdm import tqdm

        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                bar.update(sum(out.finished for out in self.engine.step()))
        results = [self.engine.get_output(rid) for rid in ids]
        for rid in ids:
            self.engine.release(rid)
        return results

    def _add_all(self, prompts: list[Prompt], params_list: list[SamplingParams]) -> list[str]:
        """Adds every request, or none (a bad one aborts those already added)."""
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, params))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
                self.engine.release(rid)
            raise
        return ids
