"""Block-hash chains built the way replicas build them, from readable block contents."""
from replica.kv_cache import BlockHash, BlockStored, hash_token_blocks

BLOCK_SIZE = 4


def tokens(*block_keys: int) -> list[int]:
    """One full block of BLOCK_SIZE copies of each key: tokens(1, 2) == [1, 1, 1, 1, 2, 2, 2, 2]."""
    return [key for key in block_keys for _ in range(BLOCK_SIZE)]


def chain(*block_keys: int, salt: str | None = None, seed: int = 0) -> list[BlockHash]:
    """chain(1, 2, 3) and chain(1, 2, 9) share their first two hashes and then diverge."""
    return hash_token_blocks(tokens(*block_keys), BLOCK_SIZE, cache_salt=salt, seed=seed)


def stored(block_hashes) -> BlockStored:
    """The event a replica publishes when it caches these blocks."""
    return BlockStored(list(block_hashes), None, [], BLOCK_SIZE)
