"""The acceptance rule on hand-built distributions."""

from __future__ import annotations

import torch

from engine.speculative.rejection import verify, verify_greedy


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
