"""Chi-square goodness of fit without scipy (the GPU machines need not have it): the p-value is the
regularised upper incomplete gamma function, torch.special.gammaincc(df / 2, statistic / 2)."""

from __future__ import annotations

import torch


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value that `observed` token counts [V] were drawn from `expected_probs` [V]; bins expected
    fewer than `min_expected` times are pooled into one (the approximation needs it). A count in a
    bin of probability zero is p = 0."""
    observed = observed.double().cpu()
    expected = expected_probs.double().cpu()
    expected = expected / expected.sum() * observed.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df < 1:
        return 1.0
    statistic = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))
