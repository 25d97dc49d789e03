"""Validated configuration: `EngineConfig`, with `SpecConfig` and the forward plan inside (a
request's `SamplingParams`: sampling_params.py); every error is a `ValueError` naming the field
and what it accepts.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

DEFAULT_MODEL = "embedded:target"
DEFAULT_HEAD = "embedded:eagle3"  # the embedded target's EAGLE-3 head: its default proposer
DEFAULT_DRAFT_MODEL = "embedded:draft"  # its draft model, for speculative_method "draft"

KVBackend = Literal["slotted", "paged"]
# speculative_method names -> whether the method proposes with the draft model or head; the
# proposer registry (speculative/proposers/registry.py) adds the methods registered there
SPEC_METHODS: dict[str, bool] = {"draft": True, "ngram": False, "hybrid": True, "eagle": True, "suffix": False}
Lookup = Literal["ngram", "suffix"]  # the model-free proposers
SuffixSharing = Literal["all", "tenant"]
SpecPolicyMode = Literal["fixed", "adaptive"]
Verification = Literal["token", "block"]  # how a proposal is judged: token by token, or as a block
DType = Literal["float32", "bfloat16", "float16"]
LogprobsMode = Literal["raw", "processed"]
CudaGraphs = Literal["auto", "on", "off"]
PagedAttentionSetting = Literal["auto", "inplace", "gather"]
FusedKernels = Literal["auto", "on", "off"]
MAX_LOGPROBS = 20  # top alternatives a request may ask for per token


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_int(name: str, value, lo: int | None = None, hi: int | None = None, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {f'>= {lo}' if hi is None else f'in [{lo}, {hi}]'}, got {value}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_number(name: str, value, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}")
    return float(value)


def _check_keys(name: str, given: dict, known) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"unknown {name} field(s): {unknown}; known: {sorted(known)}")


SPECULATION_SWITCH = "use_speculative_decoding"


def _records_given(cls):
    """Keeps the names of the fields a caller gave (`given_fields`), so that one rule can tell a
    field set by its user from a default."""
    init, names = cls.__init__, [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "given_fields", frozenset(names[:len(args)]) | frozenset(kwargs))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def speculation_switch(switch: bool | None, others: set[str], current: bool = False) -> bool:
    """The one rule, for every entry point: speculation is on when use_speculative_decoding is
    true; left out (None), a speculation field given turns it on (else it stays `current`);
    false with another speculation field given is an error naming those fields."""
    if switch is None:
        return True if others else current
    check_bool(SPECULATION_SWITCH, switch)
    if not switch and others:
        raise ValueError(f"use_speculative_decoding is false, so {sorted(others)} would do nothing: turn "
                         "speculation on (or leave use_speculative_decoding out) or leave them out")
    return switch


@_records_given
@dataclass
class SpecConfig:
    """Speculative decoding settings. The same names in `EngineConfig.speculative`, in
    `LLM(...)`'s flat keywords, in `LLMEngine.reconfigure_speculation()` and in serve's
    `user_config`. One validator for all of them, and one rule: a field given here turns
    speculation on unless use_speculative_decoding is false, which with any other field given is
    an error (docs/speculative/methods.md)."""

    # on or off; left out: on when any other field here is given (LLM() and serve turn it on for the embedded pair)
    use_speculative_decoding: bool | None = None
    draft_model: str | None = None  # a draft model, or an EAGLE-3 head (speculative_method "eagle")
    # draft (a draft model), ngram (prompt lookup), hybrid (a lookup, else the model), eagle (an EAGLE-3 head),
    # suffix (suffix decoding), or a method registered with register_proposer
    speculative_method: str = "draft"
    spec_length: int = 5  # most tokens proposed per round (the adaptive policy picks up to this)
    spec_policy: SpecPolicyMode = "adaptive"  # adaptive: K from measured costs each step (0 = plain); fixed: spec_length
    spec_disable_batch_size: int | None = None  # no speculation at or above this batch size
    k_per_request: bool = False  # adaptive: each request its own K each step (false: one K for the batch)
    ngram_max: int = 4  # prompt lookup: the longest suffix matched
    ngram_min: int = 1  # prompt lookup: the shortest suffix matched
    hybrid_ngram_min: int = 3  # hybrid: trust a lookup match this long, else the draft model or head
    hybrid_lookup: Lookup = "ngram"  # hybrid: the lookup tried before the model (prompt lookup or suffix decoding)
    ngram_one_token_match_max: int = 2  # a one-token match proposes at most this many
    verification: Verification = "token"  # token: Leviathan et al.'s rule; block: Sun et al.'s (exact, accepts at least as much)
    tree_width: int = 1  # children a node of a proposed token tree may have; 1: a chain (every proposer drafts trees)
    tree_tokens: int = 16  # most tree nodes verified per round (trees only)
    suffix_cache_tokens: int = 1_000_000  # suffix decoding: most tokens of finished outputs kept (oldest evicted); 0: own text only
    suffix_sharing: SuffixSharing = "all"  # whose finished outputs inform a request: all requests', or its tenant's only

    def __post_init__(self) -> None:
        self._check_values()
        others = set(getattr(self, "given_fields", ())) - {SPECULATION_SWITCH}
        self.use_speculative_decoding = speculation_switch(self.use_speculative_decoding, others)
        self._check_needs(others if self.use_speculative_decoding else set())
        self._check_policy()

    def _check_values(self) -> None:
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise ValueError(f"draft_model must be a non-empty path or model id, got {self.draft_model!r}")
        check_choice("speculative_method", self.speculative_method, SPEC_METHODS)
        check_int("spec_length", self.spec_length, 1, 64)
        check_choice("spec_policy", self.spec_policy, get_args(SpecPolicyMode))
        check_int("spec_disable_batch_size", self.spec_disable_batch_size, 1, optional=True)
        check_bool("k_per_request", self.k_per_request)
        check_int("ngram_max", self.ngram_max, 1, 64)
        check_int("ngram_min", self.ngram_min, 1, self.ngram_max)
        check_int("hybrid_ngram_min", self.hybrid_ngram_min, 1, self.ngram_max)
        check_int("ngram_one_token_match_max", self.ngram_one_token_match_max, 1, 64)
        check_choice("verification", self.verification, get_args(Verification))
        check_choice("hybrid_lookup", self.hybrid_lookup, get_args(Lookup))
        check_int("suffix_cache_tokens", self.suffix_cache_tokens, 0, 1 << 31)
        check_choice("suffix_sharing", self.suffix_sharing, get_args(SuffixSharing))
        check_int("tree_width", self.tree_width, 1, 8)
        check_int("tree_tokens", self.tree_tokens, 1, 64)

    def _check_needs(self, turned_on_by: set[str]) -> None:
        """On, the method must have what it needs: a draft model or head for draft, hybrid, eagle."""
        if self.use_speculative_decoding and self.needs_draft_model and not self.draft_model:
            by = f" ({sorted(turned_on_by)} given, which turns speculation on)" if turned_on_by else ""
            raise ValueError(f"speculative_method={self.speculative_method!r} needs a draft model (draft_model){by}")

    def _check_policy(self) -> None:
        """k_per_request is the adaptive policy's: given true (now or before) with spec_policy
        fixed, it would do nothing, so it is an error naming both."""
        if self.spec_policy == "fixed" and self.k_per_request and "k_per_request" in getattr(self, "given_fields", ()):
            raise ValueError("spec_policy='fixed' with k_per_request=true: a K per request is the adaptive "
                             "policy's (give spec_policy: adaptive, or k_per_request: false)")

    @property
    def needs_draft_model(self) -> bool:
        return SPEC_METHODS.get(self.speculative_method, False)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def given(self) -> dict:
        """The fields its user gave, by name (rebuilding from these re-applies the same rule)."""
        return {name: getattr(self, name) for name in self.given_fields}

    def updated(self, changes: dict) -> SpecConfig:
        """A validated copy with `changes` applied (any field but draft_model, loaded at start-up),
        under the same rule: a field given while off turns speculation on."""
        _check_keys("speculation", changes, self.field_names() - {"draft_model"})
        others = set(changes) - {SPECULATION_SWITCH}
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        new._check_values()
        new.use_speculative_decoding = speculation_switch(changes.get(SPECULATION_SWITCH), others,
                                                          self.use_speculative_decoding)
        new._check_needs(others if new.use_speculative_decoding and not self.use_speculative_decoding else set())
        object.__setattr__(new, "given_fields", self.given_fields | set(changes))
        new._check_policy()
        return new


@dataclass(frozen=True)
class ModelPlan:
    """How one model's passes compute; engine/model/plan.py chooses it, or a user gives it."""

    dtype: DType = "bfloat16"  # weights, activations and KV cache
    one_sequence_kernel: bool = False  # target only: passes over one sequence on the hand-written matmul (float32 math)
    token_step: bool = False  # draft only: passes of at most token_step_rows tokens as whole-model C calls
    token_step_rows: int = 8  # draft only: the widest pass the token step takes (measured: 8 or 16)

    def __post_init__(self) -> None:
        check_choice("forward_plan dtype", self.dtype, get_args(DType))
        check_bool("forward_plan one_sequence_kernel", self.one_sequence_kernel)
        check_bool("forward_plan token_step", self.token_step)
        check_int("forward_plan token_step_rows", self.token_step_rows, 1, 64)
        if self.one_sequence_kernel and self.dtype == "float16":
            raise ValueError("forward_plan: one_sequence_kernel needs dtype 'float32' or 'bfloat16'")
        if self.token_step and self.dtype == "float16":
            raise ValueError("forward_plan: token_step needs dtype 'float32' or 'bfloat16'")

    @classmethod
    def from_dict(cls, role: str, value: dict, dtype: str) -> ModelPlan:
        """A target's plan never takes the draft's token step (a target's rounding must not depend
        on the pass), nor a draft's the target's one-sequence kernel."""
        if not isinstance(value, dict):
            raise ValueError(f"forward_plan.{role} must be a mapping, got {value!r}")
        _check_keys(f"forward_plan.{role}", value, {f.name for f in dataclasses.fields(cls)})
        plan = cls(**{"dtype": dtype, **value})
        if role == "target" and plan.token_step:
            raise ValueError("forward_plan.target: token_step is draft-only (its rounding depends on the pass)")
        if role == "draft" and plan.one_sequence_kernel:
            raise ValueError("forward_plan.draft: one_sequence_kernel is for the target")
        return plan


ForwardPlanSetting = Literal["auto", "torch"]


@dataclass
class EngineConfig:
    """Everything that shapes an engine. `LLM(**kwargs)` takes these fields and, flat, the
    fields of `SpecConfig` (`LLM(draft_model=..., use_speculative_decoding=True)`)."""

    model: str = DEFAULT_MODEL  # a local HF checkpoint dir, an HF id in the local cache, or embedded:target
    tokenizer: str | None = None  # defaults to the model directory
    dtype: DType = "bfloat16"  # the precision asked for; the plan may compute a bf16 model in float32
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    seed: int = 0  # seeds the seeds of requests that bring none
    max_batch_size: int = 64  # most requests decoding at once; KV pools and calibration are sized for it
    max_seq_len: int | None = None  # None: the model's max_position_embeddings, memory permitting
    kv_cache_backend: KVBackend = "paged"  # paged: shared fixed-size blocks; slotted: max_seq_len per sequence
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # paged, per pool; default: max_batch_size full sequences, memory permitting
    kv_cache_memory_fraction: float = 0.9  # share of the memory free after loading the models the KV pools may take
    enable_prefix_caching: bool = True  # requests sharing a prompt prefix share its KV blocks (paged)
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    # "auto": measure the candidate paths on this host at load (cached); "torch": torch/oneDNN
    # only, in `dtype`; or {"target": {...ModelPlan}, "draft": {...}} (a role left out is measured)
    forward_plan: ForwardPlanSetting | dict[str, Any] = "auto"
    # which distribution logprobs report: the model's ("raw", before penalties, temperature,
    # top-k/top-p and structured-output masks) or the one sampled from ("processed")
    logprobs_mode: LogprobsMode = "raw"
    # decode, verify and draft steps captured as CUDA graphs per batch bucket at load, each checked
    # against eager (engine/model/cuda_graphs.py); "auto": on CUDA only; "on" on CPU emulates them (tests)
    cuda_graphs: CudaGraphs = "auto"
    # decode and verify attention reading the paged pool in place (FlexAttention, engine/model/paged_attention.py)
    # where the load-time check agrees with the gather, or over a gathered copy; "auto" gathers (in place
    # measured slower on an H200, docs/gpu.md)
    paged_attention: PagedAttentionSetting = "auto"
    # each layer's pointwise work (residual add + RMSNorm, q/k norm + RoPE + KV write, SiLU-and-multiply)
    # in fused Triton kernels where the load-time check agrees with eager (engine/model/fused_check.py); "auto": CUDA only
    fused_kernels: FusedKernels = "auto"
    # the target's passes on the rule that keeps each row's bits independent of its pass, so greedy
    # speculation equals plain decoding bitwise (engine/model/invariance.py); "auto": in a speculative
    # engine where the load-time harness passes (on CUDA also where its passes are timed at most 1.05x the
    # plan's; a plain-only engine only where its decode passes are timed faster on it); "on": whatever
    # the harness says (a warning); CUDA: Triton fixed-tile kernels, needing fused_kernels
    batch_invariant: FusedKernels = "auto"
    # quantized linears (FP8, INT4) read as stored by Triton kernels, each checked at load against the
    # dequantized weight (engine/model/weight_kernels.py); "auto": CUDA only; else dequantized a layer a call
    quant_kernels: FusedKernels = "auto"
    # a mixture-of-experts layer's experts in one Triton kernel a projection (static shapes, no host read),
    # checked at load against the host-grouped experts; "auto": CUDA only
    moe_kernels: FusedKernels = "auto"
    speculative: SpecConfig = field(default_factory=SpecConfig)  # speculation settings; LLM(...) takes them flat too

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path or model id, got {self.model!r}")
        check_choice("dtype", self.dtype, get_args(DType))
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        check_int("seed", self.seed, 0)
        check_int("max_batch_size", self.max_batch_size, 1, 4096)
        check_int("max_seq_len", self.max_seq_len, 2, 1 << 20, optional=True)
        check_choice("kv_cache_backend", self.kv_cache_backend, get_args(KVBackend))
        check_int("block_size", self.block_size, 1, 1024)
        check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        self.kv_cache_memory_fraction = check_number("kv_cache_memory_fraction", self.kv_cache_memory_fraction,
                                                      0.0, 1.0, lo_open=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("num_threads", self.num_threads, 1, 1024, optional=True)
        check_choice("logprobs_mode", self.logprobs_mode, get_args(LogprobsMode))
        check_choice("cuda_graphs", self.cuda_graphs, get_args(CudaGraphs))
        check_choice("paged_attention", self.paged_attention, get_args(PagedAttentionSetting))
        check_choice("fused_kernels", self.fused_kernels, get_args(FusedKernels))
        check_choice("batch_invariant", self.batch_invariant, get_args(FusedKernels))
        check_choice("quant_kernels", self.quant_kernels, get_args(FusedKernels))
        check_choice("moe_kernels", self.moe_kernels, get_args(FusedKernels))
        if isinstance(self.speculative, dict):
            _check_keys("speculative", self.speculative, SpecConfig.field_names())
            self.speculative = SpecConfig(**self.speculative)
        if not isinstance(self.speculative, SpecConfig):
            raise ValueError(f"speculative must be a SpecConfig or a mapping, got {self.speculative!r}")
        self.explicit_plan()  # validates an explicit plan

    @property
    def draft_model(self) -> str | None:
        return self.speculative.draft_model

    @property
    def use_speculative_decoding(self) -> bool:
        return self.speculative.use_speculative_decoding

    def explicit_plan(self) -> dict[str, ModelPlan | None]:
        """The plan given for each role ("target", "draft"); None where it is to be measured."""
        plan = self.forward_plan
        if plan in ("auto", "torch"):
            return dict.fromkeys(("target", "draft"), ModelPlan(self.dtype) if plan == "torch" else None)
        if not isinstance(plan, dict):
            raise ValueError(f"forward_plan must be 'auto', 'torch' or a mapping with 'target' and/or "
                             f"'draft', got {plan!r}")
        _check_keys("forward_plan", plan, ("target", "draft"))
        return {role: ModelPlan.from_dict(role, plan[role], self.dtype) if role in plan else None
                for role in ("target", "draft")}

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """`EngineConfig(**kwargs)` that also takes SpecConfig's fields flat; an unknown key is
        a ValueError naming it."""
        spec_fields = SpecConfig.field_names()
        _check_keys("EngineConfig", kwargs, {f.name for f in dataclasses.fields(cls)} | spec_fields)
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k in spec_fields}
        if flat:
            kwargs["speculative"] = {**_as_dict(kwargs.get("speculative", {})), **flat}
        return cls(**kwargs)


def with_embedded_defaults(kwargs: dict) -> dict:
    """EngineConfig kwargs with no `model`: the embedded target with speculation on, by its
    EAGLE-3 head (method "eagle"), or its draft model where the method asked for is "draft"
    (explicit keys, flat or in `speculative`, win)."""
    if "model" in kwargs:
        return dict(kwargs)
    spec_fields = SpecConfig.field_names()
    given = {**_as_dict(kwargs.get("speculative") or {}),
             **{k: v for k, v in kwargs.items() if k in spec_fields}}  # LLM's flat keys too
    if given.get(SPECULATION_SWITCH) is False:  # off: none of the embedded pair's speculation defaults
        return {**{k: v for k, v in kwargs.items() if k not in spec_fields}, "speculative": given, "model": DEFAULT_MODEL}
    method = given.get("speculative_method", "eagle")
    spec = {"draft_model": DEFAULT_DRAFT_MODEL if method == "draft" else DEFAULT_HEAD,
            "use_speculative_decoding": True, "speculative_method": method, **given}
    return {**kwargs, "speculative": spec, "model": DEFAULT_MODEL}


def _as_dict(spec: SpecConfig | dict) -> dict:
    """The fields given, of a SpecConfig or a mapping."""
    return spec.given() if isinstance(spec, SpecConfig) else dict(spec)
