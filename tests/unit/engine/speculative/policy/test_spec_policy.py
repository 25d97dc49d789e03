"""The adaptive K policy with injected costs."""

from __future__ import annotations

import pytest

from engine.speculative.policy.costs import MeasuredCosts, TimingTable, batch_bucket
from engine.speculative.policy.fits import line_fit, trusted_line
from engine.speculative.policy.k_choice import (
    AcceptanceByPosition,
    SpecPolicy,
    expected_tokens,
    expected_tokens_table,
    first_pass_widths,
)
from engine.speculative.proposers.ngram import ngram_propose


class MemoryBoundCosts:
    """Verify nearly free while the batch is small; compute-bound (linear in tokens) beyond."""

    def __init__(self, weight_read=10e-3, per_token=0.05e-3, draft=0.8e-3):
        self.weight_read, self.per_token, self.draft = weight_read, per_token, draft

    def target_time(self, batch, tokens_per_seq):
        return max(self.weight_read, self.per_token * batch * tokens_per_seq * 4) + 0.2e-3

    def draft_time(self, batch):
        return self.draft + 0.01e-3 * batch

    def draft_first_time(self, batch):
        return self.draft_time(batch)

    def draft_times(self, batch, k_max):
        return [self.draft_first_time(batch)] * (k_max + 1), [n * self.draft_time(batch) for n in range(max(k_max, 1))]

    def target_weight(self, batch, tokens_per_seq):
        return 1.0

    def verify_times(self, batch, k_max):  # as MeasuredCosts gives them: plain as measured, K >= 1 on trusted_line
        ts = range(1, k_max + 2)
        line = trusted_line([self.target_time(batch, t) for t in ts], [self.target_weight(batch, t) for t in ts],
                            MeasuredCosts.STALE_WEIGHT)
        return [self.target_time(batch, 1)] + line[1:]

    def catch_up_time(self, tokens):
        return 0.0

    def other_times(self, batch, k_max):
        return [self.overhead + self.per_k * k for k in range(k_max + 1)]

    overhead = 0.0
    per_k = 0.0


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.8, 4) - (1 - 0.8 ** 5) / 0.2) < 1e-12


def test_speculates_when_verify_is_nearly_free_and_falls_back_when_expensive():
    policy = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive")
    small = policy.choose([0.8] * 1, [100])
    assert small.k >= 3 and small.reason == "policy"
    big = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive").choose([0.8] * 256, [100] * 256)
    assert big.k == 0
    low_alpha = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive").choose([0.05], [100])
    assert low_alpha.k <= 1


def test_a_long_run_of_plain_steps_is_broken_by_probes_further_and_further_apart():
    """K = 0 brings no new evidence about the proposer, so the policy probes now and then; each
    probe that leaves the verdict at plain decoding doubles the wait, up to a bound."""
    policy = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", probe_every=4)
    choices = [policy.choose([0.05], [100]) for _ in range(4 + 8 + 16 + 32 + 32 + 1)]
    probes = [i for i, c in enumerate(choices) if c.k > 0]
    assert probes == [3, 11, 27, 59, 91]  # waits 4, 8, 16, 32 and 32 (4 * MAX_PROBE_BACKOFF)
    assert SpecPolicy.MAX_PROBE_BACKOFF == 8
    probe = choices[3]
    assert probe.reason == "probe" and probe.k == max(range(1, 6), key=probe.goodput.get)
    # a step that speculates on its merits resets the count and the wait
    assert policy.choose([0.95], [100]).k > 0
    after = [policy.choose([0.05], [100]) for _ in range(4)]
    assert [c.reason for c in after] == ["policy"] * 3 + ["probe"]


def test_a_long_run_of_speculative_steps_is_broken_by_plain_probes_further_and_further_apart():
    """K > 0 never measures the plain pass, so the policy decodes plainly now and then; each plain
    probe that leaves the verdict at speculation doubles the wait, up to the same bound."""
    policy = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", probe_every=4, k_probe_every=0)
    choices = [policy.choose([0.9], [100]) for _ in range(4 + 8 + 16 + 32 + 32 + 1)]
    probes = [i for i, c in enumerate(choices) if c.k == 0]
    assert probes == [3, 11, 27, 59, 91]
    assert all(choices[i].reason == "plain_probe" for i in probes)
    assert all(c.reason == "policy" and c.k > 0 for i, c in enumerate(choices) if i not in probes)
    assert policy.choose([0.9], [100]).k > 0  # the probe leaves the hysteresis on speculation's side
    # a step that decodes plainly on its merits resets the count and the wait
    assert policy.choose([0.01] * 256, [100] * 256).reason == "policy"
    after = [policy.choose([0.9], [100]) for _ in range(4)]
    assert [c.reason for c in after] == ["policy"] * 3 + ["plain_probe"]
    # new settings start the count afresh: three choices before them and three after make no probe
    [policy.choose([0.9], [100]) for _ in range(3)]
    policy.configure(6, "adaptive", None)
    assert [policy.choose([0.9], [100]).reason for _ in range(4)] == ["policy"] * 3 + ["plain_probe"]


def test_every_eighth_speculative_choice_probes_another_k_in_turn():
    """One and two above and below the policy's K in turn, skipping those outside 1..spec_length,
    and every fourth time a K further away; the policy's own K is unchanged by them."""
    policy = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", probe_every=10**6)
    choices = [policy.choose([0.6], [100]) for _ in range(32)]
    best = choices[0].k
    assert best == 3 and all(c.k == best and c.reason == "policy" for i, c in enumerate(choices) if i % 8 != 7)
    assert [c.k - best for c in choices[7::8]] == [1, -1, 2, -2] and {c.reason for c in choices[7::8]} == {"k_probe"}
    top = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", probe_every=10**6)
    probes = [c.k for c in (top.choose([0.99], [100]) for _ in range(24))][7::8]
    assert probes == [4, 3, 4]  # at K = 5 only the steps down remain
    assert [c.k for c in (SpecPolicy(MemoryBoundCosts(), spec_length=1, mode="adaptive").choose([0.9], [100])
                          for _ in range(16))] == [1] * 16  # one K: nothing to probe
    wide = SpecPolicy(MemoryBoundCosts(), spec_length=8, mode="adaptive", probe_every=10**6)
    choices = [wide.choose([0.6], [100]) for _ in range(160)]
    assert choices[0].k == 3
    assert [c.k for c in choices[31::32]] == [6, 7, 8, 6, 7]  # every 4th probe: the K beyond 3 +- 2, in turn
    assert {c.k for i, c in enumerate(choices) if i % 8 == 7 and i % 32 != 31} == {1, 2, 4, 5}


def test_neighbour_probes_walk_the_policy_off_a_k_its_stale_costs_favoured():
    """Calibration priced long verify passes far above what they cost (10 + 3 ms a token against
    10 + 0.5). Measuring only the K in use, the line through that one fresh entry and the stale
    ones keeps long passes overpriced, and the policy stays at the K the calibration favoured;
    probes of the K around it measure the truth, and it climbs to the best K; the far probes keep
    the K it left measured too."""
    def truth(t):
        return (10 + 0.5 * t) * 1e-3

    def run(k_probe_every: int) -> tuple[list[int], list[float]]:
        costs = MeasuredCosts()
        for t in range(1, 10):
            costs.observe_target(16, t, (10 + 3.0 * t) * 1e-3)  # the calibration
        policy = SpecPolicy(costs, spec_length=8, mode="adaptive", k_probe_every=k_probe_every)
        ks = []
        for _ in range(400):
            choice = policy.choose([0.8] * 16, [100] * 16)
            costs.observe_target(16, choice.k + 1, truth(choice.k + 1))
            ks += [choice.k] if choice.reason == "policy" else []
        return ks[-100:], costs.verify_times(16, 8)

    def speed(k):
        return expected_tokens(0.8, k) / truth(k + 1)
    assert max(range(1, 9), key=speed) == 8
    stuck, _ = run(k_probe_every=0)
    assert max(stuck, key=stuck.count) == 4 and speed(4) < 0.92 * speed(8)
    climbed, verify = run(k_probe_every=8)
    assert min(speed(k) for k in climbed) > 0.97 * speed(8)  # K = 6 to 8
    assert verify[1:] == pytest.approx([truth(t) for t in range(2, 10)], rel=0.02)


def test_plain_decoding_is_priced_by_its_own_pass_not_the_verify_line():
    """The verify passes' cost per token falls a little as T grows (batch 32, AMD EPYC AVX2:
    T = 1, 2, 3 at 41.7, 61.7, 79.5 ms), so the line through them prices T = 1 above its own
    figure; plain decoding is priced by that figure, speculation stays on the line."""
    costs = MeasuredCosts()
    for _ in range(40):
        for t, ms in [(2, 61.7), (3, 79.5)]:
            costs.observe_target(32, t, ms * 1e-3)
    costs.observe_target(32, 1, 41.7e-3)  # plain last ran long ago, once
    line = line_fit([41.7, 61.7, 79.5], [costs.target.weight(32, t) for t in (1, 2, 3)])
    assert line[0] > 43.0  # what the policy used to believe about plain decoding
    verify = costs.verify_times(32, 2)
    assert verify[0] == pytest.approx(41.7e-3)
    trusted = trusted_line([41.7, 61.7, 79.5], [costs.target.weight(32, t) for t in (1, 2, 3)], MeasuredCosts.STALE_WEIGHT)
    assert verify[1:] == pytest.approx([v * 1e-3 for v in trusted[1:]])
    for t in (1, 2, 3):
        costs.observe_other(32, t - 1, 2e-3)
    # 32 requests at h = 0.43: K = 1 yields 45.8 tokens a step, ~720 tok/s
    choice = SpecPolicy(costs, spec_length=2, mode="adaptive", hysteresis=0.0).choose([0.43] * 32, [100] * 32)
    assert choice.k == 0
    assert choice.goodput[0] == pytest.approx(32 / 43.7e-3)  # 732 tok/s
    assert 32 / (line[0] * 1e-3 + 2e-3) < 0.99 * choice.goodput[1]  # the line's price: K = 1 by over 1%


def test_a_stale_timing_entry_takes_most_of_a_fresh_observation():
    """An entry's weight decays while the other T of its bucket are measured; a fresh observation
    of it then replaces half the old figure (a plain probe after a long run of speculation; not
    all of it, one step can be off), while an entry in steady use moves by the smoothing factor."""
    table = TimingTable(smoothing=0.2, weight_decay=0.98)
    table.observe(32, 1, 50e-3)
    for _ in range(200):
        table.observe(32, 3, 80e-3)
    assert table.weight(32, 1) < 0.02
    table.observe(32, 1, 40e-3)
    assert table.estimate(32, 1) == pytest.approx(45e-3)
    table.observe(32, 3, 100e-3)
    assert table.estimate(32, 3) == pytest.approx(84e-3)


def test_a_draining_batch_does_not_price_the_full_batch():
    """Passes over a batch whose requests are finishing (20 of 32 rows left) keep their own entry:
    the 32-row figure stays, and sizes between are read on the line through the two."""
    table = TimingTable(smoothing=0.2)
    table.observe(32, 3, 100e-3)
    for _ in range(5):
        table.observe(20, 3, 60e-3)
    assert table.estimate(32, 3) == pytest.approx(100e-3)
    assert table.estimate(20, 3) == pytest.approx(60e-3)
    assert table.estimate(26, 3) == pytest.approx(80e-3)


def test_per_step_overhead_favours_longer_rounds():
    """Overhead paid once per step whatever K is makes each round's extra tokens cheaper."""
    lean, heavy = MemoryBoundCosts(draft=3e-3), MemoryBoundCosts(draft=3e-3)
    heavy.overhead = 20e-3
    k_lean = SpecPolicy(lean, spec_length=8, mode="adaptive", hysteresis=0.0).choose([0.7], [100]).k
    k_heavy = SpecPolicy(heavy, spec_length=8, mode="adaptive", hysteresis=0.0).choose([0.7], [100]).k
    assert k_heavy > k_lean


def test_k_falls_monotonically_with_batch_size_without_cliff():
    ks = []
    for b in [1, 2, 4, 8, 16, 32, 64, 128, 256]:
        policy = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", hysteresis=0.0)
        c = policy.choose([0.7] * b, [100] * b)
        ks.append(c.k)
        # the choice is the best of all K: goodput never below plain decode
        assert c.goodput[c.k] >= c.goodput[0]
    assert ks == sorted(ks, reverse=True) and ks[0] > 0 and ks[-1] == 0


def test_hysteresis_holds_the_switch_between_plain_and_speculation_not_between_ks():
    """Near the batch size where plain decoding starts to win, the choice does not flip between
    K = 0 and K > 0 as estimates wobble; between two K > 0 each step takes the better one."""
    policy = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", hysteresis=0.05, k_probe_every=0)
    free = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", hysteresis=0.0, k_probe_every=0)
    batch = next(b for b in range(1, 257) if free.choose([0.7] * b, [100] * b).k == 0)  # plain just wins
    first = policy.choose([0.7] * (batch - 1), [100] * (batch - 1)).k
    seq = [policy.choose([a] * batch, [100] * batch).k for a in [0.69, 0.71, 0.70, 0.68, 0.72] * 4]
    assert first > 0 and set(seq) == {first}
    wobble = [0.45, 0.75] * 4  # at batch 1 the best K changes with the acceptance rate
    best = [free.choose([a], [100]).k for a in wobble]
    assert len(set(best)) == 2 and [policy.choose([a], [100]).k for a in wobble] == best


def test_fixed_mode_caps_and_hard_disable():
    policy = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="fixed", disable_batch_size=8)
    assert policy.choose([0.1] * 2, [100, 100]).k == 5
    assert policy.choose([0.1] * 2, [3, 2]).k == 3
    c = policy.choose([0.1] * 8, [100] * 8)
    assert (c.k, c.reason) == (0, "disabled_batch_size")
    c = policy.choose([0.9], [0])
    assert (c.k, c.reason) == (0, "length_guard")


def test_expected_tokens_by_position():
    assert abs(expected_tokens((0.8,), 4) - expected_tokens(0.8, 4)) < 1e-12  # one rate: geometric
    assert expected_tokens((0.5, 1.0), 3) == 1 + 0.5 + 0.5 + 0.5  # the last rate carries on
    assert expected_tokens((0.5, 0.0, 1.0), 5) == 1.5


def test_acceptance_by_position_counts_judged_and_accepted_proposals():
    est = AcceptanceByPosition()
    est.update(3, 5)  # positions 1-3 accepted, 4 rejected, 5 never judged
    est.update(5, 5)  # all accepted
    est.update(0, 2)  # the first rejected
    assert est.judged == [3, 2, 2, 2, 1] and est.accepted == [2, 2, 2, 1, 1]
    assert est.rates((0.5,), weight=0.0, positions=6) == (2 / 3, 1.0, 1.0, 0.5, 1.0, 1.0)
    shrunk = est.rates((0.5, 0.5, 0.5, 0.5, 0.5, 0.1), weight=1.0, positions=6)
    assert shrunk[0] == (2 + 0.5) / (3 + 1) and shrunk[5] == 0.1  # no evidence at 6: the prior


def test_untried_positions_borrow_the_last_rate_and_decay_forgets():
    est = AcceptanceByPosition()
    for _ in range(10):
        est.update(1, 1)
    h = est.rates((0.6,), weight=2.0, positions=3)
    assert h[0] == (10 + 2 * 0.6) / 12 and h[1] == h[2] == h[0]
    decayed = AcceptanceByPosition(decay=0.5)
    decayed.update(0, 1)
    decayed.age()
    decayed.update(1, 1)  # the old rejection counts half
    assert decayed.rates((0.6,), weight=0.0, positions=1) == (1 / 1.5,)
    try:
        est.update(3, 2)
    except ValueError as e:
        assert "num_accepted" in str(e)
    else:
        raise AssertionError("more accepted than proposed must be refused")


def test_rates_rising_with_position_make_long_rounds_worth_more():
    """One pooled rate 0.6 puts the best K at 3 here; the same first-position rate followed by
    0.9s (acceptance runs in streaks) makes K = 5 best."""
    flat = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", hysteresis=0.0).choose([0.6], [100])
    rising = SpecPolicy(MemoryBoundCosts(), spec_length=5, mode="adaptive", hysteresis=0.0).choose(
        [(0.6, 0.9, 0.9, 0.9, 0.9)], [100])
    assert flat.k == 3 and rising.k == 5


def test_timing_table_interpolates_between_buckets():
    t = TimingTable(smoothing=1.0)
    t.observe(1, 1, 1.0)
    t.observe(8, 1, 2.0)
    assert t.estimate(1, 1) == 1.0
    assert abs(t.estimate(4, 1) - (1.0 + 3 / 7)) < 1e-9
    assert t.estimate(16, 1) > 2.0  # extrapolates upward
    assert batch_bucket(5) == 8 and batch_bucket(1) == 1


def test_ngram_prompt_lookup():
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert ngram_propose(seq, 2, max_n=3, min_n=1) == [4, 5]
    assert ngram_propose(seq, 10, max_n=3, min_n=1) == [4, 5, 9, 1, 2, 3]
    assert ngram_propose([1, 2, 3, 4], 3, max_n=3, min_n=1) == []  # no earlier occurrence
    # the longest suffix wins over a more recent shorter match
    seq = [7, 8, 1, 2, 0, 5, 2, 6, 7, 8, 1, 2]
    assert ngram_propose(seq, 1, max_n=4, min_n=1) == [0]
    assert ngram_propose(seq, 1, max_n=1, min_n=1) == [6]


def test_ngram_cuts_what_follows_a_one_token_match():
    seq = [5, 1, 2, 3, 4, 9, 8, 7, 5]  # only the last token (5) recurs
    assert ngram_propose(seq, 5, max_n=4, min_n=1) == [1, 2, 3, 4, 9]
    assert ngram_propose(seq, 5, max_n=4, min_n=1, one_token_match_max=2) == [1, 2]
    seq = [5, 6, 1, 2, 3, 4, 9, 5, 6]  # a two-token match keeps its full length
    assert ngram_propose(seq, 4, max_n=4, min_n=1, one_token_match_max=2) == [1, 2, 3, 4]


def test_ngram_rows_cost_no_draft_forward():
    costs = MemoryBoundCosts(draft=5e-3)  # an expensive draft model
    with_draft = SpecPolicy(costs, spec_length=5, mode="adaptive").choose([0.6] * 4, [100] * 4)
    ngram_only = SpecPolicy(costs, spec_length=5, mode="adaptive").choose([0.6] * 4, [100] * 4, draft_rows=0)
    assert ngram_only.k > with_draft.k


def test_a_stale_cheap_verify_entry_does_not_lure_the_policy():
    """Verify times measured for K + 1 = 2, 3 and 5 tokens, and a stale entry for 4 (from
    calibration long ago) that is cheaper than 3: K = 3 must not look cheaper than K = 2; the
    times the policy uses are the line through the trusted entries."""
    class Stale(MemoryBoundCosts):
        def target_time(self, batch, tokens_per_seq):
            return {1: 7e-3, 2: 8.0e-3, 3: 9.0e-3, 4: 6.0e-3, 5: 11e-3}[tokens_per_seq]

        def draft_time(self, batch):
            return 1.8e-3

        def target_weight(self, batch, tokens_per_seq):
            return 0.0 if tokens_per_seq == 4 else 1.0  # last measured long ago

    policy = SpecPolicy(Stale(), spec_length=4, mode="adaptive", hysteresis=0.0)
    choice = policy.choose([0.6], [100])
    verify = [expected_tokens(0.6, k) / choice.goodput[k] - k * 1.8e-3 for k in range(1, 5)]
    assert all(b > a for a, b in zip(verify, verify[1:]))  # K = 3 dearer than K = 2
    assert abs(verify[2] - 10e-3) < 0.1e-3  # on the line 7, 8, 9, (10), 11 ms, not at the stale 6 ms
    assert choice.k == 1


def test_a_stale_dear_verify_entry_does_not_drive_the_policy_off_the_k_above_it():
    """The opposite case: an old entry for 4 tokens measured dear (a slow moment) while the
    pass over 6 tokens, in use every step, costs less. K = 5 must be judged by its own fresh
    measurement, not by the stale K = 3 entry."""
    times = {1: 9.2e-3, 2: 9.7e-3, 3: 10.9e-3, 4: 15.0e-3, 5: 15.0e-3, 6: 11.3e-3}

    class Fresh6(MemoryBoundCosts):
        def target_time(self, batch, tokens_per_seq):
            return times[tokens_per_seq]

        def draft_time(self, batch):
            return 1.1e-3

        def target_weight(self, batch, tokens_per_seq):
            return 40.0 if tokens_per_seq == 6 else 0.3

    rates = (0.8, 0.85, 0.85, 0.85, 0.85)
    choice = SpecPolicy(Fresh6(), spec_length=5, mode="adaptive", hysteresis=0.0).choose([rates], [100])
    assert choice.k == 5
    verify_5 = expected_tokens(rates, 5) / choice.goodput[5] - 5 * 1.1e-3
    assert verify_5 < 11.8e-3  # near its own 11.3 ms, far from the stale 15 ms


def test_noisy_verify_times_give_a_policy_that_does_not_zigzag():
    """Verify times for K + 1 = 1..9 tokens that rise by 1 ms a token, each off by up to 0.8 ms:
    the fitted times rise steadily, so the choice is the K a clean table gives."""
    noise = [0.0, 0.8, -0.8, 0.6, -0.5, 0.7, -0.8, 0.4, -0.6]

    class Noisy(MemoryBoundCosts):
        def __init__(self, jitter):
            super().__init__(draft=1e-3)
            self.jitter = jitter

        def target_time(self, batch, tokens_per_seq):
            return (8 + tokens_per_seq + self.jitter[tokens_per_seq - 1]) * 1e-3

    clean = SpecPolicy(Noisy([0.0] * 9), spec_length=8, mode="adaptive", hysteresis=0.0).choose([0.75] * 4, [100] * 4)
    noisy = SpecPolicy(Noisy(noise), spec_length=8, mode="adaptive", hysteresis=0.0).choose([0.75] * 4, [100] * 4)
    assert noisy.k == clean.k


def test_the_first_draft_pass_is_paid_once_per_round():
    """A round's first draft pass (catch-up on unseen tokens) costs more than the one-token steps
    after it, but only once: K = k costs first + (k - 1) steps, so a costly first pass favours
    longer rounds instead of making every draft token look expensive."""
    class CostlyFirstPass(MemoryBoundCosts):
        def draft_first_time(self, batch):
            return 3e-3

        def draft_time(self, batch):
            return 0.5e-3

    class AveragedFirstPass(MemoryBoundCosts):  # the same 3-token round, charged per token
        def draft_time(self, batch):
            return (3e-3 + 2 * 0.5e-3) / 3

    rates = [0.8] * 8
    costly = SpecPolicy(CostlyFirstPass(), spec_length=8, mode="adaptive", hysteresis=0.0)
    choice = costly.choose([rates], [100])
    verify = CostlyFirstPass().target_time(1, 4)
    assert abs(choice.goodput[3] - expected_tokens(0.8, 3) / (3e-3 + 2 * 0.5e-3 + verify)) < 1e-6
    averaged = SpecPolicy(AveragedFirstPass(), spec_length=8, mode="adaptive", hysteresis=0.0).choose([rates], [100])
    assert abs(averaged.goodput[3] - choice.goodput[3]) < 1e-6  # same cost where they agree
    assert choice.k > averaged.k


def test_first_pass_widths_follow_what_the_proposer_feeds():
    """One request: a head feeding the round's tokens ("round") has a first pass as wide as the
    tokens a round yields, E(K); a draft model ("own") feeds 1, or 2 after a full acceptance.
    Many requests: the longest row sets the width, so it nears K + 1 (round) or 2 (own)."""
    one = expected_tokens_table([0.7], [6], 6)
    assert first_pass_widths(one, [6], "round") == pytest.approx([expected_tokens(0.7, k) for k in range(7)])
    assert first_pass_widths(one, [6], "own") == pytest.approx([1.0] + [1 + 0.7 ** k for k in range(1, 7)])
    many = expected_tokens_table([0.7] * 64, [6] * 64, 6)
    assert first_pass_widths(many, [6] * 64, "round") == pytest.approx([1.0 + k for k in range(7)], abs=0.01)
    assert first_pass_widths(many, [6] * 64, "own")[1:] == pytest.approx([2.0] * 6, abs=0.01)
    capped = expected_tokens_table([0.9], [2], 6)  # a request that may propose 2: no wider than 3
    assert first_pass_widths(capped, [2], "round")[2:] == pytest.approx([1 + 0.9 + 0.81] * 5)
    assert first_pass_widths(capped, [2], "own")[2:] == pytest.approx([1 + 0.81] * 5)  # full at 2 from K = 2 on
    assert first_pass_widths(expected_tokens_table([0.9], [0], 3), [0], "own") == [1.0, 1.0, 1.0, 1.0]


def test_the_expected_tokens_table_holds_each_request_at_its_cap():
    """Rows of the batch's table: a rate repeated, rates by position (the last carried on), and
    a request capped below k_max, whose row stops growing at its cap."""
    table = expected_tokens_table([0.5, (0.5, 1.0), (0.9, 0.8, 0.7)], [4, 4, 1], 4)
    assert [len(row) for row in table] == [5, 5, 5]
    assert table[0] == pytest.approx([1, 1.5, 1.75, 1.875, 1.9375])
    assert table[1] == pytest.approx([1, 1.5, 2.0, 2.5, 3.0])
    assert table[2] == pytest.approx([1, 1.9, 1.9, 1.9, 1.9])


def test_a_first_pass_that_grows_with_the_round_moves_the_policy_to_a_smaller_k():
    """An EAGLE head's first pass feeds every token of the last round: priced at its expected
    width, longer rounds cost more than a draft model's fixed-width first pass, and K falls."""
    class WidthBoundFirstPass(MemoryBoundCosts):
        def draft_times(self, batch, k_max):  # 1 ms plus 0.5 ms per token of the widest row
            return [1e-3 + 0.5e-3 * w for w in range(1, k_max + 2)], [0.5e-3 * n for n in range(k_max)]

    costs = WidthBoundFirstPass()
    own = SpecPolicy(costs, spec_length=8, mode="adaptive", hysteresis=0.0).choose([0.8] * 4, [100] * 4)
    rnd = SpecPolicy(costs, spec_length=8, mode="adaptive", hysteresis=0.0).choose([0.8] * 4, [100] * 4,
                                                                                   catch_up="round")
    assert 0 < rnd.k < own.k
    width = first_pass_widths(expected_tokens_table([0.8] * 4, [8] * 4, 8), [8] * 4, "round")[3]
    seconds = 1e-3 + 0.5e-3 * width + 2 * 0.5e-3 + costs.verify_times(4, 8)[3]
    assert rnd.goodput[3] == pytest.approx(4 * expected_tokens(0.8, 3) / seconds)


def test_a_draft_far_behind_must_win_by_more_than_its_catch_up():
    """Speculation slightly ahead of plain decoding is taken when the draft is current, and when
    it is behind but the requests have many tokens left to spread its catch-up over; not when
    they have few left."""
    class WithCatchUp(MemoryBoundCosts):
        def catch_up_time(self, tokens):
            return tokens * 0.1e-3

    costs = WithCatchUp(draft=1e-3)

    def choose(caps, behind):
        return SpecPolicy(costs, spec_length=4, mode="adaptive", hysteresis=0.0).choose(
            [0.7] * 8, caps, catch_up_tokens=behind)

    current = choose([1000] * 8, 0)
    k = current.k
    assert k > 0 and 0 < current.goodput[k] / current.goodput[0] - 1 < 1  # a real, modest margin
    assert choose([1000] * 8, 8 * 300).k > 0  # 1,000 tokens left each: the catch-up hardly counts
    near_end = choose([40] * 8, 8 * 300)
    assert near_end.k == 0
    tokens = 8 * expected_tokens(0.7, k)
    first, further = costs.draft_times(8, k)
    step = first[0] + further[k - 1] + costs.verify_times(8, k)[k]
    charged = costs.catch_up_time(8 * 300) / (8 * 41 / tokens)
    assert abs(near_end.goodput[k] - tokens / (step + charged)) < 1e-6


def test_a_cost_measured_often_keeps_its_own_figure_where_the_line_misses_it():
    """Batch 1, AVX2 host: a verify pass over 5 tokens (K = 4) cost more than one over 6 (the
    kernel's row groups), which no line through T = 1..6 shows. Measured often and lately, T = 5
    and 6 keep their own figures (K = 5 is priced below K = 4); T = 3, measured once at a noisy
    25 ms, stays near the line."""
    costs = MeasuredCosts()
    costs.observe_target(1, 3, 25e-3)
    for _ in range(30):
        for t, ms in [(1, 7.0), (4, 9.0), (5, 11.0), (6, 10.5)]:
            costs.observe_target(1, t, ms * 1e-3)
    verify = costs.verify_times(1, 5)
    assert verify[4] > verify[5]  # K = 4 dearer than K = 5, as measured
    assert verify[4] == pytest.approx(11.0e-3, rel=0.03) and verify[5] == pytest.approx(10.5e-3, rel=0.03)
    line = line_fit([7.0, 7.0, 25.0, 9.0, 11.0, 10.5], [max(costs.target.weight(1, t), MeasuredCosts.STALE_WEIGHT)
                                                       for t in range(1, 7)])
    assert abs(verify[2] * 1e3 - line[2]) < 0.1 * (25.0 - line[2])  # the noisy entry: on the line, nearly
    fit = line_fit([1.0, 5.0, 3.0], [0.05, 100.0, 0.05])  # the trusted middle entry pulls the line through it
    assert trusted_line([1.0, 5.0, 3.0], [0.0, 100.0, 0.0], 0.05) == pytest.approx(
        [fit[0], (100 * 5.0 + 4 * fit[1]) / 104, fit[2]])


def test_line_fit_is_weighted_least_squares_with_a_slope_never_below_zero():
    assert line_fit([1, 2, 3], [1, 1, 1]) == pytest.approx([1, 2, 3])
    assert line_fit([1, 3, 2, 4], [1, 1, 1, 1]) == pytest.approx([1.3, 2.1, 2.9, 3.7])  # slope 0.8
    assert line_fit([5, 4, 3], [1, 1, 1]) == pytest.approx([4, 4, 4])  # falling: flat at the mean
    assert line_fit([1, 100, 3], [1, 0, 1]) == pytest.approx([1, 2, 3])  # an entry without weight is ignored
    assert line_fit([7], [1]) == pytest.approx([7])



def test_a_rounds_further_draft_steps_are_priced_with_the_fixed_cost_of_their_call():
    """Steps timed together (one call runs a round's K - 1 steps: 0.5 ms of its own plus 0.3 ms
    a step) are priced on the line through them, not at their average: a round of 7 steps costs
    2.6 ms, where 7 times the 4-step average (0.425 ms) would price it 3.0 ms. A count never
    timed is that many single steps until it is."""
    costs = MeasuredCosts()
    assert costs.draft_times(1, 4)[1] == [0.0, 0.0, 0.0, 0.0]  # nothing measured yet
    costs.observe_draft_steps(1, 1, 0.8e-3)
    assert costs.draft_times(1, 4)[1] == pytest.approx([0.0, 0.8e-3, 1.6e-3, 2.4e-3])
    for _ in range(20):
        for n in (2, 4, 6):
            costs.observe_draft_steps(1, n, 0.5e-3 + 0.3e-3 * n)
    further = costs.draft_times(1, 8)[1]
    assert further[0] == 0.0 and further[7] == pytest.approx(2.6e-3, rel=0.05)
    assert further[4] == pytest.approx(1.7e-3, rel=0.05)
    assert costs.draft_times(1, 1)[1] == [0.0]  # K = 1: the first pass alone
    switched = MeasuredCosts()  # an engine set to the adaptive policy after fixed K = 4: no calibration
    for _ in range(10):
        switched.observe_draft_steps(1, 3, 1.4e-3)
    assert switched.draft_times(1, 4)[1] == pytest.approx([0.0, 1.4e-3 / 3, 2.8e-3 / 3, 1.4e-3])  # not 1.4 ms each


def test_time_outside_the_passes_growing_with_k_moves_the_policy_to_a_smaller_k():
    """Sampling, acceptance and bookkeeping over B x (K + 1) logits, which the pass times do not
    see: measured per (batch, K), fitted over the table (other_fit), it moves the policy to a smaller K."""
    costs = MemoryBoundCosts(draft=0.3e-3)
    before = SpecPolicy(costs, spec_length=6, mode="adaptive", hysteresis=0.0).choose([0.8] * 8, [100] * 8)
    assert before.k >= 4
    measured = MeasuredCosts()
    for k, seconds in [(0, 1e-3), (1, 2e-3), (2, 5e-3), (4, 7e-3)]:
        measured.observe_other(8, k, seconds)
    other = measured.other_times(8, 6)
    assert other[0] == pytest.approx(1e-3)
    # one batch size seen: K >= 1 on a + b B (K + 1), least squares over K = 1, 2, 4; K = 3, 5, 6
    # never measured lie on it, K = 1, 2, 4 measured once each keep a fifth of their own figures
    weights = [measured.other.weight(8, k) for k in (1, 2, 4)]
    xs, ys = [8.0 * (k + 1) for k in (1, 2, 4)], [2e-3, 5e-3, 7e-3]
    mx = sum(w * x for w, x in zip(weights, xs)) / sum(weights)
    my = sum(w * y for w, y in zip(weights, ys)) / sum(weights)
    slope = (sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, xs, ys))
             / sum(w * (x - mx) ** 2 for w, x in zip(weights, xs)))
    line = {k: my + slope * (8.0 * (k + 1) - mx) for k in range(1, 7)}
    assert other[3] == pytest.approx(line[3], rel=1e-6) and other[6] == pytest.approx(line[6], rel=1e-6)
    w1 = weights[0]
    assert other[1] == pytest.approx((w1 * 2e-3 + 4.0 * line[1]) / (w1 + 4.0), rel=1e-6)
    assert all(a < b for a, b in zip(other[1:], other[2:]))  # dearer with every K
    assert all(a < b for a, b in zip(measured.other_times(6, 6)[1:], other[1:]))  # fewer rows, cheaper
    costs.per_k = 1.5e-3
    after = SpecPolicy(costs, spec_length=6, mode="adaptive", hysteresis=0.0).choose([0.8] * 8, [100] * 8)
    assert 0 < after.k < before.k


def test_time_outside_the_passes_at_a_batch_never_seen_comes_from_the_whole_table():
    """Seen at batch 1, 4 and 16, a step's other time at batch 64 is priced on the plane through
    them all, not extrapolated from 4 and 16 (a burst at 16 more than doubles that extrapolation;
the plane moves by half as much)."""
    def true(b, k):
        return 0.2e-3 + 0.05e-3 * b + 0.02e-3 * b * k
    measured = MeasuredCosts()
    for _ in range(20):
        for b in (1, 4, 16):
            for k in (0, 1, 2, 3):
                measured.observe_other(b, k, true(b, k))
    assert measured.other_times(64, 3)[1:] == pytest.approx([true(64, k) for k in (1, 2, 3)], rel=1e-6)
    assert measured.other_times(8, 3)[1:] == pytest.approx([true(8, k) for k in (1, 2, 3)], rel=1e-6)
    assert measured.other_times(64, 3)[0] == pytest.approx(true(64, 0), rel=1e-6)  # plain: a + b B
    for _ in range(3):
        measured.observe_other(16, 2, 3 * true(16, 2))  # a burst at batch 16
    two_point = measured.other.estimate(64, 2)  # the table's own extrapolation from 4 and 16
    fitted = measured.other_times(64, 3)[2]
    assert two_point > 2 * true(64, 2) and abs(fitted / true(64, 2) - 1) < 0.5 * abs(two_point / true(64, 2) - 1)
    assert MeasuredCosts().other_times(8, 3) == [0.0] * 4  # nothing measured yet


def test_a_long_catch_up_is_priced_by_a_line_not_by_the_small_ones_per_token():
    """A 5-token catch-up costs a pass's fixed time; priced per token it would make a 1,200-token
    catch-up look 40x dearer than it is."""
    costs = MeasuredCosts()
    assert costs.catch_up_time(100) == 0.0  # nothing measured yet
    costs.observe_catch_up(5, 0.5e-3)
    assert costs.catch_up_time(10) == pytest.approx(1e-3)  # one size seen: proportional
    for _ in range(30):
        costs.observe_catch_up(5, 0.5e-3)
        costs.observe_catch_up(600, 2.0e-3)
    assert costs.catch_up_time(5) == pytest.approx(0.5e-3, rel=0.02)
    assert costs.catch_up_time(1200) == pytest.approx(3.5e-3, rel=0.02)


def test_the_costs_fits_are_kept_until_a_table_changes(monkeypatch):
    """A step's plan and its self-check read the same fits once (costs._read): the second read
    computes nothing; an observation, a restore or a caller editing what it got back never
    leaves a stale figure."""
    import engine.speculative.policy.costs as costs_module

    costs = MeasuredCosts()
    for b in (1, 4, 16):
        for t in range(1, 6):
            costs.observe_target(b, t, 1e-3 * b * (1 + 0.3 * t))
            costs.observe_other(b, t - 1, 1e-4 * b * t)
    fits = []
    real = costs_module.other_fit
    monkeypatch.setattr(costs_module, "other_fit", lambda *a: fits.append(a) or real(*a))
    first = costs.other_times(8, 4)
    assert costs.other_times(8, 4) == first and len(fits) == 2  # K = 0 and K >= 1, fitted once
    verify = costs.verify_times(8, 4)
    verify[2] = 123.0  # the caller's copy
    assert costs.verify_times(8, 4)[2] != 123.0
    costs.observe_other(8, 2, 5.0)  # a new entry at this very batch moves its price
    assert costs.other_times(8, 4)[2] > first[2] and len(fits) == 4
    fresh = MeasuredCosts()
    fresh.restore(costs.snapshot())
    costs.restore(MeasuredCosts().snapshot())  # emptied: nothing measured, nothing kept
    assert costs.other_times(8, 4) == [0.0] * 5
    assert fresh.other_times(8, 4)[2] > first[2]


def test_the_engines_costs_refit_every_few_observations():
    """refit_every = 4: a fit read again after 3 observations is the one already made, after the
    4th it is made afresh; a replaced table is never read through an old fit."""
    costs = MeasuredCosts(refit_every=4)
    for t in range(1, 6):
        costs.observe_target(4, t, 1e-3 * (1 + 0.3 * t))
    first = costs.verify_times(4, 4)
    for _ in range(3):
        costs.observe_target(4, 3, 1.0)  # a far dearer T = 3
    assert costs.verify_times(4, 4) == first
    costs.observe_target(4, 3, 1.0)
    assert costs.verify_times(4, 4)[2] > first[2]
    costs.target = TimingTable()
    assert costs.verify_times(4, 4) != first
    with pytest.raises(ValueError, match="refit_every"):
        MeasuredCosts(refit_every=0)
