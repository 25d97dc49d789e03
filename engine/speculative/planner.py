"""The round's plan, which step.py executes: each request's k and why, from the settings (fixed,
one-K adaptive or per request: policy/), the batch, the measured costs and the acceptance
estimates; and the plan's prediction for the self-check (self_check.py). The one place that clips
a request's cap (`_cap`: its KV room, max_tokens and own spec_length; each policy clips at
spec_length once more, SpecPolicy.k_max and BatchView.allowed) and the owner of what plans
remember from step to step (the last verdicts, the plain stretch, the exploration budget)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import SpecConfig
from engine.model.transformer import Transformer
from engine.request import Request
from engine.speculative.exploration import EXPLORING, ExplorationBudget, declined, probe_rows
from engine.speculative.plain_steps import PlainStretch, PlainVerdicts
from engine.speculative.policy.calibration import Calibration
from engine.speculative.policy.corrections import Corrections
from engine.speculative.policy.costs import MeasuredCosts
from engine.speculative.policy.k_choice import AcceptanceEstimates, Choice, SpecPolicy
from engine.speculative.policy.per_request import TRIED_ROUNDS, BatchView, PerRequestPolicy, RowPrices
from engine.speculative.proposers.base import Proposer
from engine.speculative.round_stats import RoundPlan
from engine.speculative.self_check import SelfCheck, plain_prediction, round_prediction


class RoundPlanner:
    def __init__(self, settings: SpecConfig, costs: MeasuredCosts, proposer: Proposer, model: Transformer,
                 max_seq_len: int):
        """model: the target (its CUDA graphs, when captured, change what a ragged pass costs)."""
        self.costs, self.model, self.max_seq_len = costs, model, max_seq_len
        self.corrections = Corrections()  # the one-K policy's prices scaled by what the self-check found
        self.policy = SpecPolicy(costs, settings.spec_length, settings.spec_policy, settings.spec_disable_batch_size,
                                 corrections=self.corrections)
        self.acceptance = AcceptanceEstimates()
        self.calibration: Calibration | None = None  # the adaptive policy's start-up costs, when it has them
        self.exploration = ExplorationBudget()  # adaptive: probes held to a share of the steps
        self.self_check = SelfCheck()  # each step's predicted tokens and seconds against what it took
        self.configure(settings, proposer)

    def configure(self, settings: SpecConfig, proposer: Proposer) -> None:
        """New settings or proposer: what the plans remember from step to step starts afresh."""
        self.settings, self.proposer = settings, proposer
        self.policy.configure(settings.spec_length, settings.spec_policy, settings.spec_disable_batch_size)
        self.per_request = PerRequestPolicy(self.costs)  # adaptive with k_per_request: a K for each request
        self.verdicts, self.stretch = PlainVerdicts(), PlainStretch()
        self._last_k, self._last_ks = settings.spec_length, {}  # the last speculative verdict's

    def forget(self, request_id: str) -> None:
        """A request ended: its estimates and plain-stretch state are dropped."""
        self.acceptance.forget(request_id)
        self.per_request.forget(request_id)
        self.stretch.forget(request_id)

    def realized(self, stats, draft: float, verify: float, other: float) -> None:
        """The planned step took these seconds by phase (`stats`: its DecodeStats): the
        self-check records it against its prediction, and the corrections learn from the two."""
        record = self.self_check.realize(stats, draft, verify, other)
        if record is not None:
            p = record.predicted
            self.corrections.observe(p.batch, p.k, {**p.seconds, "gain": p.tokens - p.batch},
                                     {**record.seconds, "gain": record.tokens - p.batch})

    def plan(self, reqs: list[Request], running: Sequence[Request]) -> RoundPlan:
        """This step's plan for `reqs` (`running`: every request the scheduler runs, reqs among
        them), its prediction kept for the self-check. A plan that drafts for a row whose
        features lapsed in a plain stretch is put off one plain step (plain_steps.py)."""
        plan = self._plan(reqs, running)
        if plan.k and self.stretch.lapsed and self.stretch.needs_features(reqs, plan.ks, self.proposer.model_rows(reqs)):
            self.stretch.defer(reqs, plan)
            plan = RoundPlan(0, "no_proposal", [0] * len(reqs))
        self.expect(reqs, plan)
        return plan

    def _plan(self, reqs: list[Request], running: Sequence[Request]) -> RoundPlan:
        if not self.settings.use_speculative_decoding:
            return RoundPlan(0, "disabled", [])
        if all(r.params.spec_length == 0 for r in reqs):
            return RoundPlan(0, "request_opt_out", [])
        if self.settings.spec_policy == "adaptive" and self.calibration is not None \
                and self.calibration.needs(max(len(reqs), len(running))):  # no guesses beyond the sizes measured
            return RoundPlan(0, "unmeasured", [])
        caps = [self._cap(r) for r in reqs]
        held = self.stretch.deferred(reqs)  # put off last step while features came back
        if held is not None:
            ks = [min(k, c) for k, c in zip(held.ks, caps)]
            return RoundPlan(max(ks), held.reason, ks)
        settled = self.policy.settled(len(reqs), caps)
        if settled is None and self.settings.k_per_request:
            return self._per_request_plan(reqs, caps)
        choice = settled or self._one_k_verdict(reqs, caps, running)
        ks = [min(choice.k, c) for c in caps]
        if choice.reason == "probe":
            ks = probe_rows(ks, self.proposer.lag(reqs), self.proposer.model_rows(reqs), self.proposer.long_catch_up)
        return RoundPlan(min(choice.k, max(caps)), choice.reason, ks)  # (priced with joining rows, K may pass these caps)

    def _one_k_verdict(self, reqs: list[Request], caps: list[int], running: Sequence[Request]) -> Choice:
        """The adaptive one-K verdict: the last all-plain one while it holds (plain_steps.py), else
        priced afresh; an exploring one the budget declines gives way to the verdict (exploration.py)."""
        key = self.verdicts.key(reqs, caps, running, self.acceptance.version, self.policy.spec_length)
        if self.verdicts.reuse(key, self.policy):
            choice = Choice(0, "policy", {})
        else:
            choice = self._adaptive_choice(reqs, caps, running)
            self.verdicts.keep(key, choice.k == 0 and choice.reason == "policy")
        if not self.exploration.allow(choice.reason in EXPLORING):
            choice = declined(choice, self._last_k, self.policy.k_max(caps))
        if choice.k and choice.reason == "policy":
            self._last_k = choice.k
        return choice

    def _per_request_plan(self, reqs: list[Request], caps: list[int]) -> RoundPlan:
        """The adaptive policy's K for each request (policy/per_request.py): the last all-plain
        verdict where it still holds, else one priced afresh. A whole step that explores (a plain
        batch's probe, a plain probe) and that the budget declines runs the verdict instead (all
        plain; the last speculative K of each request)."""
        ids = [r.request_id for r in reqs]
        view = BatchView(ids, caps, self.settings.spec_length,
                         self.acceptance.tried(ids, TRIED_ROUNDS) if TRIED_ROUNDS else None, self.acceptance.version)
        chosen = self.per_request.reuse(view)
        if chosen is None:
            models = self.proposer.model_rows(reqs)
            catch_ups = None
            if any(models):  # a request the draft lags far behind pays its catch-up when it drafts
                catch_ups = [self.costs.catch_up_time(n) if n else 0.0 for n in self._long_lags(reqs, models)]
            prices = RowPrices(self._rates(reqs, view.k_max), models, self.proposer.catch_up,
                               self.model.graphs is None, catch_ups,
                               [r.params.max_tokens - len(r.output_token_ids) for r in reqs])
            chosen = self.per_request.choose(view, prices)
        ks, reason = chosen.ks, chosen.reason
        batch_probe = reason == "probe" and sum(1 for k in ks if k) == 1  # a plain batch probing one request
        if not self.exploration.allow(reason == "plain_probe" or batch_probe):
            ks = [0] * len(ks) if batch_probe else [min(self._last_ks.get(i, 0), c) for i, c in zip(ids, view.allowed())]
            reason = "policy"
        elif reason == "policy" and any(ks):
            self._last_ks = dict(zip(ids, ks))
        return RoundPlan(max(ks), reason, ks)

    def _adaptive_choice(self, reqs: list[Request], caps: list[int], running: Sequence[Request]) -> Choice:
        """The policy's K from the requests' acceptance estimates. A long catch-up (prompts the
        model proposer has not read) is paid now and paid back by the steps after it: while
        requests are joining, those run at the batch they make, so the choice is priced there
        (the joining requests' proposer has read none of their text yet). Drafting and catch-ups
        are priced for the rows a model drafts (proposer.model_rows: none of hybrid's lookup rows)."""
        rows = list(reqs)
        models = self.proposer.model_rows(reqs)
        behind = sum(self._long_lags(reqs, models))
        if behind:
            decoding = {id(r) for r in reqs}
            joining = [r for r in running if id(r) not in decoding]
            rows += joining
            caps = caps + [self._cap(r) for r in joining]
            joining_models = self.proposer.model_rows(joining)
            models += joining_models
            long = self.proposer.long_catch_up
            behind += sum(r.num_tokens for r, m in zip(joining, joining_models) if m and r.num_tokens > long)
        rates = self._rates(rows, self.policy.spec_length)
        return self.policy.choose(rates, caps, sum(models), behind, self.proposer.catch_up)

    def _rates(self, reqs: list[Request], positions: int) -> list[tuple[float, ...]]:
        """Each request's acceptance by draft position, from the proposer its proposals will
        come from and whether it samples (AcceptanceKey)."""
        keys = [(source, not r.params.greedy) for r, source in zip(reqs, self.proposer.row_sources(reqs))]
        return self.acceptance.rates([r.request_id for r in reqs], positions, keys)

    def _long_lags(self, reqs: list[Request], models: list[bool]) -> list[int]:
        """Each request's long catch-up (the tokens its draft lags, where more than
        long_catch_up), for the rows a model drafts (models[i]); 0 for the others (a lookup's row
        never feeds the model, so its lag grows without a catch-up being paid)."""
        if not any(models):
            return [0] * len(reqs)
        long = self.proposer.long_catch_up
        return [n if m and n > long else 0 for n, m in zip(self.proposer.lag(reqs), models)]

    def _cap(self, r: Request) -> int:
        """Most tokens r may propose: its KV positions (max_seq_len), its max_tokens budget (the
        final token needs one) and its own spec_length."""
        cap = min(self.max_seq_len - r.num_tokens, r.params.max_tokens - len(r.output_token_ids) - 1)
        if r.params.spec_length is not None:
            cap = min(cap, r.params.spec_length)
        return max(0, cap)

    def expect(self, reqs: list[Request], plan: RoundPlan) -> None:
        """The self-check's prediction for the step `plan` runs (self_check.py)."""
        if not self.settings.use_speculative_decoding:
            return
        if plan.k == 0 or not any(plan.ks):
            self.self_check.expect(plain_prediction(self.costs, len(reqs)))
            return
        models = self.proposer.model_rows(reqs)
        behind = sum(self._long_lags(reqs, [m and k > 0 for m, k in zip(models, plan.ks)]))
        rates = self._rates(reqs, max(plan.ks))
        per_request = self.settings.k_per_request and self.settings.spec_policy == "adaptive"
        k_max = self.policy.k_max([self._cap(r) for r in reqs])  # the range the one-K policy priced
        self.self_check.expect(round_prediction(self.costs, plan.ks, rates, models, self.proposer.catch_up, behind,
                                                per_request, self.model.graphs is None, plan.k, k_max))
