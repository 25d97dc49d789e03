"""LLMEngine (add_request / step / abort) and LLM, the offline batch API."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from engine.config import EngineConfig, SamplingParams, with_embedded_defaults
from engine.detokenize import IncrementalText
from engine.kernel_caches import bound_kernel_caches
from engine.kv import make_pool
from engine.metrics import PhaseSeconds
from engine.model.llama import Llama
from engine.model.loader import load_llama, resolve_model_path
from engine.model.tokenizer import Tokenizer
from engine.request import Request, RequestOutput, RequestStatus, StepOutput
from engine.runner import ContinuousRunner
from engine.scheduler import Scheduler

Prompt = str | Sequence[int]


def build_pool(config: EngineConfig, model: Llama, num_blocks: int | None = None):
    s = model.shape
    return make_pool(
        config.kv_cache_backend, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim, max_slots=config.max_batch_size, max_seq_len=config.max_seq_len,
        dtype=model.dtype, device=config.device, block_size=config.block_size,
        num_blocks=num_blocks, enable_prefix_caching=config.enable_prefix_caching,
    )


class LLMEngine:
    """The engine loop: requests in, StepOutputs out. Not thread-safe; see AsyncLLMEngine."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.device == "cpu":
            bound_kernel_caches()
        if config.num_threads is not None and config.device == "cpu":
            torch.set_num_threads(config.num_threads)
        model_path = resolve_model_path(config.model)
        config.model = str(model_path)
        self.tokenizer = Tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer else model_path)
        self.model = load_llama(model_path, config.dtype, config.device, config.max_seq_len,
                                one_sequence_kernels=config.cpu_one_sequence_kernels)
        if config.max_seq_len > self.model.shape.max_position_embeddings:
            raise ValueError(f"max_seq_len {config.max_seq_len} exceeds the model's "
                             f"max_position_embeddings {self.model.shape.max_position_embeddings}")
        if config.kv_cache_backend == "paged" and config.num_kv_blocks is not None:
            if config.num_kv_blocks * config.block_size < config.max_seq_len:
                raise ValueError(f"num_kv_blocks * block_size = {config.num_kv_blocks * config.block_size} "
                                 f"tokens cannot hold one sequence of max_seq_len {config.max_seq_len}")
        self.runner = self._build_runner()
        self.scheduler = Scheduler(self.runner, config.max_batch_size, config.max_num_batched_tokens)
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, IncrementalText] = {}
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        self.num_preemptions_total = 0  # requests preempted (KV freed, recomputed later) so far
        self.last_step_preemptions = 0
        self.last_step_phases = PhaseSeconds()  # where the last step's wall time went
        # test-only fault injection: called with each request as its new tokens are processed
        self.fault_hook: Callable[[Request], None] | None = None

    def _build_runner(self):
        if self.config.use_speculative_decoding:
            from engine.spec.runner import SpeculativeRunner

            return SpeculativeRunner.build(self.config, self.model, self.tokenizer,
                                           build_pool(self.config, self.model, self.config.num_kv_blocks))
        return ContinuousRunner(self.model, build_pool(self.config, self.model, self.config.num_kv_blocks))

    # --- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model.shape.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize_prompt(prompt)
        limit = self.config.max_seq_len
        if len(ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(ids) + params.max_tokens} exceeds max_seq_len ({limit})")
        vocab = self.model.shape.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {t}")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_source))
        req = Request(request_id, ids, params, torch.Generator().manual_seed(seed))
        self._requests[request_id] = req
        self._texts[request_id] = IncrementalText(self.tokenizer, params.stop)
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> StepOutput | None:
        """Ends a request now (its KV is freed at once). Returns its final output, or None."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return None
        return self._finish(req, "abort", "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the loop ------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self.last_step_preemptions = len(batch.preempted)
        self.num_preemptions_total += len(batch.preempted)
        self.last_step_phases = PhaseSeconds()
        if batch.empty:
            return []
        new_tokens = self.runner.step(batch)
        outputs: list[StepOutput] = []
        now = time.monotonic()
        for req, tokens in new_tokens:
            try:
                if self.fault_hook is not None:
                    self.fault_hook(req)
                for token in tokens:
                    if req.is_finished:
                        break  # tokens after a stop are dropped
                    outputs.append(self._append(req, token, now))
            except Exception as exc:  # one request's failure must not touch the others
                if not req.is_finished:
                    req.error = f"{type(exc).__name__}: {exc}"
                    outputs.append(self._finish(req, "error", ""))
        seconds = time.perf_counter() - t0
        phases = self.runner.last_phases
        phases.other = max(0.0, seconds - phases.prefill - phases.draft - phases.target)
        self.last_step_phases = phases
        observe = getattr(self.runner, "observe_step_seconds", None)
        if observe is not None:  # the adaptive policy's per-step overhead
            observe(seconds)
        return outputs

    def _append(self, req: Request, token: int, now: float) -> StepOutput:
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        text = self._texts[req.request_id]
        delta = text.add(token)
        p = req.params
        if text.stopped or token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            return self._finish(req, "stop", delta, token)
        if len(req.output_token_ids) >= p.max_tokens:
            return self._finish(req, "length", delta, token)
        return StepOutput(req.request_id, token, delta)

    def _finish(self, req: Request, reason, delta: str, token: int = -1) -> StepOutput:
        delta += self._texts[req.request_id].finish()
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        return StepOutput(req.request_id, token, delta, finished=True, finish_reason=reason)

    # --- results -------------------------------------------------------------------------
    def get_output(self, request_id: str) -> RequestOutput:
        req = self._requests[request_id]
        s = req.spec
        metrics = {}
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if req.finish_time is not None:
            metrics["e2e_s"] = req.finish_time - req.arrival_time
        return RequestOutput(
            request_id=request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=self._texts[request_id].text,
            finished=req.is_finished, finish_reason=req.finish_reason, error=req.error,
            num_cached_prompt_tokens=req.num_cached_prefix_tokens,
            acceptance_rate=s.acceptance_rate, num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens, num_spec_rounds=s.rounds,
            accepted_per_round=list(s.accepted_per_round), proposed_per_round=list(s.proposed_per_round),
            proposers=sorted(s.proposers),
            metrics=metrics,
        )

    def release(self, request_id: str) -> None:
        """Forgets a finished request's record (the engine keeps it until then)."""
        req = self._requests.get(request_id)
        if req is not None and req.is_finished:
            del self._requests[request_id]
            del self._texts[request_id]

    def kv_usage_fractions(self) -> dict[str, float]:
        """Fraction of each KV pool in use ("target", and "draft" when there is one)."""
        return self.runner.kv_usage_fractions()


class LLM:
    """Offline batch generation: `LLM(**EngineConfig fields).generate(prompts, params)`.

    With no model given it serves the embedded default pair (target + draft, speculation on).
    """

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
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, params))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
                self.engine.release(rid)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        results = [self.engine.get_output(rid) for rid in ids]
        for rid in ids:
            self.engine.release(rid)
        return results
