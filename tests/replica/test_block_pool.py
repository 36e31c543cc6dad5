import pytest

from replica.kv_cache import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KVCacheBlock, hash_token_blocks


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def new_cached_blocks(pool: BlockPool, tokens: list[int]) -> tuple[list[KVCacheBlock], list[bytes]]:
    """One new block per full block of tokens (block size 2), cached under its hash -> (blocks, hashes)."""
    hashes = hash_token_blocks(tokens, 2)
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_full_blocks(blocks, hashes, tokens, 0, len(hashes))
    return blocks, hashes


def test_null_block_is_block_zero_and_never_free():
    pool = BlockPool(5, 4)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0


def test_too_small_pool_is_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, 4)


def test_get_new_blocks_takes_lru_and_sets_ref_cnt():
    pool = BlockPool(5, 4)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.get_usage() == 0.5
    with pytest.raises(ValueError, match="asked for 3 free KV cache blocks, only 2"):
        pool.get_new_blocks(3)


def test_free_blocks_returns_them_to_the_tail_in_order():
    pool = BlockPool(5, 4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1]
    assert [b.ref_cnt for b in blocks] == [0, 0, 0]


def test_touch_pulls_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(5, 4)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    pool.touch([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [2, 3, 4]
    pool.touch([block])  # a second sharer: no queue change
    assert block.ref_cnt == 2 and free_ids(pool) == [2, 3, 4]
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [2, 3, 4]


def test_cache_full_blocks_stores_hashes_and_emits_one_event_per_run():
    pool = BlockPool(6, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = hash_token_blocks(tokens, 2)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, tokens, 0, 2)
    assert [b.block_hash for b in blocks] == [hashes[0], hashes[1], None]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    pool.cache_full_blocks(blocks, hashes, tokens, 2, 3)
    assert pool.take_events() == [
        BlockStored([hashes[0], hashes[1]], None, [1, 2, 3, 4], 2),
        BlockStored([hashes[2]], hashes[1], [5, 6], 2),
    ]
    assert pool.take_events() == []


def test_a_hash_already_cached_elsewhere_is_not_cached_twice():
    pool = BlockPool(6, 2)
    first, hashes = new_cached_blocks(pool, [1, 2, 3, 4])
    pool.take_events()
    second, _ = new_cached_blocks(pool, [1, 2, 3, 4])
    assert [b.block_hash for b in second] == [None, None]
    assert pool.get_cached_block(hashes[0]) is first[0]
    assert pool.take_events() == []


def test_lazy_eviction_when_a_freed_cached_block_is_reused():
    pool = BlockPool(3, 2)
    blocks, hashes = new_cached_blocks(pool, [1, 2, 3, 4])
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(hashes[0]) is blocks[0]  # still findable while free
    pool.take_events()
    reused = pool.get_new_blocks(1)  # LRU is the tail block, freed first
    assert reused == [blocks[1]]
    assert blocks[1].block_hash is None and pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.take_events() == [BlockRemoved([hashes[1]])]


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(4, 2)
    blocks, hashes = new_cached_blocks(pool, [1, 2])
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(hashes[0]) is None and blocks[0].block_hash is None
    assert pool.take_events() == [AllBlocksCleared()]
