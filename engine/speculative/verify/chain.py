"""Exact acceptance of proposed tokens (speculative sampling, Leviathan et al. 2023, Alg. 1).

Terms, for one request in one round with k proposed tokens t_1..t_k:
- p_j: the target's adjusted distribution for the token after the context plus t_1..t_j
  (j = 0..k; k + 1 distributions from one verify pass).
- q_j: the proposer's adjusted distribution t_{j+1} was drawn from (one-hot for n-gram).
- accepted: t_{j+1} is kept with probability min(1, p_j(t_{j+1}) / q_j(t_{j+1})); the first
  rejection ends the round. `num_accepted` counts the kept prefix (0..k).
- recovered token: on the first rejection (at j = num_accepted) one token is drawn from
  norm(max(0, p_j - q_j)). Together with acceptance this makes every emitted token
  distributed exactly as p.
- bonus token: when all k are accepted, one more token is drawn from p_k for free.
Either way a round emits num_accepted + 1 tokens. With greedy requests p and q are one-hot at
their argmaxes, so the same rule reduces to "accept while the target argmax equals t".

Block verification (Sun et al., ICLR 2025) judges the proposal as a block instead of token by
token: a weight w_j = min(1, w_{j-1} p_{j-1}(t_j) / q_{j-1}(t_j)) (w_0 = 1) carries the evidence
of the prefix t_1..t_j, the prefix is kept with probability h_j (w_k for the whole proposal, else
r_j / (r_j + 1 - w_j) with r_j the mass of max(0, w_j p_j - q_j)), num_accepted is the longest kept
prefix, and the recovered token comes from norm(max(0, w_j p_j - q_j)). Exact as well, and it
accepts at least as many tokens in expectation (as many with one-hot q: n-gram, greedy drafting).

`verify` is pure and vectorised over the batch. `accept` applies it to a verify pass: p is the
target's adjusted distribution (engine/sampling.py) at each of the K + 1 positions, the
repetition penalty at position j seeing t_1..t_j. A request with k proposals takes k + 1 draws
from its random stream: k acceptance uniforms, then the final token's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine import host_sync
from engine.logprobs import log_distribution, most_wanted, row_logprob, table
from engine.request import Request
from engine.sampling import Adjustments, SamplingRows, adjusted_probs, inverse_cdf
from engine.speculative.proposers.base import Proposal
from engine.uniforms import draw_uniforms


class Acceptance(NamedTuple):
    num_accepted: torch.Tensor  # [N] int64, 0..num_proposed[i]
    final_probs: torch.Tensor  # [N, V] distribution of the recovered or bonus token
    is_bonus: torch.Tensor  # [N] bool: all proposed tokens were accepted


def acceptance_ratios(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """p_{j-1}(t_j) / q_{j-1}(t_j) for each proposed token [N, K] (0 where q gives it nothing);
    p [N, K+1, V], q [N, K, V], draft [N, K]."""
    idx = draft.unsqueeze(-1)  # [N, K, 1]
    p_tok = p[:, :draft.shape[1]].gather(-1, idx).squeeze(-1)  # [N, K]
    q_tok = q.gather(-1, idx).squeeze(-1)  # [N, K]
    return torch.where(q_tok > 0, p_tok / q_tok.clamp_min(1e-30), torch.zeros_like(p_tok))


def verify(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, num_proposed: torch.Tensor,
           uniforms: torch.Tensor) -> Acceptance:
    """Speculative acceptance for N requests.

    p: [N, K+1, V] target probabilities; q: [N, K, V] proposer probabilities;
    draft: [N, K] int64 proposed tokens (entries past num_proposed[i] are ignored);
    num_proposed: [N] int64 in 0..K; uniforms: [N, K] float in [0, 1).
    """
    N, K1, V = p.shape
    K = K1 - 1
    if K == 0:
        return Acceptance(torch.zeros(N, dtype=torch.long, device=p.device), p[:, 0], torch.ones(N, dtype=torch.bool, device=p.device))
    ratio = acceptance_ratios(p, q, draft)  # [N, K]
    in_range = torch.arange(K, device=p.device)[None, :] < num_proposed[:, None]  # [N, K]
    accept = (uniforms < ratio) & in_range  # [N, K]
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [N]
    is_bonus = num_accepted == num_proposed  # [N]
    rows = torch.arange(N, device=p.device)
    p_at = p[rows, num_accepted]  # [N, V]
    q_at = q[rows, num_accepted.clamp(max=K - 1)]  # [N, V]
    residual = (p_at - q_at).clamp_min(0)  # [N, V]
    mass = residual.sum(-1, keepdim=True)  # [N, 1]
    # a zero residual only arises from rounding when p == q; p itself is then exact
    recovered = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)  # [N, V]
    final = torch.where(is_bonus[:, None], p_at, recovered)  # [N, V]
    return Acceptance(num_accepted, final, is_bonus)


def block_acceptance(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, num_proposed: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's weights and keep probabilities: w [N, K+1] (w_0 = 1) and h [N, K+1]
    (h_0 = 1; h_j for j past num_proposed[i] is 0). p, q, draft, num_proposed as in `verify`."""
    N, K1, V = p.shape
    K = K1 - 1
    ratio = acceptance_ratios(p, q, draft)  # [N, K]
    weights = [torch.ones(N, dtype=p.dtype, device=p.device)]
    for j in range(K):
        weights.append((weights[-1] * ratio[:, j]).clamp(max=1.0))
    w = torch.stack(weights, dim=1)  # [N, K+1]
    # r_j: the mass left for a token after t_1..t_j if the block stopped there (j < K; q_K does not exist)
    r = (w[:, 1:K, None] * p[:, 1:K] - q[:, 1:K]).clamp_min(0).sum(-1)  # [N, K-1]
    denom = r + 1 - w[:, 1:K]  # [N, K-1]
    h_inner = torch.where(denom > 0, r / denom.clamp_min(1e-30), torch.ones_like(r))  # [N, K-1]
    h = torch.cat([torch.ones(N, 1, dtype=p.dtype, device=p.device), h_inner,
                   torch.zeros(N, 1, dtype=p.dtype, device=p.device)], dim=1)  # [N, K+1]
    positions = torch.arange(K1, device=p.device)[None, :]  # [1, K+1]
    h = torch.where(positions == num_proposed[:, None], w, h)  # the whole proposal: kept with prob w_k
    h = torch.where(positions > num_proposed[:, None], torch.zeros_like(h), h)
    h[:, 0] = 1.0
    return w, h


def verify_block(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, num_proposed: torch.Tensor,
                 uniforms: torch.Tensor) -> Acceptance:
    """Block verification for N requests; arguments as in `verify`."""
    N, K1, V = p.shape
    if K1 == 1:
        return verify(p, q, draft, num_proposed, uniforms)
    w, h = block_acceptance(p, q, draft, num_proposed)  # [N, K+1] each
    kept = torch.cat([torch.ones(N, 1, dtype=torch.bool, device=p.device), uniforms < h[:, 1:]], dim=1)  # [N, K+1]
    positions = torch.arange(K1, device=p.device)[None, :].expand(N, K1)  # [N, K+1]
    num_accepted = torch.where(kept, positions, torch.zeros_like(positions)).amax(dim=1)  # [N] the longest kept prefix
    is_bonus = num_accepted == num_proposed  # [N]
    rows = torch.arange(N, device=p.device)
    p_at = p[rows, num_accepted]  # [N, V]
    q_at = q[rows, num_accepted.clamp(max=K1 - 2)]  # [N, V]
    residual = (w[rows, num_accepted][:, None] * p_at - q_at).clamp_min(0)  # [N, V]
    mass = residual.sum(-1, keepdim=True)  # [N, 1]
    recovered = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)  # [N, V]
    final = torch.where(is_bonus[:, None], p_at, recovered)  # [N, V]
    return Acceptance(num_accepted, final, is_bonus)


def verify_greedy(target_argmax: torch.Tensor, draft: torch.Tensor, num_proposed: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy special case without probabilities.

    target_argmax: [N, K+1] int64; draft: [N, K]; num_proposed: [N].
    Returns num_accepted [N] and the final token [N] (target argmax after the accepted prefix).
    """
    N, K1 = target_argmax.shape
    K = K1 - 1
    match = (target_argmax[:, :K] == draft) & (torch.arange(K, device=draft.device)[None, :] < num_proposed[:, None])
    num_accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [N]
    final = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [N]
    return num_accepted, final


def accept(reqs: list[Request], proposal: Proposal, logits: torch.Tensor, raw_logits: torch.Tensor | None = None,
           logprobs_mode: str = "raw", verification: str = "token") -> tuple[list[int], list[int]]:
    """logits [N, K+1, V] -> (accepted proposals per request, final token per request), by the
    token rule or block verification (`verification`: "token" | "block"). Requests
    that ask for logprobs get those of their emitted tokens (the accepted proposals and the final
    token) in pending_logprobs, from the target's distribution at each position (raw_logits: the
    verify pass's before structured-output masks; default `logits`), read in the same transfer."""
    n, k1, _ = logits.shape
    # one upload: each row's proposals padded to K, then their number
    inputs = host_sync.upload([t + [0] * (k1 - 1 - len(t)) + [len(t)] for t in proposal.tokens], logits.device,
                              torch.int64).view(n, k1)  # [N, K+1]
    draft, num_proposed = inputs[:, :k1 - 1], inputs[:, k1 - 1]  # [N, K], [N]
    p = None
    if proposal.q is None:  # every row greedy without penalty: compare argmaxes
        num_accepted, final = verify_greedy(logits.argmax(dim=-1), draft, num_proposed)
    else:
        p = _target_probs(reqs, logits, draft, num_proposed)  # [N, K+1, V]
        # row i: its k_i acceptance uniforms, then the final token's at column k_i; the rest unused
        uniforms = draw_uniforms([r.random_stream for r in reqs], k1, logits.device,
                                 counts=[len(t) + 1 for t in proposal.tokens])  # [N, K+1]
        rule = verify_block if verification == "block" else verify
        result = rule(p, proposal.q[:, :k1 - 1], draft, num_proposed, uniforms[:, :k1 - 1])
        num_accepted = result.num_accepted
        final = inverse_cdf(result.final_probs, uniforms.gather(1, num_proposed[:, None])[:, 0])  # [N]
    k = most_wanted([r.params.logprobs for r in reqs])
    if k is None:
        both = host_sync.read(torch.stack([num_accepted, final]))  # one transfer: [2, N]
        return both[0], both[1]
    # the token emitted at each position: proposals up to the accepted count, then the final one
    emitted = torch.cat([draft, draft.new_zeros(n, 1)], dim=1).scatter_(1, num_accepted[:, None], final[:, None])
    if logprobs_mode == "processed" and p is None:
        p = _target_probs(reqs, logits, draft, num_proposed)
    lp = log_distribution((raw_logits if raw_logits is not None else logits).reshape(n * k1, -1),
                          None if p is None else p.reshape(n * k1, -1), logprobs_mode)  # [N * (K+1), V]
    rows = table(lp, emitted.reshape(-1), k).view(n, -1)  # [N, (K+1) * (2 + 2k)]
    values = host_sync.read(torch.cat([torch.stack([num_accepted, final], dim=1).double(), rows], dim=1))
    width = 2 + 2 * k
    for r, v in zip(reqs, values):
        if r.params.logprobs is not None:
            r.pending_logprobs = [row_logprob(v[2 + j * width:2 + (j + 1) * width], k, r.params.logprobs)
                                  for j in range(int(v[0]) + 1)]
    return [int(v[0]) for v in values], [int(v[1]) for v in values]


def _target_probs(reqs: list[Request], logits: torch.Tensor, draft: torch.Tensor,
                  num_proposed: torch.Tensor) -> torch.Tensor:
    """p [N, K+1, V]: each position's adjusted distribution; the penalties at position j also see
    proposals t_1..t_j (in the context and in the output)."""
    n, k1, vocab = logits.shape
    params = [r.params for r in reqs]
    rows = SamplingRows.build(params, logits.device)
    adjust = Adjustments.build(rows, params, [r.all_token_ids for r in reqs], [r.output_token_ids for r in reqs],
                               vocab, logits.device)
    if adjust is not None:
        adjust = adjust.grown(draft[:, :k1 - 1], num_proposed)
    return adjusted_probs(logits.reshape(n * k1, vocab), rows.repeat_rows(k1), adjust).reshape(n, k1, vocab)
