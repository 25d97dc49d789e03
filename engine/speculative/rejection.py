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

`verify` is pure and vectorised over the batch. `accept` applies it to a verify pass: p is the
target's adjusted distribution (engine/sampling.py) at each of the K + 1 positions, the
repetition penalty at position j seeing t_1..t_j. A request with k proposals takes k + 1 draws
from its random stream: k acceptance uniforms, then the final token's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine import host_sync
from engine.request import Request
from engine.sampling import SamplingRows, adjusted_probs, context_mask, inverse_cdf
from engine.speculative.proposer import Proposal
from engine.uniforms import draw_uniforms


class Acceptance(NamedTuple):
    num_accepted: torch.Tensor  # [N] int64, 0..num_proposed[i]
    final_probs: torch.Tensor  # [N, V] distribution of the recovered or bonus token
    is_bonus: torch.Tensor  # [N] bool: all proposed tokens were accepted


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
    idx = draft.unsqueeze(-1)  # [N, K, 1]
    p_tok = p[:, :K].gather(-1, idx).squeeze(-1)  # [N, K]
    q_tok = q.gather(-1, idx).squeeze(-1)  # [N, K]
    ratio = torch.where(q_tok > 0, p_tok / q_tok.clamp_min(1e-30), torch.zeros_like(p_tok))  # [N, K]
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


def accept(reqs: list[Request], proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """logits [N, K+1, V] -> (accepted proposals per request, final token per request)."""
    n, k1, _ = logits.shape
    # one upload: each row's proposals padded to K, then their number
    inputs = host_sync.upload([t + [0] * (k1 - 1 - len(t)) + [len(t)] for t in proposal.tokens], logits.device,
                              torch.int64).view(n, k1)  # [N, K+1]
    draft, num_proposed = inputs[:, :k1 - 1], inputs[:, k1 - 1]  # [N, K], [N]
    if proposal.q is None:  # every row greedy without penalty: compare argmaxes
        num_accepted, final = verify_greedy(logits.argmax(dim=-1), draft, num_proposed)
    else:
        p = _target_probs(reqs, logits, draft, num_proposed)  # [N, K+1, V]
        # row i: its k_i acceptance uniforms, then the final token's at column k_i; the rest unused
        uniforms = draw_uniforms([r.random_stream for r in reqs], k1, logits.device,
                                 counts=[len(t) + 1 for t in proposal.tokens])  # [N, K+1]
        result = verify(p, proposal.q[:, :k1 - 1], draft, num_proposed, uniforms[:, :k1 - 1])
        num_accepted = result.num_accepted
        final = inverse_cdf(result.final_probs, uniforms.gather(1, num_proposed[:, None])[:, 0])  # [N]
    both = host_sync.read(torch.stack([num_accepted, final]))  # one transfer: [2, N]
    return both[0], both[1]


def _target_probs(reqs: list[Request], logits: torch.Tensor, draft: torch.Tensor,
                  num_proposed: torch.Tensor) -> torch.Tensor:
    """p [N, K+1, V]: each position's adjusted distribution; the repetition penalty at position
    j also sees proposals t_1..t_j."""
    n, k1, vocab = logits.shape
    rows = SamplingRows.build([r.params for r in reqs], logits.device).repeat_rows(k1)
    seen = None
    if rows.needs_penalty:
        base = context_mask([r.all_token_ids for r in reqs], vocab, logits.device)  # [N, V]
        grown = torch.zeros(n, k1, vocab, dtype=torch.bool, device=logits.device)  # [N, K+1, V]
        for j in range(1, k1):
            grown[:, j] = grown[:, j - 1]
            grown[torch.arange(n, device=logits.device), j, draft[:, j - 1]] |= num_proposed >= j
        seen = (grown | base[:, None, :]).reshape(n * k1, vocab)
    return adjusted_probs(logits.reshape(n * k1, vocab), rows, seen).reshape(n, k1, vocab)
