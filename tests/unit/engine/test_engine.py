"""Engine behaviour: batching invariance, seeds, chunked prefill, preemption, prefix reuse, stops."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.config import with_embedded_defaults
from engine.metrics import StepMetrics
from engine.tokenizer import ChatPrompt
from tests.helpers import REPO, InMemoryRecorder, greedy

PROMPTS = [
    "def add(a, b):",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x",
    "for i in range(10):\n",
    "import os",
    "The quick brown fox",
    "x",
    "print(os.path.join('a', 'b'))\n" * 3,
    "def f():\n    return 1\n",
]


def make_llm(path, **kw):
    base = dict(model=str(path), dtype="float32", max_seq_len=160, max_batch_size=8, block_size=4)
    base.update(kw)
    return LLM(**base)



@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_greedy_tokens_do_not_depend_on_the_batch(tiny_model, backend):
    llm = make_llm(tiny_model[0], kv_cache_backend=backend)
    alone = [llm.generate(p, greedy(20))[0].token_ids for p in PROMPTS]
    batched = [o.token_ids for o in llm.generate(PROMPTS, greedy(20))]
    assert batched == alone


def test_seeded_sampling_is_reproducible_alone_and_in_any_batch(tiny_model):
    llm = make_llm(tiny_model[0])
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=16, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    reversed_batch = [o.token_ids for o in llm.generate(PROMPTS[::-1], params[::-1])][::-1]
    assert batched == alone == reversed_batch
    other_seed = llm.generate(PROMPTS[0], SamplingParams(temperature=0.9, max_tokens=16, seed=99,
                                                         ignore_eos=True))[0].token_ids
    assert other_seed != alone[0]


def test_chunked_prefill_and_small_budget_give_the_same_tokens(tiny_model):
    ref = [o.token_ids for o in make_llm(tiny_model[0]).generate(PROMPTS, greedy(20))]
    chunked = make_llm(tiny_model[0], max_num_batched_tokens=7)
    assert [o.token_ids for o in chunked.generate(PROMPTS, greedy(20))] == ref


@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_preemption_by_recompute_finishes_everything_with_the_same_tokens(tiny_model, backend):
    ref = [o.token_ids for o in make_llm(tiny_model[0], kv_cache_backend=backend).generate(PROMPTS, greedy(40))]
    # 12 blocks of 4 tokens cannot hold 8 sequences of ~50 tokens: the scheduler must preempt
    kw = dict(num_kv_blocks=40) if backend == "paged" else dict(max_batch_size=3)
    small = make_llm(tiny_model[0], kv_cache_backend=backend, **kw)
    outs = small.generate(PROMPTS, greedy(40))
    assert [o.token_ids for o in outs] == ref
    assert all(small.engine.request(o.request_id) is None for o in outs)  # released
    assert small.engine.kv.target.num_used_slots() == 0


def test_preemption_happens_and_is_counted(tiny_model):
    llm = make_llm(tiny_model[0], num_kv_blocks=40)
    eng = llm.engine
    recorder = InMemoryRecorder()
    metrics = StepMetrics(recorder, "m")
    ids = [eng.add_request(p, greedy(40)) for p in PROMPTS]
    while eng.has_unfinished_requests():
        metrics.on_step(eng, eng.step())
    per_request = sum(eng.request(i).num_preemptions for i in ids)
    assert per_request > 0
    assert eng.num_preemptions_total == per_request
    assert recorder.total("specserve_preemptions_total", model="m") == per_request
    assert eng.kv.target.num_used_blocks() == 0


@pytest.mark.parametrize("spec", [False, True])
def test_a_preempted_request_waits_until_it_fits_with_room_to_decode(tiny_model, tiny_draft, spec):
    """Admission leaves running requests room for a decode round, so a request preempted in one
    step is never readmitted in that step, nor while the pool cannot hold it and the others' next
    round (without that guard every step preempts and recomputes the same request)."""
    kw = dict(use_speculative_decoding=True, draft_model=str(tiny_draft[0]), spec_policy="fixed",
              spec_length=3) if spec else {}
    llm = make_llm(tiny_model[0], num_kv_blocks=40, **kw)
    eng = llm.engine
    schedule, batches = eng.scheduler.schedule, []

    def recording():
        free_before = eng.kv.free_tokens()
        batch = schedule()
        batches.append((batch, free_before))
        return batch

    eng.scheduler.schedule = recording
    ids = [eng.add_request(p, greedy(40)) for p in PROMPTS]
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.num_preemptions_total > 0
    for batch, _ in batches:
        admitted = {id(r) for r, _ in batch.prefill}
        assert not any(id(r) in admitted for r in batch.preempted)
    # the thrash it prevents: with 8 requests of ~50 tokens in 160 tokens of KV, admitting
    # whatever fits preempted ~10x as often
    assert eng.num_preemptions_total <= 2 * len(ids)


def test_decodes_take_the_budget_of_the_round_they_run_not_the_widest_one_allowed(tiny_model):
    """Trees of 12 nodes may write 13 tokens a round, and that KV is reserved; but the step's
    token budget is charged what the speculation last ran: requests that decode plainly (here,
    opted out) all decode together. Charged 13 each, 8 of them would exceed the budget of 48 and
    leave the rest unprefilled until the first ones finish."""
    llm = make_llm(tiny_model[0], max_num_batched_tokens=48, use_speculative_decoding=True,
                   speculative_method="ngram", spec_policy="fixed", spec_length=4, tree_width=3, tree_tokens=12)
    eng = llm.engine
    assert eng.speculation.tokens_per_round() == 13
    ids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, spec_length=0))
           for p in PROMPTS]
    widest, outs = 0, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o.token_id)
        if eng.last_step.decode is not None:
            widest = max(widest, eng.last_step.decode.batch_size)
    assert widest == len(PROMPTS)
    plain = make_llm(tiny_model[0]).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [[t for t in outs[i] if t >= 0] for i in ids] == [o.token_ids for o in plain]


def test_prefix_cache_prefills_only_the_uncached_tail(tiny_model):
    llm = make_llm(tiny_model[0], kv_cache_backend="paged", block_size=4)
    prompt = PROMPTS[6]
    first = llm.generate(prompt, greedy(8))[0]
    second = llm.generate(prompt, greedy(8))[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_prompt_tokens == 0
    assert second.num_cached_prompt_tokens == ((n - 1) // 4) * 4 > 0
    assert second.token_ids == first.token_ids
    nocache = make_llm(tiny_model[0], enable_prefix_caching=False)
    nocache.generate(prompt, greedy(8))
    assert nocache.generate(prompt, greedy(8))[0].num_cached_prompt_tokens == 0


def test_abort_frees_kv_and_leaves_others_untouched(tiny_model):
    llm = make_llm(tiny_model[0])
    ref = llm.generate(PROMPTS[1], greedy(30))[0].token_ids
    eng = llm.engine
    keep = eng.add_request(PROMPTS[1], greedy(30))
    drop = [eng.add_request(p, greedy(30)) for p in PROMPTS[2:6]]
    eng.step()
    eng.step()
    for rid in drop:
        out = eng.abort(rid)
        assert out.finished and out.finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.get_output(keep).token_ids == ref
    assert eng.kv.target.num_used_blocks() == 0 and eng.kv.target.num_used_slots() == 0


def test_stop_strings_stop_token_ids_eos_and_length(tiny_model):
    llm = make_llm(tiny_model[0])
    base = llm.generate(PROMPTS[0], greedy(30))[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]  # spans whatever token boundaries lie there
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.find(stop)]
    assert out.token_ids == base.token_ids[:len(out.token_ids)]
    tid = base.token_ids[4]
    first = base.token_ids.index(tid)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop_token_ids=[tid]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]
    assert base.finish_reason == "length" and len(base.token_ids) == 30


def test_streamed_text_equals_full_decode(tiny_model):
    llm = make_llm(tiny_model[0])
    eng = llm.engine
    rids = [eng.add_request(p, SamplingParams(temperature=1.0, max_tokens=40, seed=i, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    pieces = {r: [] for r in rids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            pieces[o.request_id].append(o.text)
    for r in rids:
        out = eng.get_output(r)
        assert "".join(pieces[r]) == out.text == eng.tokenizer.decode(out.token_ids)
        assert all("\ufffd" not in p for p in pieces[r][:-1]) or "\ufffd" in out.text


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.1, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k"),
    ("max_tokens", 0, "max_tokens"),
    ("min_p", 2.0, "min_p"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("stop", [""], "stop"),
    ("seed", -1, "seed"),
])
def test_bad_sampling_params_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_bad_requests_and_config_raise_clear_errors(tiny_model):
    llm = make_llm(tiny_model[0])
    eng = llm.engine
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("", greedy(20))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], greedy(20))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request([1, 10**6], greedy(20))
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.add_request("x", SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):  # a lone surrogate ("\\ud800" in JSON)
        eng.add_request("def f\ud800", greedy(20))
    with pytest.raises(ValueError, match=r"messages\[1\].content is not valid Unicode"):
        eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "user", "content": "\udfff"}])
    with pytest.raises(ValueError, match="unknown EngineConfig"):
        LLM(model=str(tiny_model[0]), temprature=1.0)
    with pytest.raises(ValueError, match="kv_cache_backend"):
        EngineConfig(kv_cache_backend="ring")
    with pytest.raises(ValueError, match="needs a draft model"):
        EngineConfig.from_kwargs(use_speculative_decoding=True)
    for removed in ("batching_mode", "use_cuda_graphs", "draft_quantization", "cpu_draft_token_step"):
        with pytest.raises(ValueError, match=f"unknown EngineConfig field.*{removed}"):
            EngineConfig.from_kwargs(**{removed: True})
    with pytest.raises(ValueError, match="spec_length"):
        EngineConfig.from_kwargs(spec_length=0)
    with pytest.raises(ValueError, match="forward_plan must be 'auto', 'torch' or a mapping"):
        EngineConfig(forward_plan="fastest")
    with pytest.raises(FileNotFoundError, match="Hugging Face cache"):
        LLMEngine(EngineConfig(model="no-such-org/no-such-model"))
    # a bad request does not disturb the ones already queued
    ok = eng.add_request(PROMPTS[0], greedy(5))
    with pytest.raises(ValueError):
        eng.add_request([-1], greedy(20))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(eng.get_output(ok).token_ids) == 5


def test_a_chat_prompt_is_tokenized_by_the_engine_through_the_chat_template(tiny_model):
    eng = make_llm(tiny_model[0]).engine
    chat = ChatPrompt([{"role": "user", "content": "hi"}])
    eng.tokenizer.hf.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
    ids = eng.tokenize_prompt(chat)
    assert ids == eng.tokenizer.hf.encode("[user]hi[assistant]", add_special_tokens=False) != eng.tokenize_prompt("hi")
    rid = eng.add_request(chat, greedy(4))
    assert eng._requests[rid].prompt_token_ids == ids


def test_repetition_penalty_changes_greedy_output(tiny_model):
    llm = make_llm(tiny_model[0])
    plain = llm.generate(PROMPTS[0], greedy(30))[0].token_ids
    pen = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  repetition_penalty=5.0))[0].token_ids
    assert pen != plain
    assert len(set(pen)) > len(set(plain))


def test_a_failure_while_processing_one_request_fails_only_that_request(tiny_model):
    llm = make_llm(tiny_model[0])
    ref = [o.token_ids for o in llm.generate(PROMPTS[:4], greedy(12))]
    eng = llm.engine
    ids = [eng.add_request(p, greedy(12)) for p in PROMPTS[:4]]

    def hook(req):
        if req.request_id == ids[1] and len(req.output_token_ids) >= 3:
            raise RuntimeError("injected fault")

    eng.fault_hook = hook
    while eng.has_unfinished_requests():
        eng.step()
    outs = [eng.get_output(i) for i in ids]
    assert outs[1].finish_reason == "error" and "injected fault" in outs[1].error
    assert [outs[i].token_ids for i in (0, 2, 3)] == [ref[i] for i in (0, 2, 3)]
    assert eng.kv.target.num_used_blocks() == 0


def test_prefill_groups_pad_no_row_past_twice_its_length():
    from engine.model.passes import width_groups

    lengths = [40] * 50 + [200, 3, 1, 17, 16]
    groups = width_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert all(longest < 2 * lengths[i] or longest == lengths[i] == 1 for i in g), (g, longest)
    assert [sorted({lengths[i] for i in g}) for g in groups] == [[1], [3], [16], [17], [40], [200]]


def test_max_seq_len_defaults_to_the_models_positions_within_a_memory_share(tiny_model):
    """A model with 512 positions gets max_seq_len 512 (not a constant that would refuse it);
    on a device with too little memory for max_batch_size such sequences' KV, it is lowered."""
    from engine.kv_sizing import KV_MEMORY_SHARE, default_max_seq_len
    from engine.model.loader import read_shape

    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_batch_size=4)
    assert llm.config.max_seq_len == 512 == read_shape(tiny_model[0]).max_position_embeddings
    shape = read_shape(tiny_model[0])
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4  # float32 bytes
    memory = int(100 * per_token * 4 / KV_MEMORY_SHARE)  # room for 4 sequences of 100 tokens
    assert default_max_seq_len([shape], 4, 4, memory) == 100
    assert default_max_seq_len([shape, shape], 4, 4, memory) == 50  # a draft's KV counts too
    assert default_max_seq_len([shape], 4, 4, 10**15) == 512


def test_a_default_max_seq_len_fits_the_kv_blocks_asked_for(tiny_model):
    """With only num_kv_blocks given, the default max_seq_len is what those blocks hold."""
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_batch_size=4, block_size=4, num_kv_blocks=50)
    assert llm.config.max_seq_len == 200


def test_kv_pools_are_sized_from_the_free_memory_both_models_counted(tiny_model, tiny_draft):
    """Without num_kv_blocks, each pool gets what kv_cache_memory_fraction of the reported free
    memory, less the activation reserve, holds for every model's KV (at most max_batch_size full
    sequences); an explicit num_kv_blocks wins; too little memory for one sequence is a ValueError
    saying so."""
    from engine.kv_sizing import activation_bytes, kv_bytes_per_token
    from engine.model.loader import read_shape

    target, draft = read_shape(tiny_model[0]), read_shape(tiny_draft[0])
    alone, both = kv_bytes_per_token([target], [4]), kv_bytes_per_token([target, draft], [4, 4])
    assert both > alone
    reserve = {False: activation_bytes([target], [4], 8, 0, 512, 256),  # activations of the largest pass
               True: activation_bytes([target, draft], [4, 4], 8, 5, 512, 256)}  # (speculating: K = 5)

    def engine(free: int, **kw) -> LLMEngine:
        config = EngineConfig.from_kwargs(model=str(tiny_model[0]), dtype="float32", max_batch_size=8, max_seq_len=256,
                                          block_size=16, forward_plan="torch", **kw)
        return LLMEngine(config, free_memory=lambda device: free)

    free = 40 * 16 * both * 2  # 40 blocks of both models' KV at fraction 0.5
    assert engine(reserve[False] + free, kv_cache_memory_fraction=0.5).config.num_kv_blocks \
        == 40 * both // alone  # target only
    spec = dict(draft_model=str(tiny_draft[0]), use_speculative_decoding=True, spec_policy="fixed")
    sized = engine(reserve[True] + free, kv_cache_memory_fraction=0.5, **spec)
    assert sized.config.num_kv_blocks == 40 and sized.stats()["num_kv_blocks"] == 40
    assert sized.kv.target.free_token_capacity() == sized.kv.draft.free_token_capacity() == 40 * 16
    assert engine(10**15).config.num_kv_blocks == 8 * 256 // 16  # plenty: max_batch_size full sequences
    assert engine(free, num_kv_blocks=100, **spec).config.num_kv_blocks == 100  # explicit wins
    with pytest.raises(ValueError, match="kv_cache_memory_fraction.*one sequence of max_seq_len 256"):
        engine(reserve[True] + 15 * 16 * both, kv_cache_memory_fraction=1.0, **spec)  # 15 blocks < 16 for one sequence
    with pytest.raises(ValueError, match="8 slots"):
        engine(free // 4, kv_cache_backend="slotted", **spec)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=0.0)


@pytest.mark.parametrize("path", sorted(REPO.glob("serve_config*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_serve_config_is_a_valid_engine_config(path):
    """The served config and the GPU examples (not run here) validate as EngineConfig, and their
    user_config as live speculation changes, so a typo surfaces in CI rather than on a GPU."""
    import yaml

    app = yaml.safe_load(path.read_text())["applications"][0]
    config = EngineConfig.from_kwargs(**with_embedded_defaults(app["args"].get("engine") or {}))
    assert config.speculative.updated(app["deployments"][0].get("user_config") or {}).use_speculative_decoding


def test_the_embedded_target_speculates_with_its_head_unless_the_draft_method_is_asked_for():
    def spec(**kwargs):
        return EngineConfig.from_kwargs(**with_embedded_defaults(kwargs)).speculative

    default = spec()
    assert (default.speculative_method, default.draft_model) == ("eagle", "embedded:eagle3")
    assert default.use_speculative_decoding
    assert spec(speculative_method="draft").draft_model == "embedded:draft"  # flat, as LLM(...) takes it
    assert spec(speculative={"speculative_method": "draft"}).draft_model == "embedded:draft"
    assert spec(speculative_method="hybrid").draft_model == "embedded:eagle3"
    assert spec(speculative_method="draft", draft_model="/my/draft").draft_model == "/my/draft"
    assert spec(model="/my/target").draft_model is None  # a model given: no embedded proposer


def test_samples_of_one_prompt_read_it_from_the_prefix_cache(tiny_model):
    """A request sharing another's prompt (OpenAI's n) is admitted once that prompt is in KV and
    computes only its last, partial block; a mismatched prompt is refused."""
    llm = LLM(model=str(tiny_model[0]), dtype="float32", max_seq_len=160, block_size=4, enable_prefix_caching=True)
    eng = llm.engine
    prompt = list(range(5, 23))  # 18 tokens: four full blocks of 4, then 2
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    first = eng.add_request(prompt, params)
    others = [eng.add_request(prompt, SamplingParams(**{**vars(params), "seed": i}), shares_prompt_of=first)
              for i in range(2)]
    eng.step()
    assert [eng.request(r).status.value for r in [first, *others]] == ["running", "waiting", "waiting"]
    while eng.has_unfinished_requests():
        eng.step()
    assert [eng.get_output(r).num_cached_prompt_tokens for r in others] == [16, 16]
    with pytest.raises(ValueError, match="shares_prompt_of"):
        eng.add_request(prompt[:-1], params, shares_prompt_of=first)
