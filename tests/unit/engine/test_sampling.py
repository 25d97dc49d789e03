"""The sampler (engine/sampling.py): the adjusted distribution against each filter written out by
hand on a small vocabulary, the order they apply in, per-row settings in one batch, and seeded
draws by the inverse CDF."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import Adjustments, SamplingRows, adjusted_probs, draw, greedy_or_sample, inverse_cdf
from engine.sampling_params import SamplingParams
from engine.uniforms import RandomStream

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])  # [1, 6]


def probs_of(params: SamplingParams, logits=LOGITS, context=(), output=()) -> torch.Tensor:
    rows = SamplingRows.build([params], "cpu")
    adjust = Adjustments.build(rows, [params], [list(context)], [list(output)], logits.shape[-1], "cpu")
    return adjusted_probs(logits, rows, adjust)[0]


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x - x.max()) / torch.exp(x - x.max()).sum()


def test_temperature_scales_the_logits():
    torch.testing.assert_close(probs_of(SamplingParams(temperature=0.5)), softmax(LOGITS[0] / 0.5))


def test_top_k_top_p_and_min_p_keep_what_each_definition_keeps():
    base = softmax(LOGITS[0])
    top2 = probs_of(SamplingParams(top_k=2))
    torch.testing.assert_close(top2, torch.cat([base[:2] / base[:2].sum(), torch.zeros(4)]))
    # top-p 0.8: the most likely tokens up to 0.8 of the mass, the one crossing it included
    kept = int((base.cumsum(0) - base < 0.8).sum())
    nucleus = probs_of(SamplingParams(top_p=0.8))
    torch.testing.assert_close(nucleus, torch.cat([base[:kept] / base[:kept].sum(), torch.zeros(6 - kept)]))
    floor = probs_of(SamplingParams(min_p=0.3))  # below 0.3 x the top token's probability: dropped
    keep = base >= 0.3 * base.max()
    torch.testing.assert_close(floor, torch.where(keep, base, 0.0) / base[keep].sum())


def test_penalties_and_bias_shift_the_logits_before_temperature():
    params = SamplingParams(temperature=2.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias={5: 4.0})
    context, output = [0, 3, 1], [1, 1]
    want = LOGITS[0].clone()
    want[5] += 4.0  # the bias first
    for t in (0, 3, 1):  # the repetition penalty on everything seen (prompt and output)
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    want[1] -= 0.25 * 2 + 0.5  # frequency per occurrence in the output, presence once
    torch.testing.assert_close(probs_of(params, context=context, output=output), softmax(want / 2.0))


def test_greedy_is_one_hot_at_the_adjusted_argmax():
    out = probs_of(SamplingParams(temperature=0.0, logit_bias={4: 10.0}))
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_rows_of_one_batch_keep_their_own_settings():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=1.0)]
    logits = LOGITS.repeat(3, 1)
    rows = SamplingRows.build(params, "cpu")
    out = adjusted_probs(logits, rows, Adjustments.build(rows, params, [[]] * 3, [[]] * 3, 6, "cpu"))
    assert out[0].argmax() == 0 and out[0].max() == 1.0 and out[1][0] == 1.0
    torch.testing.assert_close(out[2], softmax(LOGITS[0]))


def test_the_inverse_cdf_picks_the_first_token_past_u():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).repeat(4, 1)
    assert inverse_cdf(probs, torch.tensor([0.0, 0.1, 0.31, 0.999])).tolist() == [0, 1, 2, 3]


def test_a_seeded_draw_repeats_and_follows_the_distribution():
    params = [SamplingParams(temperature=1.0, seed=7)]
    probs = softmax(LOGITS[0])[None]
    first = [int(draw(probs, params, [RandomStream(7)])) for _ in range(3)]
    again = [int(draw(probs, params, [RandomStream(7)])) for _ in range(3)]
    assert first == again
    stream = RandomStream(11)
    counts = torch.bincount(torch.stack([draw(probs, params, [stream]) for _ in range(4000)]).view(-1), minlength=6)
    assert (counts / 4000 - probs[0]).abs().max() < 0.03


@pytest.mark.parametrize("keep", [False, True])
def test_greedy_rows_take_the_fast_path_without_probabilities(keep):
    tokens, probs = greedy_or_sample(LOGITS, [SamplingParams(temperature=0.0)], [[1]], [RandomStream(0)],
                                     keep_probs=keep)
    assert tokens.tolist() == [0] and (probs is not None) == keep
