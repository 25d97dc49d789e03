"""KVManager: the one owner of a request's KV in the target and draft pools."""

from __future__ import annotations

import re

import torch

from engine.kv import KVManager, PagedKVPool
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.uniforms import RandomStream
from tests.helpers import REPO


def pool(num_blocks: int = 8, prefix: bool = True, slots: int = 4) -> PagedKVPool:
    return PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=2, max_slots=slots, max_seq_len=32,
                       dtype=torch.float32, device="cpu", block_size=4, num_blocks=num_blocks,
                       enable_prefix_caching=prefix)


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(), RandomStream(0), text=None)


def fill(p: PagedKVPool, slot: int, n: int) -> None:
    p.view([slot], [n]).write(0, torch.ones(1, n, 1, 2), torch.ones(1, n, 1, 2))


def test_a_request_gets_a_slot_in_both_pools_and_gives_both_back():
    kv = KVManager(pool(), pool(prefix=False))
    r = request("a", list(range(10)))
    assert kv.allocate(r) == 0 and kv.computed(r) == 0
    assert kv.target.num_used_slots() == kv.draft.num_used_slots() == 1
    kv.free(r)
    kv.free(r)  # a request that holds nothing frees nothing
    assert kv.target.num_used_slots() == kv.draft.num_used_slots() == 0 and kv.computed(r) == 0


def test_no_draft_slot_means_no_target_slot_either():
    kv = KVManager(pool(slots=2), pool(slots=1, prefix=False))
    a, b = request("a", [1, 2]), request("b", [3, 4])
    assert kv.allocate(a) == 0
    assert kv.allocate(b) is None  # the draft pool is out of slots
    assert kv.target.num_used_slots() == 1  # b's target slot was given back


def test_reservations_count_the_target_computed_tokens_and_the_draft_whole_sequence():
    kv = KVManager(pool(num_blocks=4), pool(num_blocks=4, prefix=False))
    r = request("a", list(range(6)))
    kv.allocate(r)
    assert kv.reserve_prefill(r, 6) and kv.target.block_table(kv.target_slot(r)) == [0, 1]
    assert kv.draft.block_table(kv.draft_slot(r)) == []  # prefill leaves the draft alone
    fill(kv.target, kv.target_slot(r), 6)
    r.output_token_ids.append(7)  # 7 tokens known, 6 computed
    assert kv.reserve_decode(r, 6)  # target 6 + 6 -> 3 blocks; draft 7 + 6 -> 4 blocks
    assert len(kv.target.block_table(kv.target_slot(r))) == 3 and len(kv.draft.block_table(kv.draft_slot(r))) == 4
    assert not kv.reserve_decode(r, 20)  # past the draft pool's 4 blocks
    assert kv.target.free_token_capacity() == 4 and kv.free_tokens() == kv.draft.free_token_capacity() == 0


def test_rollback_trims_both_pools_never_past_what_the_draft_has_and_keeps_their_storage():
    kv = KVManager(pool(), pool(prefix=False))
    r = request("a", list(range(8)))
    kv.allocate(r)
    fill(kv.target, kv.target_slot(r), 12)
    fill(kv.draft, kv.draft_slot(r), 5)  # the draft lags behind
    kv.rollback(r, 9)
    assert kv.computed(r) == 9 and kv.draft_len(r) == 5
    kv.rollback(r, 3)
    assert kv.computed(r) == 3 and kv.draft_len(r) == 3
    # the rejected positions' blocks stay: the next round writes there again
    assert kv.target.block_table(kv.target_slot(r)) == [0, 1, 2] and kv.draft.block_table(kv.draft_slot(r)) == [0, 1]
    kv.free(r)
    assert kv.target.num_used_blocks() == kv.draft.num_used_blocks() == 0


def test_the_prefix_cache_serves_a_second_request_through_the_manager():
    kv = KVManager(pool())
    first, second = request("a", list(range(10))), request("b", list(range(10)) + [99])
    kv.allocate(first)
    kv.reserve_prefill(first, 10)
    fill(kv.target, kv.target_slot(first), 10)
    kv.register_prefix(first)
    kv.free(first)
    assert kv.allocate(second) == 8  # two full blocks of the shared prompt
    assert kv.computed(second) == 8


OWNER_MUTATIONS = re.compile(r"\b(?:kv\.(?:target|draft|features)|self\.features)\.(truncate_to|move_rows|append"
                             r"|restart|clear|free|free_slot|allocate_slot|ensure_capacity|take_rows|take)\b")


def pool_mutations(text: str) -> list[str]:
    """Calls that change a KVManager's pools behind its back (`kv.draft.truncate_to(...)`)."""
    return [m.group(0) for m in OWNER_MUTATIONS.finditer(text)]


def test_only_the_manager_changes_its_pools():
    """kv/manager.py is the one owner of requests' KV: truncation and feature appends elsewhere go
    through it (scratch pools that calibration allocates itself are not a KVManager's)."""
    offenders = {str(p.relative_to(REPO)): found for p in sorted((REPO / "engine").rglob("*.py"))
                 if "kv" not in p.relative_to(REPO).parts[1:2] and (found := pool_mutations(p.read_text()))}
    assert not offenders, offenders
    assert pool_mutations("self.kv.draft.truncate_to(slot, n)\nkv.features.append(rid, s, f)\n"
                          "self.features.take(rid)  # a proposer's alias for kv.features") == \
        ["kv.draft.truncate_to", "kv.features.append", "self.features.take"]
