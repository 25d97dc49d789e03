"""From a verify pass's logits to each request's accepted proposals and its final token.

p is the target's adjusted distribution (engine/sampling.py) at each of the K + 1 positions,
with the repetition penalty seeing the proposals before each position; acceptance is
`rejection.verify` (or its greedy special case when no request needs probabilities); the final
token (recovered or bonus) is drawn with each request's own generator.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling import SamplingRows, adjusted_probs, context_mask, sample
from engine.speculative.proposer import Proposal
from engine.speculative.rejection import verify, verify_greedy


def accept(reqs: list[Request], proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """logits [N, K+1, V] -> (accepted proposals per request, final token per request)."""
    n, k1, _ = logits.shape
    draft = torch.zeros(n, k1 - 1, dtype=torch.long)  # [N, K]
    for i, t in enumerate(proposal.tokens):
        draft[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    draft = draft.to(logits.device)
    num_proposed = torch.tensor([len(t) for t in proposal.tokens], device=logits.device)  # [N]
    if proposal.q is None:  # every row greedy without penalty: compare argmaxes
        num_accepted, final = verify_greedy(logits.argmax(dim=-1), draft, num_proposed)
        return num_accepted.tolist(), final.tolist()
    p = _target_probs(reqs, logits, draft, num_proposed)  # [N, K+1, V]
    uniforms = torch.stack([torch.rand(k1 - 1, generator=r.generator) for r in reqs]).to(logits.device)  # [N, K]
    result = verify(p, proposal.q[:, :k1 - 1], draft, num_proposed, uniforms)
    final = result.final_probs.argmax(dim=-1)  # [N]; greedy rows are one-hot
    random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if random_rows:
        final[random_rows] = sample(result.final_probs[random_rows].cpu(),
                                    [reqs[i].generator for i in random_rows]).to(final.device)
    return result.num_accepted.tolist(), final.tolist()


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
            grown[torch.arange(n), j, draft[:, j - 1]] |= num_proposed >= j
        seen = (grown | base[:, None, :]).reshape(n * k1, vocab)
    return adjusted_probs(logits.reshape(n * k1, vocab), rows, seen).reshape(n, k1, vocab)
