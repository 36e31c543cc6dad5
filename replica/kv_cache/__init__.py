from replica.kv_cache.block import KVCacheBlock, KVCacheBlocks
from replica.kv_cache.block_pool import BlockPool
from replica.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from replica.kv_cache.free_queue import FreeKVCacheBlockQueue
from replica.kv_cache.hashing import BlockHash, hash_block_tokens, hash_token_blocks
from replica.kv_cache.manager import KVCacheManager

__all__ = [
    "AllBlocksCleared", "BlockHash", "BlockPool", "BlockRemoved", "BlockStored", "FreeKVCacheBlockQueue",
    "KVCacheBlock", "KVCacheBlocks", "KVCacheManager", "KVEvent", "hash_block_tokens", "hash_token_blocks",
]
