import random

import pytest

from replica.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager
from replica.request import Request, SamplingParams
from router import BlockIndex
from router.index import checkpoints

from .chains import BLOCK_SIZE, chain, stored, tokens


def index_with(**held) -> BlockIndex:
    """An index to which each replica (keyword) has reported storing its chain."""
    index = BlockIndex()
    for replica_id, block_hashes in held.items():
        index.apply(replica_id, [stored(block_hashes)])
    return index


def test_match_counts_leading_blocks_per_replica():
    full = chain(1, 2, 3, 4)
    index = index_with(a=full[:3], b=full[:1], c=full[1:])  # c holds no first block: no leading match
    assert index.match(full) == {"a": 3, "b": 1}
    assert index.match(full[:2]) == {"a": 2, "b": 1}
    assert index.match(chain(9, 2, 3, 4)) == {}
    assert index.match([]) == {}


def test_chains_diverging_midway_match_up_to_the_divergence():
    index = index_with(a=chain(1, 2, 3, 4), b=chain(1, 2, 7, 8))
    assert index.match(chain(1, 2, 3, 4, 5)) == {"a": 4, "b": 2}
    assert index.match(chain(1, 2, 7)) == {"a": 2, "b": 3}
    # Same block contents after a different parent hash to a different chain.
    assert index.match(chain(5, 2, 3)) == {}


def test_cache_salt_separates_chains():
    index = index_with(a=chain(1, 2, salt="tenant-1"))
    assert index.match(chain(1, 2, salt="tenant-1")) == {"a": 2}
    assert index.match(chain(1, 2, salt="tenant-2")) == {}
    assert index.match(chain(1, 2)) == {}


def test_removed_block_cuts_the_match_there():
    full = chain(1, 2, 3, 4)
    index = index_with(a=full, b=full)
    index.apply("a", [BlockRemoved([full[1]])])
    assert index.match(full) == {"a": 1, "b": 4}
    assert (index.num_blocks("a"), index.num_blocks("b")) == (3, 4)


def test_events_apply_in_order():
    index = BlockIndex()
    first = chain(1)
    index.apply("a", [stored(first), BlockRemoved(first)])
    assert index.match(first) == {}
    index.apply("a", [BlockRemoved(first), stored(first)])
    assert index.match(first) == {"a": 1}


def test_removing_a_block_not_held_is_ignored():
    index = index_with(a=chain(1))
    index.apply("a", [BlockRemoved(chain(2))])
    assert index.num_blocks("a") == 1


def test_all_blocks_cleared_empties_only_that_replica():
    full = chain(1, 2)
    index = index_with(a=full, b=full)
    index.apply("a", [AllBlocksCleared(), stored(chain(5))])
    assert index.match(full) == {"b": 2}
    assert index.match(chain(5)) == {"a": 1}
    assert (index.num_blocks("a"), index.num_blocks("b")) == (1, 2)


def test_resync_replaces_a_replicas_blocks():
    index = index_with(a=chain(1, 2, 3), b=chain(1, 2, 3))
    index.resync("a", chain(7, 8))
    assert index.match(chain(1, 2, 3)) == {"b": 3}
    assert index.match(chain(7, 8)) == {"a": 2}
    assert index.num_blocks("a") == 2


def test_events_for_an_unknown_replica_create_it():
    index = BlockIndex()
    assert index.num_blocks("new") == 0
    index.apply("new", [BlockRemoved(chain(1)), AllBlocksCleared()])
    index.apply("new", [stored(chain(1, 2))])
    assert index.match(chain(1, 2)) == {"new": 2}


def test_remove_replica_forgets_it():
    full = chain(1, 2)
    index = index_with(a=full, b=full[:1])
    index.remove_replica("a")
    index.remove_replica("never-seen")
    assert index.match(full) == {"b": 1}
    assert index.num_blocks("a") == 0
    index.remove_replica("b")
    assert index.match(full) == {}


def test_apply_rejects_what_is_not_an_event():
    with pytest.raises(TypeError, match="not a KV event"):
        BlockIndex().apply("a", [chain(1)])


def test_match_agrees_with_a_scan_of_every_replica():
    rng = random.Random(0)
    chains = [chain(*(rng.randrange(3) for _ in range(6))) for _ in range(40)]
    index = BlockIndex()
    held: dict[str, set] = {replica_id: set() for replica_id in "abcd"}
    for _ in range(300):
        replica_id, block_hashes = rng.choice("abcd"), rng.choice(chains)[:rng.randrange(1, 7)]
        if rng.random() < 0.7:
            index.apply(replica_id, [stored(block_hashes)])
            held[replica_id].update(block_hashes)
        else:
            index.apply(replica_id, [BlockRemoved(block_hashes[-1:])])
            held[replica_id].discard(block_hashes[-1])
    for block_hashes in chains:
        expected = {}
        for replica_id, hashes in held.items():
            depth = next((i for i, h in enumerate(block_hashes) if h not in hashes), len(block_hashes))
            if depth:
                expected[replica_id] = depth
        assert index.match(block_hashes) == expected


def test_mirrors_a_real_kv_cache_manager():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, hash_seed=7)  # 5 usable blocks
    index = BlockIndex()
    first = Request("r1", tokens(1, 2, 3), SamplingParams(), cache_salt="s")
    manager.allocate_slots(first, first.num_tokens)
    index.apply("a", manager.take_events())
    assert index.match(chain(1, 2, 3, salt="s", seed=7)) == {"a": 3}

    manager.free(first)  # free queue, LRU first: the 2 unused blocks, then r1's blocks tail first
    second = Request("r2", tokens(4, 5, 6, 7), SamplingParams())
    manager.allocate_slots(second, second.num_tokens)  # evicts r1's last two blocks
    index.apply("a", manager.take_events())
    assert index.match(chain(1, 2, 3, salt="s", seed=7)) == {"a": 1}
    assert index.match(chain(4, 5, 6, 7, seed=7)) == {"a": 4}
    assert index.num_blocks("a") == len(manager.cached_block_hashes()) == 5


def test_bookings_count_until_unbooked_and_never_hide_stored_blocks():
    index = BlockIndex()
    booked = chain(*range(30))
    index.book("a", booked)
    index.book("a", booked)
    index.apply("b", [stored(booked[:3])])
    assert index.match(booked) == {"a": 30, "b": 3}
    # a booked chain stands for the blocks it shares with the request, rounded down to a checkpoint:
    # the first 8 blocks, then every 16th (depth 23) and the last
    assert checkpoints(30) == (0, 1, 2, 3, 4, 5, 6, 7, 23, 29)
    assert index.match(chain(*range(20), 99)) == {"a": 8, "b": 3}
    assert index.match(chain(*range(25), 99)) == {"a": 24, "b": 3}
    assert index.match(chain(*range(5), 99)) == {"a": 5, "b": 3}
    index.unbook("a", booked)
    assert index.match(booked)["a"] == 30  # one booking left
    index.apply("a", [stored(booked[:2])])
    index.unbook("a", booked)
    assert index.match(booked) == {"a": 2, "b": 3}
    assert (index.num_blocks("a"), index.num_blocks("b")) == (2, 3)
    index.remove_replica("b")
    index.book("c", booked)  # takes b's freed bit
    assert index.match(booked) == {"a": 2, "c": 30}


def test_a_booking_from_where_the_replica_match_ends_leaves_the_held_blocks_out():
    full = chain(*range(40))
    index = index_with(a=full[:10])
    index.book("a", full, start=10)
    assert index.match(full) == {"a": 40}
    assert index.match(chain(*range(30), 99)) == {"a": 24}  # checkpoint 23 booked, stored up to 10
    index.apply("a", [BlockRemoved(full[:10])])
    assert index.match(full) == {"a": 40}  # the booked checkpoints still stand for their prefixes
    index.unbook("a", full, start=10)
    assert index.match(full) == {}


def test_host_blocks_are_kept_apart_from_the_device_and_run_from_a_depth():
    index = index_with(a=chain(1))
    index.apply("a", [BlockStored(chain(1, 2, 3), None, [], BLOCK_SIZE, "host")])
    assert index.match(chain(1, 2, 3)) == {"a": 1}
    assert [index.host_run("a", chain(1, 2, 3), start) for start in (0, 1, 3)] == [3, 2, 0]
    assert index.host_run("b", chain(1, 2, 3), 0) == 0
    index.apply("a", [BlockRemoved([chain(1, 2)[1]], "host")])
    assert index.host_run("a", chain(1, 2, 3), 1) == 0
    assert (index.num_blocks("a"), index.num_blocks("a", "host")) == (1, 2)
    index.apply("a", [AllBlocksCleared("host")])
    assert (index.stored_hashes("a"), index.stored_hashes("a", "host")) == (chain(1), [])
    index.resync("a", chain(4, 5), "host")
    assert (index.stored_hashes("a"), index.stored_hashes("a", "host")) == (chain(1), chain(4, 5))
