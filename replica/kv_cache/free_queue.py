"""FreeKVCacheBlockQueue: the free blocks in eviction order (LRU at the head), O(1) per block.

A doubly linked list threaded through the blocks' own prev/next fields between two sentinels,
so a cached block that gets a prefix hit can be pulled out of the middle in O(1).
"""
from collections.abc import Iterable

from replica.kv_cache.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: list[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free KV cache block: the free queue is empty")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free KV cache blocks, only {self.num_free_blocks} are free")
        popped = []
        block = self._head.next_free_block
        for _ in range(n):
            popped.append(block)
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        count = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks = []
        block = self._head.next_free_block
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
