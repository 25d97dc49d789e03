"""Validated configuration: `EngineConfig` for the engine, `SamplingParams` for one request.

Both are dataclasses validated in `__post_init__`; every error is a `ValueError` that names the
field and the allowed range, so bad input is rejected at the edge and never reaches the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

DEFAULT_MODEL = "embedded:target"
DEFAULT_DRAFT_MODEL = "embedded:draft"

KVBackend = Literal["slotted", "paged"]
BatchingMode = Literal["continuous", "static"]
SpecMethod = Literal["draft", "ngram", "hybrid"]
SpecPolicy = Literal["fixed", "adaptive"]
DType = Literal["float32", "bfloat16", "float16"]
DraftQuantization = Literal["none", "int8"]


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclass
class EngineConfig:
    """Everything that shapes an engine instance. `LLM(**kwargs)` takes exactly these fields."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # defaults to the model directory
    dtype: DType = "bfloat16"
    device: str = "cpu"
    seed: int = 0
    # batching and KV
    batching_mode: BatchingMode = "continuous"
    max_batch_size: int = 64
    max_seq_len: int = 1024
    kv_cache_backend: KVBackend = "paged"
    block_size: int = 16
    num_kv_blocks: int | None = None  # paged: default = max_batch_size * max_seq_len / block_size
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    use_cuda_graphs: bool = False
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    # the target's passes over one sequence (batch-1 decode and verify) on the hand-written CPU
    # kernel (engine/model/kernels) where it builds; False keeps oneDNN's for every pass
    cpu_one_sequence_kernels: bool = True
    # the draft's passes over a few tokens (its steps at batch 1, a round's short catch-up) as
    # whole-model C calls (engine/model/token_step.py) where the kernels build; False keeps its
    # torch forward for every pass. Exact either way: the draft only proposes.
    cpu_draft_token_step: bool = True
    # speculative decoding
    use_speculative_decoding: bool = False
    draft_model: str | None = None
    speculative_method: SpecMethod = "draft"
    spec_length: int = 5
    spec_policy: SpecPolicy = "adaptive"
    spec_disable_batch_size: int | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    hybrid_ngram_min: int = 3  # hybrid: trust a prompt-lookup match only this long, else draft
    # a prompt-lookup match of a single token proposes at most this many tokens (weak evidence;
    # engine/spec/ngram.py says how 2 was chosen); set it to spec_length to disable the cut
    ngram_one_token_match_max: int = 2
    # the draft scores only this many of the most frequent tokens (ranking: token_ranking.json
    # beside the draft checkpoint); None scores the whole vocabulary. Exact either way.
    draft_vocab_size: int | None = None
    # "int8": the draft's narrow passes (its steps at small batches) read int8 copies of its
    # weights where the kernel exists (CPU): cheaper steps, slightly lower acceptance. Exact
    # either way: only the target's pass and the rejection sampler decide the output.
    draft_quantization: DraftQuantization = "int8"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path or model id, got {self.model!r}")
        _check_choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _check_int("seed", self.seed, 0)
        _check_choice("batching_mode", self.batching_mode, ("continuous", "static"))
        _check_int("max_batch_size", self.max_batch_size, 1, 4096)
        _check_int("max_seq_len", self.max_seq_len, 2, 1 << 20)
        _check_choice("kv_cache_backend", self.kv_cache_backend, ("slotted", "paged"))
        _check_int("block_size", self.block_size, 1, 1024)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1, 1024)
        for name in ("cpu_one_sequence_kernels", "cpu_draft_token_step"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_choice("speculative_method", self.speculative_method, ("draft", "ngram", "hybrid"))
        _check_int("spec_length", self.spec_length, 1, 64)
        _check_choice("spec_policy", self.spec_policy, ("fixed", "adaptive"))
        if self.spec_disable_batch_size is not None:
            _check_int("spec_disable_batch_size", self.spec_disable_batch_size, 1)
        _check_int("ngram_max", self.ngram_max, 1, 64)
        _check_int("ngram_min", self.ngram_min, 1, self.ngram_max)
        _check_int("hybrid_ngram_min", self.hybrid_ngram_min, 1, self.ngram_max)
        _check_int("ngram_one_token_match_max", self.ngram_one_token_match_max, 1, 64)
        if self.draft_vocab_size is not None:
            _check_int("draft_vocab_size", self.draft_vocab_size, 1)
        _check_choice("draft_quantization", self.draft_quantization, get_args(DraftQuantization))
        if self.use_speculative_decoding:
            if self.speculative_method in ("draft", "hybrid") and not self.draft_model:
                raise ValueError(
                    f"draft_model is required when use_speculative_decoding=True and "
                    f"speculative_method={self.speculative_method!r}")
            if self.batching_mode != "continuous":
                raise ValueError("use_speculative_decoding=True requires batching_mode='continuous'")
            if self.use_cuda_graphs:
                raise ValueError("use_speculative_decoding=True is incompatible with use_cuda_graphs=True")
        if self.use_cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError("use_cuda_graphs=True requires a cuda device")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Like `EngineConfig(**kwargs)` but an unknown key is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown EngineConfig field(s): {unknown}; known fields: {sorted(known)}")
        return cls(**kwargs)


def with_embedded_defaults(kwargs: dict) -> dict:
    """EngineConfig kwargs with no `model`: the embedded pair, speculation on (explicit keys win)."""
    if "model" in kwargs:
        return dict(kwargs)
    return {"draft_model": DEFAULT_DRAFT_MODEL, "use_speculative_decoding": True, **kwargs, "model": DEFAULT_MODEL}


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature 0 means greedy. top_k = -1 (or 0) disables top-k; top_p = 1 disables top-p;
    min_p = 0 disables min-p; repetition_penalty = 1 disables the penalty (CTRL-style: a logit
    of a token already in prompt or output is divided by it when positive, multiplied when not).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    spec_length: int | None = None  # per-request cap on proposed tokens per round; 0 = no speculation

    def __post_init__(self) -> None:
        self.temperature = _check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        _check_int("top_k", self.top_k, -1)
        self.top_p = _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.repetition_penalty = _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        _check_int("max_tokens", self.max_tokens, 1)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for tid in self.stop_token_ids:
            _check_int("stop_token_ids[]", tid, 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        if self.spec_length is not None:
            _check_int("spec_length", self.spec_length, 0, 64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
