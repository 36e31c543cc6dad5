"""HostPool: a node's shared KV tier, driven through its public methods with byte blocks."""
import errno
import multiprocessing
import os

import numpy as np
import pytest

from replica.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, hash_token_blocks
from replica.kv_cache.host_pool import HostPool, HostPoolSpec, HostPoolWatcher

SLOT_BYTES = 64
CHAIN = hash_token_blocks(list(range(40)), 4)  # 10 chained block hashes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def make_pool(tmp_path, num_slots: int = 4, layout: str = "test|float32|4x1x8x2", **kwargs) -> HostPool:
    return HostPool(HostPoolSpec(str(tmp_path / "pool"), num_slots, SLOT_BYTES, layout), **kwargs)


def fill(pool: HostPool, block_hashes, values):
    """Store blocks whose every byte is its value; the hashes stored."""
    def write(indices, slots):
        for index, slot in zip(indices, slots):
            pool.data[slot] = values[index]
    return pool.store(block_hashes, write)


def read_back(pool: HostPool, slots, block_hashes):
    """(how many leading blocks loaded whole, the first byte of each slot as copied)."""
    copied = []
    num_valid = pool.load(slots, block_hashes, lambda slots: copied.extend(int(pool.data[slot][0]) for slot in slots))
    return num_valid, copied


def test_stored_blocks_are_found_in_chain_order_and_load_whole(tmp_path):
    pool = make_pool(tmp_path)
    assert fill(pool, CHAIN[:3], [11, 12, 13]) == CHAIN[:3]
    slots = pool.find(CHAIN[:5])
    assert len(slots) == 3
    assert read_back(pool, slots, CHAIN[:3]) == (3, [11, 12, 13])
    assert pool.contents() == set(CHAIN[:3])


def test_find_stops_at_the_first_block_the_pool_lacks(tmp_path):
    pool = make_pool(tmp_path)
    fill(pool, [CHAIN[0], CHAIN[2]], [1, 3])
    assert len(pool.find(CHAIN[:3])) == 1


def test_two_engines_on_one_file_share_blocks_and_store_each_once(tmp_path):
    first, second = make_pool(tmp_path), make_pool(tmp_path)
    fill(first, CHAIN[:2], [5, 6])
    assert fill(second, CHAIN[:3], [0, 0, 7]) == [CHAIN[2]]
    slots = second.find(CHAIN[:3])
    assert read_back(second, slots, CHAIN[:3]) == (3, [5, 6, 7])


def test_the_least_recently_used_block_goes_and_the_file_keeps_its_size(tmp_path):
    pool = make_pool(tmp_path, num_slots=3, clock=Clock())
    fill(pool, CHAIN[:3], [1, 2, 3])
    read_back(pool, pool.find(CHAIN[:1]), CHAIN[:1])  # block 0 used again: block 1 is now the oldest
    assert fill(pool, CHAIN[3:5], [4, 5]) == CHAIN[3:5]
    assert pool.contents() == {CHAIN[0], CHAIN[3], CHAIN[4]}
    assert os.path.getsize(tmp_path / "pool") == pool.spec.file_bytes
    assert pool.spec.file_bytes == 2 * 4096 + 3 * SLOT_BYTES  # a page of header, the slot table in a page, the slots


def test_storing_more_blocks_than_slots_keeps_the_first(tmp_path):
    pool = make_pool(tmp_path, num_slots=2)
    assert fill(pool, CHAIN[:3], [1, 2, 3]) == CHAIN[:2]
    assert len(pool.find(CHAIN)) == 2


def test_a_block_overwritten_while_it_is_read_is_not_loaded(tmp_path):
    pool, other = make_pool(tmp_path, num_slots=1), make_pool(tmp_path, num_slots=1)
    fill(pool, CHAIN[:1], [1])
    slots = pool.find(CHAIN[:1])

    def read_while_another_engine_writes(slots):
        fill(other, CHAIN[1:2], [2])
    assert pool.load(slots, CHAIN[:1], read_while_another_engine_writes) == 0
    assert pool.find(CHAIN[:1]) == []


def test_a_load_keeps_the_blocks_before_the_first_that_changed(tmp_path):
    pool = make_pool(tmp_path, num_slots=3)
    fill(pool, CHAIN[:3], [1, 2, 3])
    slots = pool.find(CHAIN[:3])
    assert read_back(pool, slots, [CHAIN[0], CHAIN[5], CHAIN[2]]) == (1, [1, 2, 3])


def _die_mid_write(path: str) -> None:
    pool = HostPool(HostPoolSpec(path, 2, SLOT_BYTES, "test|float32|4x1x8x2"))

    def write(indices, slots):
        pool.data[slots[0]] = 9
        os._exit(1)
    pool.store(CHAIN[:1], write)


def test_a_writer_that_dies_mid_write_leaves_no_block_and_its_slot_goes_first(tmp_path):
    pool = make_pool(tmp_path, num_slots=2, clock=Clock())
    fill(pool, CHAIN[1:2], [2])
    writer = multiprocessing.get_context("fork").Process(target=_die_mid_write, args=(pool.spec.path,))
    writer.start()
    writer.join(30)
    assert writer.exitcode == 1
    assert pool.find(CHAIN[:1]) == [] and pool.contents() == {CHAIN[1]}
    # the lock died with the writer; its torn slot is taken, not block 1's
    assert fill(pool, CHAIN[2:3], [3]) == [CHAIN[2]]
    assert pool.contents() == {CHAIN[1], CHAIN[2]}


def test_a_pool_made_for_other_blocks_is_refused(tmp_path):
    make_pool(tmp_path)
    with pytest.raises(ValueError, match="was made for other blocks"):
        make_pool(tmp_path, layout="other|bfloat16|4x1x8x2")
    with pytest.raises(ValueError, match="was made for other blocks"):
        make_pool(tmp_path, num_slots=8)
    with pytest.raises(ValueError, match="at least one slot"):
        HostPoolSpec(str(tmp_path / "empty"), 0, SLOT_BYTES, "test")


def test_slots_are_the_declared_bytes(tmp_path):
    pool = make_pool(tmp_path)
    assert pool.data.shape == (4, SLOT_BYTES) and pool.data.dtype == np.uint8


def test_the_watcher_reports_the_pools_changes_as_host_events(tmp_path):
    pool = make_pool(tmp_path, num_slots=2, clock=Clock())
    watcher = HostPoolWatcher(pool, block_size=4)
    assert watcher.take_events() == [AllBlocksCleared("host"), BlockStored([], None, [], 4, "host")]
    fill(pool, CHAIN[:2], [1, 2])
    assert watcher.take_events() == [BlockStored(CHAIN[:2], None, [], 4, "host")]
    assert watcher.take_events() == []
    fill(make_pool(tmp_path, num_slots=2), CHAIN[2:3], [3])  # another engine's store evicts block 0
    assert watcher.take_events() == [BlockRemoved([CHAIN[0]], "host"), BlockStored([CHAIN[2]], None, [], 4, "host")]
    watcher.report_all()
    [cleared, stored] = watcher.take_events()
    assert (cleared, set(stored.block_hashes)) == (AllBlocksCleared("host"), {CHAIN[1], CHAIN[2]})


def test_a_pool_its_file_system_cannot_hold_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ValueError, match=r"cannot reserve .*\(No space left on device\)"):
        make_pool(tmp_path)
    assert not (tmp_path / "pool").exists()


def test_a_block_that_another_engine_evicted_and_stored_again_elsewhere_is_found_where_it_is_now(tmp_path):
    clock = Clock()
    pool, other = make_pool(tmp_path, num_slots=2, clock=clock), make_pool(tmp_path, num_slots=2, clock=clock)
    fill(pool, CHAIN[:2], [1, 2])
    [first_slot] = pool.find(CHAIN[:1])  # this engine remembers where block 0 was
    fill(other, CHAIN[2:4], [3, 4])      # the other evicts both blocks
    assert pool.find(CHAIN[:1]) == []
    read_back(other, other.find(CHAIN[2:3]), CHAIN[2:3])  # block 2, in block 0's old slot, used again
    fill(other, CHAIN[:1], [5])          # block 0 stored again, in the other slot
    [slot] = pool.find(CHAIN[:1])
    assert slot != first_slot
    assert read_back(pool, [slot], CHAIN[:1]) == (1, [5])
