"""BlockPool: owns every block, the prefix cache's hash -> block map and the free queue.

Freed blocks keep their hash and stay findable until the free queue hands them out again
(lazy eviction), so a request arriving later can still hit them.
"""
from collections.abc import Iterable

from replica.kv_cache.block import KVCacheBlock
from replica.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from replica.kv_cache.free_queue import FreeKVCacheBlockQueue
from replica.kv_cache.hashing import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.events: list[KVEvent] = []

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = self.free_block_queue.popleft_n(num_blocks)
        evicted = []
        for block in blocks:
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        if evicted:
            self.events.append(BlockRemoved(evicted))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks that reach 0 join the free queue's tail in this order."""
        released = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                released.append(block)
        self.free_block_queue.append_n(released)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          token_ids: list[int], first: int, end: int) -> list[int]:
        """Enter blocks[first:end] (now full) into the prefix cache under their chained hashes; the indices
        of those entered.

        A block whose hash another block already holds stays uncached: the map keeps one block per hash.
        """
        entered = []
        run_start = first
        for index in range(first, end):
            block, block_hash = blocks[index], block_hashes[index]
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block
                entered.append(index)
            else:
                self._emit_stored(block_hashes, token_ids, run_start, index)
                run_start = index + 1
        self._emit_stored(block_hashes, token_ids, run_start, end)
        return entered

    def _emit_stored(self, block_hashes: list[BlockHash], token_ids: list[int], start: int, end: int) -> None:
        """One BlockStored for blocks[start:end], a run just entered into the cache; none if it is empty."""
        if start == end:
            return
        parent = block_hashes[start - 1] if start > 0 else None
        size = self.block_size
        self.events.append(BlockStored(block_hashes[start:end], parent, token_ids[start * size:end * size], size))

    def reset_prefix_cache(self) -> bool:
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
