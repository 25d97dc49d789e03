"""The acceptance rule on hand-built distributions."""

from __future__ import annotations

import itertools

import torch

from engine.speculative.verify.chain import Acceptance, block_acceptance, verify, verify_block, verify_greedy
from tests.helpers import chi2_sequences, continue_with, toy_lm


def test_acceptance_probability_is_min_one_p_over_q():
    # one request, one proposed token (index 0); p(0) = 0.2, q(0) = 0.5 -> accept w.p. 0.4
    p = torch.tensor([[[0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]])  # [1, 2, 3]
    q = torch.tensor([[[0.5, 0.25, 0.25]]])  # [1, 1, 3]
    draft = torch.tensor([[0]])
    n = 20000
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(n, 1, generator=gen)
    res = verify(p.expand(n, -1, -1), q.expand(n, -1, -1), draft.expand(n, -1),
                 torch.ones(n, dtype=torch.long), u)
    rate = res.num_accepted.float().mean().item()
    assert abs(rate - 0.4) < 0.015
    # accepted exactly when u < 0.4
    assert torch.equal(res.num_accepted.bool(), (u[:, 0] < 0.4))


def test_correction_is_normalised_positive_part_of_p_minus_q():
    p = torch.tensor([[[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.5, 0.25, 0.25]]])
    res = verify(p, q, torch.tensor([[0]]), torch.tensor([1]), torch.tensor([[0.99]]))
    assert res.num_accepted.item() == 0 and not res.is_bonus.item()
    # max(0, p - q) = [0, 0.25, 0.05] -> [0, 5/6, 1/6]
    torch.testing.assert_close(res.final_probs[0], torch.tensor([0.0, 5 / 6, 1 / 6]))


def test_bonus_only_when_all_accepted_and_drawn_from_next_p():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.3, 0.3, 0.4]]])  # [1, 3, 3]
    q = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    draft = torch.tensor([[1, 2]])
    res = verify(p, q, draft, torch.tensor([2]), torch.tensor([[0.5, 0.5]]))
    assert res.num_accepted.item() == 2 and res.is_bonus.item()
    torch.testing.assert_close(res.final_probs[0], p[0, 2])
    # second token rejected -> no bonus, correction from position 1
    p2 = p.clone()
    p2[0, 1] = torch.tensor([0.5, 0.5, 0.0])
    res = verify(p2, q, draft, torch.tensor([2]), torch.tensor([[0.5, 0.5]]))
    assert res.num_accepted.item() == 1 and not res.is_bonus.item()
    torch.testing.assert_close(res.final_probs[0], torch.tensor([0.5, 0.5, 0.0]))


def test_rows_with_fewer_or_no_proposals():
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]).expand(2, -1, -1).clone()  # [2, 3, 2]
    q = torch.tensor([[0.0, 1.0], [1.0, 0.0]]).expand(2, -1, -1).clone()  # [2, 2, 2]
    draft = torch.tensor([[1, 0], [1, 0]])
    res = verify(p, q, draft, torch.tensor([1, 0]), torch.zeros(2, 2))
    assert res.num_accepted.tolist() == [1, 0]
    assert res.is_bonus.tolist() == [True, True]
    torch.testing.assert_close(res.final_probs, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))


def test_greedy_accepts_while_argmax_matches():
    target_argmax = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])  # [3, K+1=4]
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 2, 3]])
    n_acc, final = verify_greedy(target_argmax, draft, torch.tensor([3, 3, 3]))
    assert n_acc.tolist() == [3, 1, 0]
    assert final.tolist() == [8, 9, 1]
    n_acc, final = verify_greedy(target_argmax, draft, torch.tensor([2, 0, 3]))
    assert n_acc.tolist() == [2, 0, 0] and final.tolist() == [7, 5, 1]


# --- block verification --------------------------------------------------------------------------
V_SMALL, K_SMALL = 3, 3


def _lm_tables(seed: int, concentration: float = 0.7, one_hot: bool = False) -> dict[tuple, torch.Tensor]:
    return toy_lm(seed, V_SMALL, K_SMALL + 1, concentration, one_hot)


def _rows(target: dict, proposer: dict, drafts: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p [N, K+1, V], q [N, K, V] and the drafts [N, K] for the given proposals."""
    p = torch.stack([torch.stack([target[d[:j]] for j in range(K_SMALL + 1)]) for d in drafts])
    q = torch.stack([torch.stack([proposer[d[:j]] for j in range(K_SMALL)]) for d in drafts])
    return p, q, torch.tensor(drafts)


def _expected_accepted(target: dict, proposer: dict, rule: str) -> float:
    """E[num_accepted] over every proposal (weighted by q), exactly: token rule Σ_i Π_{j<=i}
    min(1, p/q); block rule Σ_i i h_i Π_{j>i} (1 - h_j)."""
    drafts = list(itertools.product(range(V_SMALL), repeat=K_SMALL))
    p, q, draft = _rows(target, proposer, drafts)
    q_x = q.gather(-1, draft[..., None])[..., 0]  # [N, K]
    weight = q_x.prod(-1)  # [N]
    if rule == "token":
        ratio = (p[:, :K_SMALL].gather(-1, draft[..., None])[..., 0] / q_x).clamp(max=1)
        return float((weight * ratio.cumprod(-1).sum(-1)).sum())
    _, h = block_acceptance(p, q, draft, torch.full((len(drafts),), K_SMALL))
    expected = torch.zeros(len(drafts), dtype=torch.float64)
    for i in range(1, K_SMALL + 1):
        expected += i * h[:, i] * (1 - h[:, i + 1:]).prod(-1)
    return float((weight * expected).sum())


def test_block_verification_accepts_at_least_as_many_tokens_in_expectation():
    for seed in range(4):
        target, proposer = _lm_tables(seed), _lm_tables(100 + seed)
        block, token = _expected_accepted(target, proposer, "block"), _expected_accepted(target, proposer, "token")
        assert block >= token - 1e-12
    assert block > token + 0.01  # strictly more on some pair: it is not the token rule in disguise


def _sequences(rule, target: dict, proposer: dict, n: int, seed: int) -> list[tuple]:
    """n rounds of `rule` over proposals drawn from `proposer`, each output continued by sampling
    the target to K + 1 tokens: [n, K + 1] token sequences, which must follow the target."""
    gen = torch.Generator().manual_seed(seed)
    drafts = []
    for _ in range(n):
        d: tuple = ()
        for _ in range(K_SMALL):
            d += (int(torch.multinomial(proposer[d], 1, generator=gen)),)
        drafts.append(d)
    p, q, draft = _rows(target, proposer, drafts)
    res = rule(p, q, draft, torch.full((n,), K_SMALL), torch.rand(n, K_SMALL, generator=gen, dtype=torch.float64))
    final = torch.multinomial(res.final_probs, 1, generator=gen)[:, 0]
    return [continue_with(target, d[:k] + (y,), K_SMALL + 1, gen)
            for d, k, y in zip(drafts, res.num_accepted.tolist(), final.tolist())]


def _chi2_sequences(sequences: list[tuple], target: dict) -> float:
    return chi2_sequences(sequences, target, V_SMALL, K_SMALL + 1)


def _unweighted_block(p, q, draft, num_proposed, uniforms) -> Acceptance:
    """A wrong block rule: the recovered token from norm(max(0, p - q)), the weight left out."""
    good = verify_block(p, q, draft, num_proposed, uniforms)
    rows = torch.arange(p.shape[0])
    k = good.num_accepted
    residual = (p[rows, k] - q[rows, k.clamp(max=q.shape[1] - 1)]).clamp_min(0)
    recovered = residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)
    return good._replace(final_probs=torch.where(good.is_bonus[:, None], good.final_probs, recovered))


def test_block_verification_is_exact_and_the_test_has_teeth():
    """Whole sequences (K + 1 tokens, 81 cells) against the target's joint distribution: block
    verification passes; the same rule with the weight left out of the residual is rejected."""
    target, proposer = _lm_tables(7, concentration=0.5), _lm_tables(8, concentration=0.5)
    assert _chi2_sequences(_sequences(verify_block, target, proposer, 20000, seed=1), target) > 1e-3
    assert _chi2_sequences(_sequences(verify, target, proposer, 20000, seed=2), target) > 1e-3
    assert _chi2_sequences(_sequences(_unweighted_block, target, proposer, 20000, seed=3), target) < 1e-3


def test_block_verification_with_a_deterministic_proposer_and_short_rows():
    """One-hot q (n-gram, greedy drafting) stays exact; rows with fewer or no proposals keep the
    rules of `verify` (nothing past num_proposed is accepted; no proposal: the bonus from p_0)."""
    target, proposer = _lm_tables(3), _lm_tables(4, one_hot=True)
    assert abs(_expected_accepted(target, proposer, "block") - _expected_accepted(target, proposer, "token")) < 1e-12
    assert _chi2_sequences(_sequences(verify_block, target, proposer, 6000, seed=5), target) > 1e-3
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64).expand(2, -1, -1).clone()
    q = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64).expand(2, -1, -1).clone()
    res = verify_block(p, q, torch.tensor([[1, 0], [1, 0]]), torch.tensor([1, 0]), torch.zeros(2, 2, dtype=torch.float64))
    assert res.num_accepted.tolist() == [1, 0] and res.is_bonus.tolist() == [True, True]
    torch.testing.assert_close(res.final_probs, torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64))
