"""A request's sampling and stopping settings, validated: every error is a `ValueError` naming the
field and what it accepts."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import MAX_LOGPROBS, check_bool, check_int, check_number
from engine.structured_output import StructuredOutput


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops. temperature 0: greedy; top_k -1 (or 0), top_p 1,
    min_p 0 and repetition_penalty 1 (CTRL-style: a seen token's logit divided by it when positive,
    multiplied when not) each disable their filter."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = -1  # keep the k most likely tokens; -1 or 0: off
    top_p: float = 1.0  # keep the most likely tokens up to this total probability; 1: off
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability; 0: off
    repetition_penalty: float = 1.0  # CTRL-style, on tokens already seen; 1: off
    max_tokens: int = 16  # most tokens generated
    stop: list[str] | str | None = None  # strings that end generation (not returned)
    stop_token_ids: list[int] = field(default_factory=list)  # token ids that end generation
    ignore_eos: bool = False  # keep generating past the end-of-sequence token
    seed: int | None = None  # the request's random stream: same seed, same tokens, alone or in any batch
    spec_length: int | None = None  # per-request cap on proposed tokens per round; 0 = no speculation
    structured_output: StructuredOutput | None = None  # a grammar the output must follow (engine/grammar.py)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per occurrence in the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's, -100..100)
    logprobs: int | None = None  # each output token's logprob and this many top alternatives (0..20)
    prompt_logprobs: int | None = None  # each prompt token's logprob (the first: None) and top alternatives
    tenant: str | None = None  # whose earlier outputs may inform this one's suffix proposals (suffix_sharing "tenant")

    def __post_init__(self) -> None:
        self.temperature = check_number("temperature", self.temperature, 0.0, 100.0)
        check_int("top_k", self.top_k, -1)
        self.top_p = check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.min_p = check_number("min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = check_number("repetition_penalty", self.repetition_penalty, 0.0, 100.0, lo_open=True)
        check_int("max_tokens", self.max_tokens, 0)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be >= 1 (0 only with prompt_logprobs: the prompt scored, nothing generated)")
        self._check_stops()
        check_bool("ignore_eos", self.ignore_eos)
        check_int("seed", self.seed, 0, 2**63 - 1, optional=True)
        check_int("spec_length", self.spec_length, 0, 64, optional=True)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got {self.structured_output!r}")
        if self.structured_output is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured_output (a complete document ends at EOS)")
        self.presence_penalty = check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self._check_logit_bias()
        check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True)
        check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, optional=True)
        if self.tenant is not None and (not isinstance(self.tenant, str) or not self.tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {self.tenant!r}")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {self.logit_bias!r}")
        checked = {}
        for token, bias in self.logit_bias.items():
            check_int("logit_bias key", token, 0)
            checked[token] = check_number(f"logit_bias[{token}]", bias, -100.0, 100.0)
        self.logit_bias = checked or None

    def _check_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for tid in self.stop_token_ids:
            check_int("stop_token_ids[]", tid, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes the logits before temperature."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.logit_bias is not None

    @property
    def needs_probs(self) -> bool:
        """Whether sampling this request needs the adjusted distribution, not just an argmax."""
        return not self.greedy or self.adjusts_logits
