"""A speculative decode step, which executes its plan (planner.py): plan (each request's k) ->
propose (up to k tokens each, with q when sampling needs it) -> verify (one target pass over
[g, t_1..t_k], g the last sampled token) -> accept (exact) -> commit (both pools roll back to the
accepted length). Requests without a proposal ride along with k = 0 (padded in the verify pass, or
in a one-token pass of their own where the measured costs price that cheaper): exactly a plain step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.config import SpecConfig
from engine.grammar import cut_proposals, mask_logits
from engine.kv import KVManager
from engine.model.passes import computed_tokens, packs
from engine.request import DecodeResult, PhaseSeconds, Request
from engine.runner import ModelRunner
from engine.speculative.planner import RoundPlanner
from engine.speculative.policy.costs import MeasuredCosts
from engine.speculative.policy.shape_choice import ShapeChoice
from engine.speculative.policy.tree_width import RankAcceptance
from engine.speculative.proposers.base import Proposal, Proposer
from engine.speculative.proposers.registry import ProposerSources, build_proposer
from engine.speculative.proposers.suffix import SuffixCache
from engine.speculative.round_stats import RoundPlan, commit, record_round
from engine.speculative.verify.chain import accept
from engine.speculative.verify.tree import accept_trees, grammar_masks, takes_trees, tree_logprobs

TREE_COST_SLACK = 0.05  # adaptive: a tree's verify pass may cost this much more than the chain's


def _sampled(reqs: list[Request]) -> bool:
    """Whether the batch's acceptance samples (on the host, for trees) rather than compares argmaxes."""
    return any(r.params.needs_probs for r in reqs)


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, kv: KVManager, settings: SpecConfig, sources: ProposerSources,
                 costs: MeasuredCosts):
        """sources: what proposers are built from (the draft model or head, the suffix cache...)."""
        self.runner = runner
        self.kv = kv
        self.sources = sources
        self.costs = costs
        self.settings = settings
        self._proposer = build_proposer(settings, sources)
        self.planner = RoundPlanner(settings, costs, self._proposer, runner.model, kv.target.max_seq_len)
        self.shapes = ShapeChoice()  # adaptive: chain or tree by their measured rates
        self.ranks = RankAcceptance()  # adaptive: a tree's width by its sibling ranks' measured acceptance
        self._fresh()

    def _fresh(self) -> None:
        """What the steps remember, started afresh (new settings)."""
        self._last_round_tokens: int | None = None  # the widest row of the last decode round
        self._capture_features()

    @property
    def proposer(self) -> Proposer:
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:  # the planner reads the same one
        self._proposer = self.planner.proposer = proposer

    def reconfigure(self, changes: dict) -> SpecConfig:
        """Applies new speculation settings from the next step on (validated as SpecConfig)."""
        settings = self.settings.updated(changes)
        self.suffix_cache.evict(settings.suffix_cache_tokens)
        self.settings = settings
        self.proposer = build_proposer(settings, self.sources)
        self.planner.configure(settings, self.proposer)  # what the plans remember starts afresh
        self._fresh()
        return settings

    @property
    def suffix_cache(self) -> SuffixCache:
        """The replica's finished outputs (suffix decoding), kept across reconfigurations."""
        return self.sources.suffix_cache

    @suffix_cache.setter
    def suffix_cache(self, cache: SuffixCache) -> None:
        self.sources.suffix_cache = cache
        self.proposer = build_proposer(self.settings, self.sources)

    def _capture_features(self) -> None:
        """The target's passes keep the features the proposer reads (an EAGLE-3 head's), if any."""
        layers = self.proposer.target_features if self.settings.use_speculative_decoding else ()
        self.runner.capture = layers
        if not layers:
            self.kv.drop_features()

    def tokens_per_round(self) -> int:
        """KV tokens a request's decode round may write: K + 1 (a tree's nodes + 1)."""
        if not self.settings.use_speculative_decoding:
            return 1
        nodes = self.settings.tree_tokens if self.settings.tree_width > 1 else 0
        return max(self.settings.spec_length, nodes) + 1

    def expected_tokens_per_round(self) -> int:
        """Tokens a request's next decode round is expected to compute: the last round's widest
        row (1 after a plain round), at most tokens_per_round(), which it is until a round ran."""
        worst = self.tokens_per_round()
        return worst if self._last_round_tokens is None else min(worst, self._last_round_tokens)

    def forget(self, request: Request) -> None:
        """A request ended: its acceptance estimate is dropped; a suffix proposer stores its output."""
        self.planner.forget(request.request_id)
        if self.proposer.learns:
            self.proposer.learn(request)

    def observe_step(self, decoded: DecodeResult, phases: PhaseSeconds) -> None:
        """A decode-only step's time outside its model passes, by its (B, K) (not that of a probe
        that left rows out: no (B, K) step), the proposer's own bookkeeping (inputs, the first
        token's read, lookups) included; and the step's realized figures, for the self-check."""
        stats, overhead = decoded.stats, decoded.proposer_overhead
        if stats.reason != "probe" or all(stats.row_ks):
            self.costs.observe_other(stats.batch_size, len(stats.proposed_by_position), phases.other + overhead)
        self.planner.realized(stats, decoded.draft_seconds - overhead, decoded.target_seconds, phases.other + overhead)

    def decode(self, reqs: list[Request], running: Sequence[Request] = ()) -> DecodeResult:
        """One step for `reqs`; `running`: every request the scheduler runs (reqs among them). The
        others decode from a coming step on (still prefilling, or prefilled this step): the
        adaptive choice prices a catch-up with them."""
        plan = self.planner.plan(reqs, running)
        if plan.k == 0:
            return self._plain(reqs, plan.reason)
        # a K probe measures a chain of another K, and its rate is no shape's
        trees = self.settings.tree_width > 1 and self.proposer.drafts_trees and takes_trees(reqs) \
            and plan.reason != "k_probe"
        if trees and self._take_trees(reqs):
            nodes, width = self._tree_shape(reqs, plan.k)
            if width > 1:  # else no sibling rank pays: the round is a chain
                return self._decode_trees(reqs, plan, nodes, width)
        t0, passes = time.perf_counter(), self.costs.draft_pass_seconds
        proposal = self.proposer.propose(reqs, plan.ks, any(r.params.needs_probs for r in reqs))
        masks = None
        if any(r.grammar is not None for r in reqs):  # proposals cut where the grammar forbids them
            tokens, masks = cut_proposals([r.grammar for r in reqs], proposal.tokens, self.runner.model.shape.vocab_size)
            proposal = Proposal(tokens, proposal.q, proposal.sources)
        draft_seconds = time.perf_counter() - t0
        if proposal.k_max == 0:
            return self._plain(reqs, "no_proposal", draft_seconds)
        overhead = max(0.0, draft_seconds - (self.costs.draft_pass_seconds - passes))
        t1 = time.perf_counter()
        starts = [self.kv.computed(r) for r in reqs]
        chunks = [[r.output_token_ids[-1]] + t for r, t in zip(reqs, proposal.tokens)]
        self._last_round_tokens = max(len(c) for c in chunks)
        groups = self._verify_groups([len(c) for c in chunks])
        raw = logits = self.runner.verify(reqs, chunks, groups)  # [N, K+1, V]
        self.planner.stretch.captured(reqs)
        if masks is not None:
            logits = mask_logits(logits, masks)
        num_accepted, finals = accept(reqs, proposal, logits, raw, self.runner.logprobs_mode,
                                      self.settings.verification)
        target_seconds = time.perf_counter() - t1
        if len(groups) == 1:  # a split pass's time is not that of one (B, K + 1) pass
            self._observe_verify([len(c) for c in chunks], target_seconds)
        tokens = commit(self.kv, reqs, starts, proposal, num_accepted, finals)
        if trees:
            self._observe_shape(reqs, False, tokens, time.perf_counter() - t0)
        stats = record_round(reqs, plan, proposal, num_accepted, self.planner.acceptance)
        return DecodeResult(tokens, stats, draft_seconds, target_seconds, overhead)

    def _decode_trees(self, reqs: list[Request], plan: RoundPlan, nodes: int, width: int) -> DecodeResult:
        """A round over token trees: each request's tree (depth at most its k, at most `nodes`
        nodes within its KV room, `width` children a node) verified in one pass, accepted exactly,
        the accepted path's K/V (and target features, for a head) moved into place; a model
        proposer's own state holds only what precedes the round (its next catch-up feeds the
        accepted tokens)."""
        t0 = time.perf_counter()
        budgets = [max(0, min(nodes, self.kv.target.max_seq_len - r.num_tokens - 1)) if k else 0
                   for r, k in zip(reqs, plan.ks)]
        trees = self.proposer.propose_trees(reqs, plan.ks, budgets, width)
        trees, masks = grammar_masks(reqs, trees, self.runner.model.shape.vocab_size)  # [N, T, V] or None
        draft_seconds = time.perf_counter() - t0
        if all(t is None or not len(t) for t in trees):
            return self._plain(reqs, "no_proposal", draft_seconds)
        t1 = time.perf_counter()
        starts = [self.kv.computed(r) for r in reqs]
        chunks = [[r.output_token_ids[-1]] + (list(t.tokens) if t is not None else []) for r, t in zip(reqs, trees)]
        self._last_round_tokens = max(len(c) for c in chunks)
        logits, features = self.runner.verify_trees(reqs, chunks, trees)  # features [N, T, F] while a head reads them
        self.planner.stretch.captured(reqs)
        raw = logits
        if masks is not None:
            logits = mask_logits(logits, masks[:, :logits.shape[1]])
        paths, finals = accept_trees(reqs, trees, logits)
        tree_logprobs(reqs, trees, paths, finals, logits, raw, self.runner.logprobs_mode)
        target_seconds = time.perf_counter() - t1
        self._observe_verify([len(c) for c in chunks], target_seconds)
        self.kv.keep_paths(reqs, starts, paths, features)
        out = []
        for r, start, tree, path, final in zip(reqs, starts, trees, paths, finals):
            self.kv.rollback(r, start + len(path) + 1)
            out.append((r, [tree.tokens[j] for j in path] + [final] if tree is not None else [final]))
        # the policy's estimates and the per-position stats read a tree as the chain it accepted
        # along (its depth); the per-request and metrics counts of proposed tokens are its nodes
        chain_like = Proposal([[0] * (t.depth if t is not None else 0) for t in trees], None,
                              [self.proposer.name if t is not None and len(t) else "none" for t in trees])
        stats = record_round(reqs, plan, chain_like, [len(p) for p in paths], self.planner.acceptance, chains=False)
        for r, tree in zip(reqs, trees):
            if tree is not None and len(tree):
                r.spec.proposed_per_round[-1] = len(tree)
        stats.num_proposed += sum(len(t) - t.depth for t in trees if t is not None)
        stats.verified_per_round = [len(t) for t in trees if t is not None and len(t)]
        self._observe_shape(reqs, True, out, time.perf_counter() - t0)
        if self.settings.spec_policy == "adaptive":
            self.ranks.observe([not r.params.greedy for r in reqs], trees, paths)
        return DecodeResult(out, stats, draft_seconds, target_seconds, 0.0)

    def _take_trees(self, reqs: list[Request]) -> bool:
        """Under the adaptive policy, the shape whose rounds measured faster at this batch
        (shape_choice.py); the fixed policy always takes trees."""
        return self.settings.spec_policy != "adaptive" or self.shapes.take_trees(_sampled(reqs), len(reqs))

    def _observe_shape(self, reqs: list[Request], tree: bool, out: list, seconds: float) -> None:
        if self.settings.spec_policy == "adaptive":
            self.shapes.observe(_sampled(reqs), len(reqs), tree, sum(len(tokens) for _, tokens in out), seconds)

    def _tree_shape(self, reqs: list[Request], k: int) -> tuple[int, int]:
        """(nodes, width) of this round's trees: tree_tokens and tree_width under the fixed policy.
        Under the adaptive one, by the measured costs at this batch: as many nodes as keep the
        verify pass within TREE_COST_SLACK of the chain's of the chosen K (a tree never prices the
        chain out), and the sibling ranks whose measured acceptance pays for a node (tree_width.py)."""
        if self.settings.spec_policy != "adaptive":
            return self.settings.tree_tokens, self.settings.tree_width
        batch, sampled = len(reqs), _sampled(reqs)
        times = self.costs.verify_times(batch, self.settings.tree_tokens)  # K = 0..tree_tokens
        limit = times[min(k, len(times) - 1)] * (1 + TREE_COST_SLACK)
        nodes = max([k] + [n for n in range(k, self.settings.tree_tokens + 1) if times[n] <= limit])
        last = min(nodes, len(times) - 1)
        node_seconds = max(0.0, times[last] - times[last - 1]) / batch if last > 1 else 0.0  # one row's node
        rate = self.shapes.rate(sampled, batch, True)  # tokens per second of tree rounds (all rows)
        rows = [not r.params.greedy for r in reqs]  # which rows sample
        return nodes, self.ranks.width(rows, self.settings.tree_width, node_seconds, 1.0 / rate if rate else None)

    def _observe_verify(self, widths: list[int], seconds: float) -> None:
        """A verify pass's time: by the tokens it computed, and as a (B, widest) pass unless packed."""
        model = self.runner.model
        self.costs.observe_packed(len(widths), computed_tokens(model, widths), len(widths) * max(widths), seconds)
        if not packs(model, widths):
            self.costs.observe_target(len(widths), max(widths), seconds)

    def _verify_groups(self, widths: list[int]) -> list[list[int]]:
        """The verify pass's rows (widths: each row's tokens): one pass over all, rows without a
        proposal padded to the longest; or, where the measured costs price it cheaper, a pass
        over the rows with a proposal and a one-token pass over the rest (a probe speculates for
        one row of the batch; n-gram lookups find no match for some rows)."""
        everyone = [list(range(len(widths)))]
        bare = [i for i, w in enumerate(widths) if w == 1]
        if not bare or packs(self.runner.model, widths):  # packed, the bare rows cost one token each
            return everyone
        proposing = [i for i, w in enumerate(widths) if w > 1]
        k = max(widths) - 1
        together = self.costs.verify_times(len(widths), k)[k]
        apart = self.costs.verify_times(len(bare), 0)[0] + self.costs.verify_times(len(proposing), k)[k]
        return [proposing, bare] if apart < together else everyone

    def _plain(self, reqs: list[Request], reason: str, draft_seconds: float = 0.0) -> DecodeResult:
        self._last_round_tokens = 1
        result = self.planner.stretch.decode(self.runner, reqs, reason)  # no capture under a verdict that stays plain
        self.costs.observe_target(len(reqs), 1, result.target_seconds)
        if reason != "disabled":  # speculation on, and K = 0 chosen for every request
            self.planner.acceptance.end_step(plain=True)
            result.stats.row_ks = [0] * len(reqs)
            for r in reqs:
                r.spec.record_k(0)
        result.draft_seconds = draft_seconds
        if reason == "no_proposal":
            result.stats.rows_without_proposal = len(reqs)
        return result
