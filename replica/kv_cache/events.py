"""KV cache events in vLLM's shapes: what a replica publishes so a router can mirror its cache.

medium says which tier: "device" (the replica's own KV cache) or "host" (its node's pool, as this replica
sees it; hash-only: no tokens, no parent).
"""
from dataclasses import dataclass
from typing import Literal

from replica.kv_cache.hashing import BlockHash

Medium = Literal["device", "host"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: Medium = "device"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: Medium = "device"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: Medium = "device"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

