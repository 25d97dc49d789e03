"""Speculative engine behaviour: several outputs per step, stats, bookkeeping, config errors."""

from __future__ import annotations

import random

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.config import SpecConfig
from serve_app.cli import build_parser
from tests.helpers import RecordingObserver, make_model, make_tokenizer

PROMPTS = ["def add(a, b):", "class Point:\n    def", "import os\nimport sys\n", "for i in range(10):\n"]


def spec_llm(target, draft, **kw):
    base = dict(model=str(target), draft_model=str(draft), use_speculative_decoding=True, dtype="float32",
                spec_policy="fixed", spec_length=4, max_seq_len=160, max_batch_size=8, block_size=4)
    base.update(kw)
    return LLM(**base)


def test_one_step_emits_several_outputs_per_request_in_order(tiny_model):
    path = str(tiny_model[0])
    llm = spec_llm(path, path, forward_plan="torch")  # draft == target, same kernels: everything accepted
    eng = llm.engine
    rid = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    first = eng.step()  # prefill -> first token
    assert [o.request_id for o in first] == [rid]
    outs = eng.step()  # one speculative round: 4 accepted + bonus
    assert len(outs) == 5 and all(o.request_id == rid for o in outs)
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = eng.get_output(rid)
    assert [o.token_id for o in first + outs] == final.token_ids
    assert final.acceptance_rate == 1.0 and final.num_spec_rounds > 0
    stats = eng.last_step.decode
    assert stats is None or stats.accepted_by_position == [1] * stats.k


def test_stop_inside_a_round_drops_the_rest(tiny_model):
    path = str(tiny_model[0])
    plain = LLM(model=path, dtype="float32", max_seq_len=160).generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop_id = plain.token_ids[3]
    first = plain.token_ids.index(stop_id)
    out = spec_llm(path, path).generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == plain.token_ids[:first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_no_blocks_or_slots_leak_over_200_mixed_requests_with_aborts(tiny_model, tiny_draft, method):
    llm = spec_llm(tiny_model[0], tiny_draft[0], speculative_method=method, spec_policy="adaptive",
                   num_kv_blocks=120)
    eng = llm.engine
    rng = random.Random(0)
    live: list[str] = []
    added = 0
    while added < 200 or eng.has_unfinished_requests():
        while added < 200 and len(live) < 12:
            greedy = rng.random() < 0.5
            params = SamplingParams(temperature=0.0 if greedy else 0.8, top_p=0.9, max_tokens=rng.randint(1, 40),
                                    seed=added, ignore_eos=True, repetition_penalty=rng.choice([1.0, 1.3]))
            prompt = rng.choice(PROMPTS) * rng.randint(1, 3)
            live.append(eng.add_request(prompt, params))
            added += 1
        for out in eng.step():
            if out.finished:
                live.remove(out.request_id)
                eng.release(out.request_id)
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            eng.abort(victim)
            live.remove(victim)
            eng.release(victim)
    for pool in (eng.kv.target, eng.kv.draft):
        assert pool.num_used_blocks() == 0 and pool.num_used_slots() == 0


def test_tokenizer_mismatch_is_a_clear_error(tmp_path, tiny_model):
    other_tok = tmp_path / "tok"
    make_tokenizer(other_tok, vocab_size=300)
    make_model(tmp_path / "draft", other_tok, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    with pytest.raises(ValueError, match="not compatible with target model.*tokenizers differ"):
        spec_llm(tiny_model[0], tmp_path / "draft")


def test_spec_config_validation():
    with pytest.raises(ValueError, match="needs a draft model"):
        SpecConfig(use_speculative_decoding=True, speculative_method="hybrid")
    SpecConfig(use_speculative_decoding=True, speculative_method="ngram")  # needs no draft
    with pytest.raises(ValueError, match="speculative_method"):
        SpecConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="spec_policy"):
        SpecConfig(spec_policy="sometimes")
    with pytest.raises(ValueError, match="ngram_one_token_match_max"):
        SpecConfig(ngram_one_token_match_max=0)
    with pytest.raises(ValueError, match="verification"):
        SpecConfig(verification="tree")
    with pytest.raises(ValueError, match=r"unknown speculative field\(s\): \['spec_lenght'\]"):
        EngineConfig(speculative={"spec_lenght": 3})
    # flat keywords and the nested form are one configuration
    flat = EngineConfig.from_kwargs(draft_model="d", use_speculative_decoding=True, spec_length=3)
    nested = EngineConfig(speculative={"draft_model": "d", "use_speculative_decoding": True, "spec_length": 3})
    assert flat == nested and flat.speculative == SpecConfig(True, "d", spec_length=3)
    assert (flat.draft_model, flat.use_speculative_decoding) == ("d", True)


def test_reconfigure_changes_method_and_validates(tiny_model, tiny_draft):
    llm = spec_llm(tiny_model[0], tiny_draft[0])
    eng = llm.engine
    settings = eng.reconfigure_speculation(speculative_method="ngram", spec_length=2, spec_policy="adaptive")
    assert (settings.speculative_method, settings.spec_length, settings.spec_policy) == ("ngram", 2, "adaptive")
    assert eng.stats()["speculation"]["speculative_method"] == "ngram" and eng.speculation.proposer.name == "ngram"
    assert eng.reconfigure_speculation(verification="block").verification == "block"  # live, like the others
    assert eng.speculation.settings.verification == "block"
    assert eng.reconfigure_speculation(k_per_request=True).k_per_request  # live too
    assert eng.stats()["speculation"]["k_per_request"] is True
    with pytest.raises(ValueError, match="k_per_request"):
        eng.reconfigure_speculation(k_per_request="yes")
    with pytest.raises(ValueError, match="spec_length"):
        eng.reconfigure_speculation(spec_length=0)
    with pytest.raises(ValueError, match=r"unknown speculation field\(s\): \['draft_model'\]"):
        eng.reconfigure_speculation(draft_model="other")
    assert eng.config.speculative.spec_length == 2  # a refused change changes nothing
    ngram_only = LLM(model=str(tiny_model[0]), use_speculative_decoding=True, speculative_method="ngram",
                     dtype="float32", max_seq_len=160)
    with pytest.raises(ValueError, match="needs a draft model"):
        ngram_only.engine.reconfigure_speculation(speculative_method="draft")
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160)
    with pytest.raises(ValueError, match="not configured for this engine"):
        plain.engine.reconfigure_speculation(use_speculative_decoding=True)


def test_cli_flags_map_to_config():
    args = build_parser().parse_args(["--speculative-decoding", "--draft-model", "d", "--spec-length", "3",
                                      "--speculative-method", "hybrid", "--spec-policy", "fixed"])
    assert (args.use_speculative_decoding, args.draft_model, args.spec_length, args.speculative_method,
            args.spec_policy) == (True, "d", 3, "hybrid", "fixed")


def _phase_totals(rec) -> dict[str, float]:
    return {p: rec.total("specserve_engine_seconds_total", phase=p) for p in ("prefill", "draft", "target", "other")}


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_time_is_split_by_phase(tiny_model, tiny_draft, speculative):
    """Every step's wall time lands in exactly one phase; drafting shows up only when speculating."""
    import time

    from engine.metrics import StepMetrics
    from tests.helpers import InMemoryRecorder

    llm = spec_llm(tiny_model[0], tiny_draft[0]) if speculative else \
        LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, max_batch_size=8, block_size=4)
    eng = llm.engine
    rec = InMemoryRecorder()
    metrics = StepMetrics(rec, "m")
    for p in PROMPTS:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    outer = 0.0
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        outer += time.perf_counter() - t0
        step = dict(eng.last_step.phases.items())
        assert all(v >= 0 for v in step.values())
        metrics.on_step(eng, outs)
    totals = _phase_totals(rec)
    assert totals["prefill"] > 0 and totals["target"] > 0 and totals["other"] > 0
    assert (totals["draft"] > 0) == speculative
    assert sum(totals.values()) <= outer  # the phases partition each step's own wall time


@pytest.mark.parametrize("policy", [{}, {"spec_policy": "adaptive", "k_per_request": True}], ids=["fixed", "per_request"])
def test_step_metrics_agree_with_request_stats(tiny_model, tiny_draft, policy, monkeypatch):
    from engine.metrics import METRIC_BY_NAME, StepMetrics
    from tests.helpers import InMemoryRecorder, fixed_step_prices

    fixed_step_prices(monkeypatch)  # the counts are what is checked, and they need rounds that speculate
    llm = spec_llm(tiny_model[0], tiny_draft[0], **policy)
    eng = llm.engine
    rec = InMemoryRecorder()
    metrics = StepMetrics(rec, "m")
    rids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)) for p in PROMPTS]
    while eng.has_unfinished_requests():
        metrics.on_step(eng, eng.step())
    outs = [eng.get_output(r) for r in rids]
    assert rec.total("specserve_draft_tokens_total") == sum(o.num_draft_tokens for o in outs) > 0
    assert rec.total("specserve_draft_accepted_tokens_total") == sum(o.num_accepted_tokens for o in outs)
    assert rec.total("specserve_spec_rounds_total") == sum(o.num_spec_rounds for o in outs)
    assert rec.total("specserve_generation_tokens_total") == 20 * len(PROMPTS)
    assert rec.total("specserve_requests_total", finish_reason="length", proposer="draft") == len(PROMPTS)
    assert rec.total("specserve_accepted_tokens_by_position_total") == rec.total("specserve_draft_accepted_tokens_total")
    ks = [k for key, values in rec.observations.items() if key[0] == "specserve_spec_k_per_request" for k in values]
    assert sum(sum(o.k_chosen.values()) for o in outs) == len(ks) > 0  # every request of every decode step
    assert sum(k * n for o in outs for k, n in o.k_chosen.items()) == sum(ks)
    assert all(max(o.k_chosen) <= 4 for o in outs)  # never past spec_length
    first = rec.total("specserve_accepted_tokens_by_position_total", position="1")
    assert first <= rec.total("specserve_proposed_tokens_by_position_total", position="1")
    for key in list(rec.counters) + list(rec.gauges) + list(rec.observations):
        spec = METRIC_BY_NAME[key[0]]
        assert {k for k, _ in key[1:]} == set(spec.labels)


def test_free_tokens_is_the_min_of_both_pools(tiny_model, tiny_draft):
    llm = spec_llm(tiny_model[0], tiny_draft[0], num_kv_blocks=50)
    kv = llm.engine.kv
    assert kv.free_tokens() == 50 * 4
    req_id = llm.engine.add_request("def add(a, b):" * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.engine.step()  # prefill: target blocks only (the draft catches up lazily)
    target_free = kv.target.free_token_capacity()
    assert kv.free_tokens() == min(target_free, kv.draft.free_token_capacity()) == target_free < 50 * 4
    llm.engine.abort(req_id)
    assert kv.free_tokens() == 50 * 4


def test_a_probe_speculates_for_one_request_and_the_rest_decode_plainly(tiny_model, tiny_draft):
    """A probe (one speculative step after a run of plain ones) drafts for the single request
    the draft lags least behind, so it never costs a draft catch-up over the whole batch."""
    from engine.speculative.policy.k_choice import Choice

    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160).generate(PROMPTS, greedy)
    llm = spec_llm(tiny_model[0], tiny_draft[0], spec_policy="adaptive")
    eng = llm.engine
    eng.speculation.planner.policy.choose = lambda alphas, caps, *rest: Choice(2, "probe", {})
    ids = [eng.add_request(p, greedy) for p in PROMPTS]
    speculating_rows = []
    while eng.has_unfinished_requests():
        eng.step()
        stats = eng.last_step.decode
        if stats is not None and stats.k > 0:
            speculating_rows.append(stats.batch_size - stats.rows_without_proposal)
    assert speculating_rows and set(speculating_rows) == {1}
    assert [eng.get_output(i).token_ids for i in ids] == [o.token_ids for o in reference]


def _priced(costs, verify_per_token: float) -> None:
    """Target pass times at batch 1..4, T = 1..5: 0.2 s a pass, 0.1 s a row for one token, plus
    verify_per_token a row for each further token."""
    from engine.speculative.policy.costs import TimingTable

    costs.target = TimingTable()
    for b in range(1, 5):
        for t in range(1, 6):
            costs.observe_target(b, t, 0.2 + b * (0.1 + verify_per_token * (t - 1)))


def test_verify_rows_without_a_proposal_get_their_own_one_token_pass_where_it_is_priced_cheaper(tiny_model, tiny_draft,
                                                                                                 monkeypatch):
    import engine.speculative.step as step

    eng = spec_llm(tiny_model[0], tiny_draft[0], spec_policy="adaptive").engine
    decoder = eng.speculation
    _priced(decoder.costs, verify_per_token=0.1)  # padding 2 rows to 3 tokens costs more than a second pass
    assert decoder._verify_groups([3, 1, 1, 3]) == [[0, 1, 2, 3]]  # packed, the bare rows cost a token each
    monkeypatch.setattr(step, "packs", lambda model, widths: False)  # as passes replayed from CUDA graphs
    assert decoder._verify_groups([3, 1, 1, 3]) == [[0, 3], [1, 2]]
    assert decoder._verify_groups([3, 2, 3]) == [[0, 1, 2]]  # every row proposes: one pass
    _priced(decoder.costs, verify_per_token=0.001)  # verify nearly free: padding costs less than a second pass
    assert decoder._verify_groups([3, 1, 1, 3]) == [[0, 1, 2, 3]]


def test_calibration_prices_every_count_of_a_rounds_further_draft_steps(tiny_model, tiny_draft):
    """Start-up calibration times one draft step at each power-of-two batch size and enters n of
    them as the price of a round's n further steps, for every n a round may take (spec_length
    4: calibrated up to 8), so no count is priced from another batch size's figure."""
    costs = spec_llm(tiny_model[0], tiny_draft[0], spec_policy="adaptive").engine.speculation.costs
    for batch in (1, 2, 4, 8):
        one = costs.draft.estimate(batch, 1)
        assert one > 0
        assert [costs.draft.estimate(batch, n) for n in range(1, 9)] == pytest.approx([n * one for n in range(1, 9)])
        assert costs.draft_times(batch, 8)[1] == pytest.approx([n * one for n in range(8)])


def test_a_verify_pass_split_in_groups_gives_every_row_the_logits_of_one_pass(tiny_model, tiny_draft):
    import torch

    eng = spec_llm(tiny_model[0], tiny_draft[0]).engine
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [eng.add_request(p, greedy) for p in PROMPTS[:3]]
    while not all(eng.get_output(i).token_ids for i in ids):
        eng.step()
    reqs = [eng.request(i) for i in ids]
    starts = [eng.kv.computed(r) for r in reqs]
    chunks = [[r.output_token_ids[-1]] + extra for r, extra in zip(reqs, [[5, 9], [], [7]])]

    def run(groups):
        logits = eng.runner.verify(reqs, chunks, groups)
        kv_after = [eng.kv.computed(r) for r in reqs]
        for r, s in zip(reqs, starts):
            eng.kv.rollback(r, s)
        return logits, kv_after

    one, kv_one = run([[0, 1, 2]])
    split, kv_split = run([[0, 2], [1]])
    assert one.shape == split.shape == (3, 3, one.shape[-1])
    assert kv_one == kv_split == [s + len(c) for s, c in zip(starts, chunks)]
    for i, c in enumerate(chunks):
        torch.testing.assert_close(split[i, :len(c)], one[i, :len(c)], atol=1e-4, rtol=1e-4)
    assert torch.all(split[1, 1:] == 0)


@pytest.mark.parametrize("packed", [True, False])
def test_a_probe_whose_verify_pass_is_split_stays_exact(tiny_model, tiny_draft, monkeypatch, packed):
    """A probe speculates for one row: packed, one pass; unpacked (graphs), a split pass."""
    import engine.speculative.step as step
    from engine.speculative.policy.k_choice import Choice

    if not packed:
        monkeypatch.setattr(step, "packs", lambda model, widths: False)

    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160).generate(PROMPTS, greedy)
    eng = spec_llm(tiny_model[0], tiny_draft[0], spec_policy="adaptive").engine
    _priced(eng.speculation.costs, verify_per_token=0.1)
    eng.speculation.planner.policy.choose = lambda alphas, caps, *rest: Choice(2, "probe", {})
    passes = []
    verify = eng.runner.verify
    eng.runner.verify = lambda reqs, chunks, groups: passes.append(len(groups)) or verify(reqs, chunks, groups)
    ids = [eng.add_request(p, greedy) for p in PROMPTS]
    while eng.has_unfinished_requests():
        eng.step()
    assert (2 in passes) != packed
    assert [eng.get_output(i).token_ids for i in ids] == [o.token_ids for o in reference]


def test_a_plain_probe_decodes_the_whole_step_plainly_and_measures_the_plain_pass(tiny_model, tiny_draft):
    """A plain probe (one plain step in a run of speculative ones) decodes every request plainly,
    is counted under its own reason, refreshes plain decoding's pass time and step overhead,
    and the rounds after it stay exact."""
    from engine.metrics import StepMetrics
    from engine.speculative.policy.k_choice import Choice
    from tests.helpers import InMemoryRecorder

    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160).generate(PROMPTS, greedy)
    eng = spec_llm(tiny_model[0], tiny_draft[0], spec_policy="adaptive").engine
    costs = eng.speculation.costs
    rec = InMemoryRecorder()
    metrics = StepMetrics(rec, "m")
    turn = iter(range(10 ** 6))
    eng.speculation.planner.policy.choose = lambda *a, **k: Choice(0, "plain_probe", {}) if next(turn) % 2 else \
        Choice(2, "policy", {})
    ids = [eng.add_request(p, greedy) for p in PROMPTS]
    while not all(eng.get_output(i).token_ids for i in ids):  # prefills
        metrics.on_step(eng, eng.step())
    plain_weight, other_weight = costs.target.weight(4, 1), costs.other.weight(4, 0)
    kinds = []
    while eng.has_unfinished_requests():
        metrics.on_step(eng, eng.step())
        kinds.append((eng.last_step.decode.k, eng.last_step.decode.reason))
    assert (0, "plain_probe") in kinds and (2, "policy") in kinds
    assert rec.total("specserve_non_spec_decode_steps_total", reason="plain_probe") == kinds.count((0, "plain_probe"))
    assert costs.target.weight(4, 1) > plain_weight and costs.other.weight(4, 0) > other_weight
    assert [eng.get_output(i).token_ids for i in ids] == [o.token_ids for o in reference]


def test_the_proposers_time_outside_its_passes_counts_in_the_steps_other_time(tiny_model, tiny_draft):
    """What proposing costs beyond the draft passes it times (inputs, the first token's read,
    bookkeeping) goes into the step's time outside its passes for (B, K), which the policy adds to
    that K's price; a plain step after it records its own time outside the passes alone."""
    from engine.speculative.policy.k_choice import Choice

    eng = spec_llm(tiny_model[0], tiny_draft[0], spec_length=3).engine
    costs = eng.speculation.costs
    seen = []
    observe_other = costs.observe_other
    costs.observe_other = lambda b, k, s: (seen.append((b, k, s)), observe_other(b, k, s))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [eng.add_request(p, greedy) for p in PROMPTS]
    while not all(eng.get_output(i).token_ids for i in ids):  # prefills
        eng.step()
    seen.clear()
    passes = costs.draft_pass_seconds
    eng.step()
    phases, drafted = eng.last_step.phases, costs.draft_pass_seconds - passes
    assert eng.last_step.decode.k == 3 and phases.draft > drafted > 0
    assert seen == [(4, 3, pytest.approx(phases.other + phases.draft - drafted))]
    eng.speculation.planner.policy.settled = lambda *a: Choice(0, "policy", {})  # fixed mode: settled without estimates
    eng.step()
    assert eng.last_step.decode.k == 0 and seen[1:] == [(4, 0, pytest.approx(eng.last_step.phases.other))]


def test_draft_reports_its_lazy_prefill_first_pass_and_steps_apart(tiny_model, tiny_draft):
    """The policy's draft-step cost must not absorb the draft's lazy prompt prefill: the draft
    reports the long catch-up apart, and a steady round has none, only a first pass and steps."""
    from engine.speculative.proposers.draft_model import DraftModelProposer

    llm = spec_llm(tiny_model[0], tiny_draft[0])
    eng = llm.engine
    observer = RecordingObserver()
    draft = DraftModelProposer(eng.draft_model, eng.kv, observer, eng.model.shape.vocab_size)
    eng.add_request(PROMPTS[1] * 3, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.step()  # target prefill + first token; the draft has seen nothing yet
    req = next(iter(eng.scheduler.running))
    first = draft.propose([req], [2], with_q=False)
    assert len(first.tokens[0]) == 2 and first.q is None and first.sources == ["draft"]
    assert observer.seen == [("catch_up", req.num_tokens), ("step", 1)]
    eng.kv.rollback(req, eng.kv.computed(req))  # as after a round: both pools hold the accepted tokens
    req.output_token_ids.append(first.tokens[0][0])  # the round's final token: two to catch up on
    assert draft.lag([req]) == [2]
    observer.seen.clear()
    steady = draft.propose([req], [2], with_q=True)
    assert observer.seen == [("first", 1, 2), ("step", 1)]  # one row, two tokens wide
    assert steady.q.shape == (1, 2, eng.model.shape.vocab_size)
    assert draft.lag([req]) == [-1]  # the first proposal's K/V is written (the last one's never is)


def test_requests_that_opt_out_are_counted_apart_from_the_length_guard(tiny_model, tiny_draft):
    """A step whose requests all sent spec_length 0 decodes plainly under its own reason; one
    near max_tokens falls back for length."""
    from engine.metrics import StepMetrics
    from tests.helpers import InMemoryRecorder

    eng = spec_llm(tiny_model[0], tiny_draft[0]).engine
    rec = InMemoryRecorder()
    metrics = StepMetrics(rec, "m")
    for p in PROMPTS[:2]:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, spec_length=0))
    while eng.has_unfinished_requests():
        metrics.on_step(eng, eng.step())
    steps = rec.total("specserve_non_spec_decode_steps_total", reason="request_opt_out")
    assert steps == rec.total("specserve_decode_steps_total") == 7  # 8 tokens: 1 from prefill, 7 decode steps
    assert rec.total("specserve_draft_tokens_total") == 0
    eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        metrics.on_step(eng, eng.step())
    assert rec.total("specserve_non_spec_decode_steps_total", reason="length_guard") == 1


def test_a_catch_up_is_priced_at_the_batch_the_joining_requests_make(tiny_model, tiny_draft):
    """While a request still prefills, the adaptive choice for the decoding ones sees it too:
    its acceptance row, its cap, and its whole text as catch-up, since a catch-up paid now is
    paid back by the steps after it, which it will join. Without a catch-up the step is priced
    at its own batch. The step itself decodes only the requests that are ready, its K within
    their caps (the joining request's cap is larger), and stays exact."""
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # caps <= 3 < spec_length
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[:2] + ["x = [1, 2, 3]\n" * 4]  # the last takes several prefill chunks
    params = [short, short, long]
    plain = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160)
    reference = [plain.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    eng = spec_llm(tiny_model[0], tiny_draft[0], spec_policy="adaptive", max_num_batched_tokens=40).engine
    spec = eng.speculation
    seen = []
    choose = spec.planner.policy.choose

    def spy(alphas, caps, draft_rows=None, catch_up_tokens=0, catch_up="own"):
        seen.append((len(alphas), list(caps), catch_up_tokens))
        return choose(alphas, caps, draft_rows, catch_up_tokens, catch_up)

    spec.planner.policy.choose = spy
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    long_req = eng.scheduler.waiting[-1]
    joined = []
    while eng.has_unfinished_requests():
        ready = [r for r in eng.scheduler.running if not eng.scheduler.is_prefilling(r)]
        behind = sum(n for n in spec.proposer.lag(ready) if n > spec.proposer.long_catch_up)
        prefilling = eng.scheduler.is_prefilling(long_req) and long_req in eng.scheduler.running
        long_tokens = long_req.num_tokens  # as the choice sees it (the step may append its first token)
        before = len(seen)
        eng.step()
        decode = eng.last_step.decode
        if prefilling and decode is not None and len(seen) > before:
            n = len(ready)  # 2, or 1 once a short request has finished
            assert decode.batch_size == n and decode.k <= max(seen[-1][1][:n])
            if behind:
                assert seen[-1][0] == n + 1 and seen[-1][1][n] == long.max_tokens - 1
                assert seen[-1][2] == behind + long_tokens
                joined.append(seen[-1])
            else:  # nothing to catch up on: no investment, the step is priced at its own batch
                assert seen[-1][0] == n and seen[-1][2] == 0
    assert joined, "no step caught up while the long prompt prefilled"
    assert [eng.get_output(i).token_ids for i in ids] == reference
