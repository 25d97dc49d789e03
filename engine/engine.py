"""LLMEngine: requests in (add_request, abort), steps run (step), outputs out; built by
startup.py. Not thread-safe; serve_app/async_engine.py drives it from one thread."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence

from engine import startup
from engine.config import EngineConfig, SpecConfig
from engine.faults import is_device_fault
from engine.grammar import GrammarCompiler, GrammarMatcher
from engine.kv_sizing import free_memory
from engine.logprobs import TokenLogprob
from engine.model.cuda_graphs import Capture
from engine.request import Request, RequestOutput, RequestStatus, StepOutput, StepResult
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import ChatPrompt, IncrementalText
from engine.uniforms import RandomStream

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | ChatPrompt  # text, token ids, or a conversation

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
        parts = startup.build(config, free_memory, defer_calibration, graph_capture)
        self.tokenizer, self.model, self.draft_model = parts.tokenizer, parts.model, parts.draft_model
        self.kv, self.runner, self.speculation = parts.kv, parts.runner, parts.speculation
        self.forward_plan, self.paged_attention, self.cuda_graphs = parts.forward_plan, parts.paged_attention, \
            parts.cuda_graphs
        self.fused_kernels = parts.fused_kernels
        self.batch_invariant = parts.batch_invariant
        self.weight_kernels = parts.weight_kernels
        self.weights = parts.weights  # model role -> bytes on the device and format
        self.startup = parts.seconds  # each start-up phase's seconds (stats, benches)
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

    def run_idle_work(self, batch: int | None = None) -> bool:
        """Runs work left from start-up while no request is in flight: the adaptive policy's
        calibration at a batch size not measured yet (with `batch`: only if a step of that many
        sequences needs it). Whether anything ran; a caller with nothing else to do calls again."""
        calibration = self.speculation.planner.calibration if self.speculation is not None else None
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
        """The prompt's ids, checked: every prompt (text, ids or a chat) is tokenized here."""
        if isinstance(prompt, ChatPrompt):
            ids = self.tokenizer.apply_chat_template(prompt.messages, prompt.tools)
        else:
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
        """Queue lengths, KV in use, the speculation settings, self-check and exploration, the forward plan."""
        out = {"running": self.num_running(), "waiting": self.num_waiting(), "num_kv_blocks": self.config.num_kv_blocks,
               "preemptions_total": self.num_preemptions_total, **self.kv.counts(), "forward_plan": self.forward_plan,
               "startup_s": dict(self.startup), "fused_kernels": dict(self.fused_kernels),
               "batch_invariant": self.batch_invariant,
               "weight_kernels": dict(self.weight_kernels),
               "weights": {role: dict(w) for role, w in self.weights.items()}}
        if self.speculation is not None:
            out["speculation"] = dataclasses.asdict(self.speculation.settings)
            out["self_check"] = self.speculation.planner.self_check.summary()  # predicted vs realized per (batch, K)
            out["exploration"] = self.speculation.planner.exploration.summary()  # the probes' share of the steps
        return out
