"""A round's plan (`RoundPlan`: its K, why, each request's k) and what a round leaves behind: the
pools rolled back to the accepted tokens (`commit`), and the per-request stats, acceptance
estimates and the step's DecodeStats (`record_round`)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv import KVManager
from engine.request import DecodeStats, Request
from engine.speculative.policy.k_choice import AcceptanceEstimates
from engine.speculative.proposers.base import Proposal


@dataclass(frozen=True)
class RoundPlan:
    k: int  # the step's K (0: plain decoding)
    reason: str  # why: the policy's reason, or a PlainReason
    ks: list[int]  # what each request may propose (<= k)


def commit(kv: KVManager, reqs: list[Request], starts: list[int], proposal: Proposal, num_accepted: list[int],
           finals: list[int]) -> list[tuple[Request, list[int]]]:
    """Rolls both pools back to each request's accepted length; its new tokens."""
    out = []
    for r, start, tokens, a, final in zip(reqs, starts, proposal.tokens, num_accepted, finals):
        kv.rollback(r, start + a + 1)  # g and the accepted proposals have valid K/V
        out.append((r, tokens[:a] + [final]))
    return out


def record_round(reqs: list[Request], plan: RoundPlan, proposal: Proposal, num_accepted: list[int],
                 acceptance: AcceptanceEstimates, chains: bool = True) -> DecodeStats:
    """Per-request stats, acceptance estimates and the step's DecodeStats. chains: the round
    asked each row for plan.ks[i] tokens in a chain (False: trees, whose depth is their shape's)."""
    k_max = proposal.k_max
    stats = DecodeStats(batch_size=len(reqs), k=plan.k, reason=plan.reason,
                        accepted_by_position=[0] * k_max, proposed_by_position=[0] * k_max,
                        row_ks=list(plan.ks))
    for r, k in zip(reqs, plan.ks):
        r.spec.record_k(k)
    asked_for = plan.ks if chains else [len(t) for t in proposal.tokens]
    for r, tokens, source, a, asked in zip(reqs, proposal.tokens, proposal.sources, num_accepted, asked_for, strict=True):
        k = len(tokens)
        stats.num_tokens += a + 1
        if k == 0:
            stats.rows_without_proposal += 1
            continue
        r.spec.record_round(a, k, source)
        # a proposal that stopped short of the K asked (a lookup's match ran out, a grammar cut it)
        # and was accepted whole counts its next position as rejected: the estimates price what asking
        # for K yields, and a row that was asked for 8 and offered 5 gave 6 tokens, not 9
        acceptance.update(r.request_id, a, max(k, asked), (source, not r.params.greedy))
        stats.num_proposed += k
        stats.num_accepted += a
        stats.accepted_per_round.append(a)
        stats.verified_per_round.append(k)
        for j in range(k):
            stats.proposed_by_position[j] += 1
            stats.accepted_by_position[j] += int(j < a)
    acceptance.end_step()
    return stats
