"""SpeculativeRunner: propose, verify in one batched target pass, accept exactly, roll back.

Prefill is the plain runner's (target only; the draft catches up lazily). Each decode step:
1. the policy picks K (0 = plain decode) from measured costs and acceptance estimates;
   each request's k is further capped so neither KV nor max_tokens can overflow;
2. the proposer(s) give each request up to k tokens (draft model, n-gram, or hybrid);
3. one target forward over [g, t_1..t_k] per request (g = last sampled token), positions
   n-1..n-1+k, through the pool's chunk view;
4. `rejection.verify` decides how many are accepted and the final (recovered/bonus) token;
5. both pools are truncated to the accepted length; the request gets accepted + 1 tokens.
Requests without a proposal ride along with k = 0, which is exactly a plain decode step.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.kv import CachePool
from engine.metrics import DecodeStepStats
from engine.model.llama import Llama
from engine.model.loader import load_llama, resolve_model_path
from engine.model.tokenizer import Tokenizer
from engine.request import Request
from engine.runner import ContinuousRunner, forward_chunks
from engine.sampling import SamplingRows, adjusted_probs, context_mask, sample
from engine.scheduler import ScheduledBatch
from engine.spec.costs import MeasuredCosts
from engine.spec.draft import DraftModelProposer
from engine.spec.draft_vocab import draft_output_ids
from engine.spec.ngram import ngram_propose
from engine.spec.policy import AcceptanceByPosition, Choice, SpecPolicy
from engine.spec.rejection import verify, verify_greedy


def check_compatible(target_tok: Tokenizer, draft_tok: Tokenizer, target: Llama, draft: Llama,
                     target_name: str, draft_name: str) -> None:
    problems = []
    if target.shape.vocab_size != draft.shape.vocab_size:
        problems.append(f"vocab size {target.shape.vocab_size} vs {draft.shape.vocab_size}")
    if target_tok.vocab_size != draft_tok.vocab_size:
        problems.append(f"tokenizer size {target_tok.vocab_size} vs {draft_tok.vocab_size}")
    if target_tok.eos_token_ids != draft_tok.eos_token_ids:
        problems.append(f"EOS ids {sorted(target_tok.eos_token_ids)} vs {sorted(draft_tok.eos_token_ids)}")
    if problems:
        raise ValueError(f"draft model {draft_name} is not compatible with target model {target_name}: "
                         + "; ".join(problems))


class SpeculativeRunner(ContinuousRunner):
    def __init__(self, config: EngineConfig, model: Llama, pool: CachePool,
                 draft: DraftModelProposer | None):
        super().__init__(model, pool)
        self.config = config
        self.method = config.speculative_method
        self.draft = draft
        self.costs = MeasuredCosts()
        self.policy = SpecPolicy(self.costs, config.spec_length, config.spec_policy,
                                 config.spec_disable_batch_size)
        # acceptance by draft position: each request's, shrunk towards the recent rounds of all
        # requests (decayed), which start from a prior rate
        self._acceptance: dict[str, AcceptanceByPosition] = {}
        self._recent_acceptance = AcceptanceByPosition(decay=0.98)
        self._model_seconds: float | None = None
        self.enabled = True
        if config.spec_policy == "adaptive":
            self.calibrate()

    @classmethod
    def build(cls, config: EngineConfig, model: Llama, tokenizer: Tokenizer, pool: CachePool) -> SpeculativeRunner:
        from engine.engine import build_pool

        draft = None
        if config.speculative_method in ("draft", "hybrid"):
            path = resolve_model_path(config.draft_model)
            config.draft_model = str(path)
            draft_tokenizer = Tokenizer(path)
            output_ids = None
            if config.draft_vocab_size is not None:
                output_ids = draft_output_ids(path, config.draft_vocab_size, model.shape.vocab_size,
                                              draft_tokenizer.eos_token_ids)
            # a draft's rounding never reaches the output: its one-row steps may take faster kernels
            draft_model = load_llama(path, config.dtype, config.device, config.max_seq_len, output_ids,
                                     row_invariant=False, int8_few_rows=config.draft_quantization == "int8",
                                     token_step=config.cpu_draft_token_step)
            check_compatible(tokenizer, draft_tokenizer, model, draft_model, config.model, config.draft_model)
            # the draft pool mirrors the target's shape (same slots, same block count); its
            # lazily filled KV is never shared, so it has no prefix cache
            draft_pool = build_pool(dataclasses.replace(config, enable_prefix_caching=False), draft_model,
                                    config.num_kv_blocks)
            draft = DraftModelProposer(draft_model, draft_pool)
        return cls(config, model, pool, draft)

    # --- live settings -------------------------------------------------------------------
    def reconfigure(self, method: str | None = None, spec_length: int | None = None,
                    policy: str | None = None, enabled: bool | None = None) -> None:
        """Applies new speculation settings from the next step on (validated like EngineConfig)."""
        if method is not None:
            if method not in ("draft", "ngram", "hybrid"):
                raise ValueError(f"speculative_method must be one of ['draft', 'ngram', 'hybrid'], got {method!r}")
            if method != "ngram" and self.draft is None:
                raise ValueError(f"speculative_method={method!r} needs a draft model; this engine has none")
            self.method = method
        if spec_length is not None:
            if isinstance(spec_length, bool) or not isinstance(spec_length, int) or not 1 <= spec_length <= 64:
                raise ValueError(f"spec_length must be an integer in [1, 64], got {spec_length!r}")
            self.policy.spec_length = spec_length
        if policy is not None:
            if policy not in ("fixed", "adaptive"):
                raise ValueError(f"spec_policy must be 'fixed' or 'adaptive', got {policy!r}")
            self.policy.mode = policy
        if enabled is not None:
            self.enabled = bool(enabled)

    # --- KVAllocator: both pools in lockstep -----------------------------------------------
    def allocate(self, request: Request) -> bool:
        if not super().allocate(request):
            return False
        if self.draft is not None and not self.draft.allocate(request):
            super().free(request)
            request.slot = None
            return False
        return True

    def reserve(self, request: Request, num_new_tokens: int) -> bool:
        if not super().reserve(request, num_new_tokens):
            return False
        if self.draft is None or request.is_prefilling:
            return True
        return self.draft.reserve(request, request.num_tokens + num_new_tokens)

    def free(self, request: Request) -> None:
        super().free(request)
        if self.draft is not None:
            self.draft.free(request)
        self._acceptance.pop(request.request_id, None)

    def decode_tokens(self, request: Request) -> int:
        return self.policy.spec_length + 1 if self.enabled else 1

    def free_kv_tokens(self) -> int | None:
        """Tokens both pools can still take (a None pool has no shared limit)."""
        target = super().free_kv_tokens()
        if self.draft is None:
            return target
        draft = self.draft.pool.free_token_capacity()
        known = [v for v in (target, draft) if v is not None]
        return min(known) if known else None

    def kv_usage_fractions(self) -> dict[str, float]:
        out = super().kv_usage_fractions()
        if self.draft is not None:
            out["draft"] = self.draft.pool.usage_fraction()
        return out

    # --- calibration -------------------------------------------------------------------
    def calibrate(self, repeats: int = 3) -> None:
        """Times target passes for T = 1..K+1 and draft passes (a round's first, which catches
        up on unseen tokens, and the one-token steps after it), at power-of-two batch sizes.

        Each shape runs once untimed first: its first call pays one-off costs (kernel creation,
        cold caches) several times the steady-state step, and a policy fed those would judge
        speculation too expensive from the first step on. The median of `repeats` is recorded."""
        vocab = self.model.shape.vocab_size
        batch = 1
        while True:
            b = min(batch, self.config.max_batch_size)
            # (model, pool, tokens per sequence, table, row of the table): target passes are
            # verify passes (every position's logits); draft tables keep one row
            passes = [(self.model, self.pool, t, self.costs.target, t)
                      for t in range(1, max(self.config.spec_length, 8) + 2)]
            if self.draft is not None:
                # a round's first draft pass catches up on one or two tokens (two after a fully
                # accepted round); the steps after it feed one token each
                passes += [(self.draft.model, self.draft.pool, 2, self.costs.draft_first, 1),
                           (self.draft.model, self.draft.pool, 1, self.costs.draft, 1)]
            for model, pool, t, table, row in passes:
                slots = [pool.allocate_slot([])[0] for _ in range(b)]
                try:
                    chunks = [[i % vocab] * 8 for i in range(b)]
                    forward_chunks(model, pool, slots, chunks, [0] * b)  # context to attend to
                    times = []
                    for i in range(repeats + 1):  # the first run warms up, untimed
                        t0 = time.perf_counter()
                        forward_chunks(model, pool, slots, [[1] * t] * b, [8] * b,
                                       all_logits=table is self.costs.target and t > 1)
                        if i:
                            times.append(time.perf_counter() - t0)
                        for s in slots:
                            pool.truncate_to(s, 8)
                    table.observe(b, row, statistics.median(times))
                finally:
                    for s in slots:
                        pool.free_slot(s)
            if b >= self.config.max_batch_size:
                break
            batch *= 2

    # --- the speculative decode step ---------------------------------------------------
    def step(self, batch: ScheduledBatch) -> list[tuple[Request, list[int]]]:
        self._model_seconds = None  # set by a decode-only step's model passes
        out = super().step(batch)
        if batch.prefill:
            self._model_seconds = None  # prefill steps say nothing about the decode overhead
        return out

    def observe_step_seconds(self, seconds: float) -> None:
        """The engine's wall time for the last step: what the model passes did not take is the
        per-step overhead the policy adds to every choice of K."""
        if self._model_seconds is not None:
            self.costs.observe_overhead(seconds - self._model_seconds)
            self._model_seconds = None

    def _decode(self, reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        stats = DecodeStepStats(batch_size=len(reqs))
        caps = [self._k_cap(r) for r in reqs]
        if not self.enabled:
            choice = Choice(0, "disabled", {})
        else:
            alphas = self._acceptance_rates(reqs)
            draft_rows = 0 if self.method == "ngram" else None  # hybrid: assume the draft may run for all
            adaptive_draft = draft_rows is None and self.policy.mode == "adaptive"
            behind = self.draft.unseen_in_long_runs(reqs) if adaptive_draft else 0
            choice = self.policy.choose(alphas, caps, draft_rows, behind)
        stats.k, stats.reason = choice.k, choice.reason
        if choice.k == 0:
            t0 = time.perf_counter()
            out = super()._decode(reqs)
            self._model_seconds = time.perf_counter() - t0
            self.costs.target.observe(len(reqs), 1, self._model_seconds)
            self.last_decode.reason = choice.reason
            return out
        ks = [min(choice.k, c) for c in caps]
        if choice.reason == "probe":
            ks = self._probe_one(reqs, ks)
        t0 = time.perf_counter()
        proposals, q, sources, drafted = self._propose(reqs, ks)
        draft_seconds = time.perf_counter() - t0
        self.last_phases.draft += draft_seconds
        ks = [len(p) for p in proposals]
        if max(ks) == 0:
            out = super()._decode(reqs)
            self.last_decode.reason = "no_proposal"
            self.last_decode.rows_without_proposal = len(reqs)
            return out
        t1 = time.perf_counter()
        starts = [r.num_computed_tokens for r in reqs]
        logits = forward_chunks(self.model, self.pool, [r.slot for r in reqs],
                                [[r.output_token_ids[-1]] + p for r, p in zip(reqs, proposals)],
                                starts, all_logits=True)  # [N, T, V], T = max(ks) + 1
        k_max = max(ks)
        num_accepted, final = self._accept(reqs, proposals, ks, q, logits)
        verify_seconds = time.perf_counter() - t1
        self.last_phases.target += verify_seconds
        self.costs.target.observe(len(reqs), k_max + 1, verify_seconds)
        self._model_seconds = draft_seconds + verify_seconds
        if drafted is not None:  # a round's draft cost: first pass + steps (lazy prefill apart)
            draft_rows = len(drafted.tokens)
            if drafted.catch_up_tokens:
                self.costs.observe_catch_up(drafted.catch_up_tokens, drafted.catch_up_seconds)
            if drafted.first_pass_seconds > 0:
                self.costs.draft_first.observe(draft_rows, 1, drafted.first_pass_seconds)
            if drafted.steps:
                self.costs.draft.observe(draft_rows, 1, drafted.steps_seconds / drafted.steps)
        stats.accepted_by_position = [0] * k_max
        stats.proposed_by_position = [0] * k_max
        out = []
        for i, r in enumerate(reqs):
            k, a = ks[i], num_accepted[i]
            new_len = starts[i] + a + 1  # g plus the accepted proposals have valid KV
            self.pool.truncate_to(r.slot, new_len)
            r.num_computed_tokens = new_len
            if self.draft is not None:
                self.draft.rollback(r, new_len)
            if k > 0:
                r.spec.num_draft_tokens += k
                r.spec.num_accepted_tokens += a
                r.spec.accepted_per_round.append(a)
                r.spec.proposed_per_round.append(k)
                r.spec.proposers.add(sources[i])
                stats.accepted_per_round.append(a)
                self._acceptance.setdefault(r.request_id, AcceptanceByPosition()).update(a, k)
                self._recent_acceptance.update(a, k)
                for j in range(k):
                    stats.proposed_by_position[j] += 1
                    stats.accepted_by_position[j] += int(j < a)
            else:
                stats.rows_without_proposal += 1
            stats.num_proposed += k
            stats.num_accepted += a
            out.append((r, proposals[i][:a] + [final[i]]))
            stats.num_tokens += a + 1
        self.last_decode = stats
        return out

    _PRIOR_RATE = 0.6  # acceptance assumed before any round was judged
    _RECENT_WEIGHT = 2.0  # rounds' worth of evidence the prior is worth against recent rounds
    _REQUEST_WEIGHT = 16.0  # ... and recent rounds against a request's own

    def _acceptance_rates(self, reqs: list[Request]) -> list[tuple[float, ...]]:
        """Each request's estimated acceptance rates at draft positions 1..spec_length."""
        positions = self.policy.spec_length
        recent = self._recent_acceptance.rates((self._PRIOR_RATE,), self._RECENT_WEIGHT, positions)
        fresh = AcceptanceByPosition()
        return [self._acceptance.get(r.request_id, fresh).rates(recent, self._REQUEST_WEIGHT, positions)
                for r in reqs]

    def _probe_one(self, reqs: list[Request], ks: list[int]) -> list[int]:
        """A probe speculates for one request only, the one the draft has fallen least behind:
        after a run of plain steps every draft KV lags by that many tokens, and catching the
        whole batch up would cost about a draft prefill. The others decode plainly alongside."""
        candidates = [i for i, k in enumerate(ks) if k > 0]
        if not candidates:
            return ks
        if self.draft is None:
            pick = candidates[0]
        else:
            pick = min(candidates, key=lambda i: reqs[i].num_tokens - self.draft.seq_len(reqs[i]))
        return [k if i == pick else 0 for i, k in enumerate(ks)]

    def _k_cap(self, r: Request) -> int:
        """Most tokens r may propose: KV/positions (max_seq_len) and its max_tokens budget."""
        room_kv = self.config.max_seq_len - r.num_tokens  # target KV would reach num_tokens + k
        room_out = r.params.max_tokens - len(r.output_token_ids) - 1  # the final token needs one
        cap = min(room_kv, room_out)
        if r.params.spec_length is not None:
            cap = min(cap, r.params.spec_length)
        return max(0, cap)

    def _propose(self, reqs: list[Request], ks: list[int]):
        n = len(reqs)
        proposals: list[list[int]] = [[] for _ in range(n)]
        sources = ["none"] * n
        if self.method in ("ngram", "hybrid"):
            # hybrid trusts only longer matches; weaker ones go to the draft model
            min_n = self.config.hybrid_ngram_min if self.method == "hybrid" else self.config.ngram_min
            for i, r in enumerate(reqs):
                if ks[i] > 0:
                    proposals[i] = ngram_propose(r.all_token_ids, ks[i], self.config.ngram_max, min_n,
                                                 self.config.ngram_one_token_match_max)
                    if proposals[i]:
                        sources[i] = "ngram"
        q = None
        drafted = None
        want_probs = not all(r.params.greedy and r.params.repetition_penalty == 1.0 for r in reqs)
        if self.method in ("draft", "hybrid"):
            rows = [i for i in range(n) if ks[i] > 0 and not proposals[i]]
            if rows:
                drafted = self.draft.propose([reqs[i] for i in rows], [ks[i] for i in rows], want_probs)
                for j, i in enumerate(rows):
                    proposals[i] = drafted.tokens[j]
                    sources[i] = "draft"
                if drafted.q is not None:
                    k_max = max(len(p) for p in proposals)
                    q = torch.zeros(n, k_max, self.model.shape.vocab_size, device=self.model.device)
                    q[rows, :drafted.q.shape[1]] = drafted.q
        if want_probs:
            k_max = max((len(p) for p in proposals), default=0)
            if q is None:
                q = torch.zeros(n, max(k_max, 1), self.model.shape.vocab_size, device=self.model.device)
            for i, p in enumerate(proposals):
                if sources[i] == "ngram":
                    q[i, torch.arange(len(p)), torch.tensor(p)] = 1.0  # one-hot: q(t) = 1
        return proposals, q, sources, drafted

    def _accept(self, reqs, proposals, ks, q, logits):
        """logits [N, K+1, V] -> (num_accepted list, final token list)."""
        n, k1, vocab = logits.shape
        k_max = k1 - 1
        draft = torch.zeros(n, max(k_max, 1), dtype=torch.long, device=logits.device)  # [N, K]
        for i, p in enumerate(proposals):
            if p:
                draft[i, :len(p)] = torch.tensor(p)
        draft = draft[:, :k_max]
        num_proposed = torch.tensor(ks, device=logits.device)  # [N]
        if q is None:  # every row greedy without penalty: compare argmaxes
            num_accepted, final = verify_greedy(logits.argmax(dim=-1), draft, num_proposed)
            return num_accepted.tolist(), final.tolist()
        rows = SamplingRows.build([r.params for r in reqs], logits.device).repeat_rows(k1)
        seen = None
        if rows.needs_penalty:
            base = context_mask([r.all_token_ids for r in reqs], vocab, logits.device)  # [N, V]
            grown = torch.zeros(n, k1, vocab, dtype=torch.bool, device=logits.device)  # [N, K+1, V]
            for j in range(1, k1):  # position j has also seen t_1..t_j
                grown[:, j] = grown[:, j - 1]
                grown[torch.arange(n), j, draft[:, j - 1]] |= num_proposed >= j
            seen = (grown | base[:, None, :]).reshape(n * k1, vocab)
        p = adjusted_probs(logits.reshape(n * k1, vocab), rows, seen).reshape(n, k1, vocab)  # [N, K+1, V]
        uniforms = torch.stack([torch.rand(k_max, generator=r.generator) for r in reqs]).to(logits.device)  # [N, K]
        result = verify(p, q[:, :k_max], draft, num_proposed, uniforms)
        final = result.final_probs.argmax(dim=-1)  # [N]; greedy rows are one-hot
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            final[random_rows] = sample(result.final_probs[random_rows].cpu(),
                                        [reqs[i].generator for i in random_rows]).to(final.device)
        return result.num_accepted.tolist(), final.tolist()
