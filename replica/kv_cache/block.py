"""KVCacheBlock: one block's metadata, carrying its own free-list links (no wrapper nodes)."""
from dataclasses import dataclass

from replica.kv_cache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is full and in the prefix cache
    prev_free_block: "KVCacheBlock | None" = None
    next_free_block: "KVCacheBlock | None" = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


@dataclass(slots=True, eq=False)
class KVCacheBlocks:
    """The blocks an allocation handed out, in order."""
    blocks: list[KVCacheBlock]

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"
