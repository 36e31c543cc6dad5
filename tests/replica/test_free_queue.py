import pytest

from replica.kv_cache import FreeKVCacheBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [block.block_id for block in queue.get_all_free_blocks()]


def test_initial_order_and_count():
    queue, _ = make_queue(5)
    assert queue.num_free_blocks == 5
    assert ids(queue) == [0, 1, 2, 3, 4]


def test_popleft_takes_the_head_and_unlinks_it():
    queue, blocks = make_queue(3)
    block = queue.popleft()
    assert block is blocks[0]
    assert block.prev_free_block is None and block.next_free_block is None
    assert ids(queue) == [1, 2]
    assert queue.num_free_blocks == 2


def test_popleft_n_in_one_pass():
    queue, blocks = make_queue(6)
    popped = queue.popleft_n(4)
    assert popped == blocks[:4]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert ids(queue) == [4, 5]
    assert queue.num_free_blocks == 2
    assert queue.popleft_n(0) == []
    assert queue.popleft_n(2) == blocks[4:]
    assert ids(queue) == []


def test_remove_from_middle_head_and_tail():
    queue, blocks = make_queue(5)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert queue.num_free_blocks == 2


def test_append_and_append_n_go_to_the_tail():
    queue, blocks = make_queue(4)
    first, second = queue.popleft(), queue.popleft()
    queue.append(first)
    assert ids(queue) == [2, 3, 0]
    third = queue.popleft()
    queue.append_n([third, second])
    assert ids(queue) == [3, 0, 2, 1]
    assert queue.num_free_blocks == 4
    queue.append_n([])
    assert ids(queue) == [3, 0, 2, 1]


def test_empty_queue_errors_are_clear():
    queue, blocks = make_queue(1)
    queue.popleft()
    with pytest.raises(ValueError, match="free queue is empty"):
        queue.popleft()
    with pytest.raises(ValueError, match="asked for 1 free KV cache blocks, only 0"):
        queue.popleft_n(1)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])
