import pytest

from replica.kv_cache import BlockRemoved, BlockStored, KVCacheManager, hash_token_blocks
from replica.request import Request, RequestStatus, SamplingParams


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def admit(manager, request):
    blocks, num_computed = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, blocks)
    request.num_computed_tokens = request.num_tokens
    return num_computed, new


def test_allocate_hashes_full_blocks_and_emits_stored(make_request):
    manager = KVCacheManager(10, 4)
    request = make_request("a", list(range(10)))
    blocks = manager.allocate_slots(request, 10)
    assert blocks.get_block_ids() == [1, 2, 3]
    assert manager.get_block_ids("a") == [1, 2, 3]
    hashes = hash_token_blocks(list(range(10)), 4)
    assert request.block_hashes == hashes
    assert manager.take_events() == [BlockStored(hashes, None, list(range(8)), 4)]
    assert manager.usage == pytest.approx(3 / 9)


def test_prefix_hit_stops_at_first_miss(make_request):
    manager = KVCacheManager(20, 4)
    admit(manager, make_request("a", list(range(12)) + [99]))
    manager.take_events()
    # same first two blocks, third differs
    blocks, num_computed = manager.get_computed_blocks(make_request("b", list(range(8)) + [50, 51, 52, 53, 54]))
    assert num_computed == 8 and blocks.get_block_ids() == [1, 2]


def test_prefix_hit_leaves_at_least_one_token(make_request):
    manager = KVCacheManager(20, 4)
    admit(manager, make_request("a", list(range(12))))
    blocks, num_computed = manager.get_computed_blocks(make_request("b", list(range(12))))
    assert num_computed == 8 and blocks.get_block_ids() == [1, 2]
    blocks, num_computed = manager.get_computed_blocks(make_request("c", list(range(13))))
    assert num_computed == 12 and blocks.get_block_ids() == [1, 2, 3]


def test_cache_salt_separates_namespaces(make_request):
    manager = KVCacheManager(20, 4)
    admit(manager, make_request("a", list(range(9)), cache_salt="tenant-a"))
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    assert manager.get_computed_blocks(make_request("c", list(range(9)), cache_salt="tenant-b"))[1] == 0
    assert manager.get_computed_blocks(make_request("d", list(range(9)), cache_salt="tenant-a"))[1] == 8


def test_disabled_caching_never_hits_or_stores(make_request):
    manager = KVCacheManager(20, 4, enable_caching=False)
    admit(manager, make_request("a", list(range(9))))
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    assert manager.take_events() == []
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_shared_blocks_are_ref_counted_and_freed_tail_first(make_request):
    manager = KVCacheManager(10, 4)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(8)) + [42])
    admit(manager, a)
    assert admit(manager, b)[0] == 8
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    manager.free(a)
    assert free_ids(manager) == [5, 6, 7, 8, 9, 3]
    manager.free(b)
    assert free_ids(manager) == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    assert manager.get_block_ids("b") == []


def test_free_hit_blocks_are_revived_from_the_free_queue(make_request):
    manager = KVCacheManager(6, 4)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    num_computed, new = admit(manager, make_request("b", list(range(9))))
    assert num_computed == 8 and new.get_block_ids() == [4]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert free_ids(manager) == [5, 3]


def test_short_pool_returns_none_and_changes_nothing(make_request):
    manager = KVCacheManager(4, 4)  # 3 usable blocks
    a = make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    events = manager.take_events()
    assert len(events) == 1
    b = make_request("b", list(range(8)) + list(range(100, 108)))  # hits 2 free blocks, needs 2 more
    blocks, num_computed = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 8, num_computed, blocks) is None
    assert free_ids(manager) == [3, 2, 1]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [0, 0, 0]
    assert manager.get_block_ids("b") == [] and manager.take_events() == []


def test_decode_allocates_a_block_only_at_the_boundary(make_request):
    manager = KVCacheManager(10, 4)
    request = make_request("a", list(range(7)))
    manager.allocate_slots(request, 7)
    request.num_computed_tokens = 7
    request.append_output_token_ids(100)
    assert manager.allocate_slots(request, 1).get_block_ids() == []
    request.num_computed_tokens = 8
    request.append_output_token_ids(101)
    assert manager.allocate_slots(request, 1).get_block_ids() == [3]
    events = manager.take_events()
    hashes = hash_token_blocks(list(range(7)) + [100], 4)
    assert events == [BlockStored([hashes[0]], None, [0, 1, 2, 3], 4),
                      BlockStored([hashes[1]], hashes[0], [4, 5, 6, 100], 4)]


def test_lookahead_and_max_model_len_cap(make_request):
    manager = KVCacheManager(10, 4, max_model_len=10)
    request = make_request("a", list(range(5)))
    assert manager.allocate_slots(request, 5, num_lookahead_tokens=3).get_block_ids() == [1, 2]
    request2 = make_request("b", list(range(9)))
    assert manager.allocate_slots(request2, 9, num_lookahead_tokens=8).get_block_ids() == [3, 4, 5]


def test_watermark_only_for_admissions_after_another_request(make_request):
    manager = KVCacheManager(10, 4, watermark=0.2)  # 2 watermark blocks, 9 usable
    manager.new_step_starts()
    first = make_request("first", list(range(20)))  # 5 blocks
    assert manager.allocate_slots(first, 20) is not None  # nothing scheduled yet: no watermark
    second = make_request("second", list(range(100, 112)))  # 3 blocks; 4 free - 2 reserved
    assert manager.allocate_slots(second, 12) is None
    first.status = RequestStatus.RUNNING
    first.num_computed_tokens = 20
    first.append_output_token_ids(5)
    assert manager.allocate_slots(first, 1) is not None  # running requests dip into the reserve
    manager.new_step_starts()
    assert manager.allocate_slots(make_request("third", list(range(200, 212))), 12) is not None


def test_full_sequence_must_fit(make_request):
    manager = KVCacheManager(5, 4)  # 4 usable blocks
    request = make_request("a", list(range(20)))  # 5 blocks in all
    assert manager.allocate_slots(request, 4, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(request, 4) is not None
    small = make_request("b", list(range(100, 112)))
    assert manager.allocate_slots(small, 4, full_sequence_must_fit=True) is not None
    assert manager.get_block_ids("b") == [2]


def test_invalid_token_count(make_request):
    with pytest.raises(ValueError, match="num_new_tokens must be positive"):
        KVCacheManager(4, 4).allocate_slots(make_request("a", [1]), 0)


def test_eviction_event_and_reset(make_request):
    manager = KVCacheManager(3, 4)  # 2 usable
    a = make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    manager.take_events()
    b = make_request("b", list(range(50, 55)))
    admit(manager, b)
    hashes = hash_token_blocks(list(range(8)), 4)
    assert manager.take_events()[0] == BlockRemoved([hashes[1], hashes[0]])
    assert manager.reset_prefix_cache() is False
    manager.free(b)
    assert manager.reset_prefix_cache() is True
    assert manager.cached_block_hashes() == []


def test_block_hashes_given_with_the_request_are_used_not_recomputed():
    manager = KVCacheManager(20, 4)
    prompt = list(range(9))
    ingress_hashes = hash_token_blocks(prompt, 4, seed=7)  # hashed elsewhere, with another seed
    assert admit(manager, Request("first", prompt, SamplingParams(), block_hashes=ingress_hashes))[0] == 0
    assert admit(manager, Request("same-chain", prompt, SamplingParams(), block_hashes=ingress_hashes))[0] == 8
    assert admit(manager, Request("own-hashes", prompt, SamplingParams()))[0] == 0
    prefix_given = Request("prefix-given", prompt, SamplingParams(), block_hashes=ingress_hashes[:1])
    assert admit(manager, prefix_given)[0] == 4
    extended = hash_token_blocks(prompt, 4, parent_hashes=ingress_hashes[:1])  # hashed by the manager
    assert prefix_given.block_hashes == ingress_hashes[:1] + extended
