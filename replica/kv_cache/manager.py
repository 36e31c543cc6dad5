"""KVCacheManager: the paged KV cache in terms of requests (the scheduler never touches blocks)."""
from collections.abc import Iterable, Sequence

from replica.kv_cache.block import KVCacheBlock, KVCacheBlocks
from replica.kv_cache.block_pool import BlockPool
from replica.kv_cache.events import KVEvent
from replica.kv_cache.hashing import BlockHash, hash_token_blocks
from replica.kv_cache.host_pool import HostPool, KVLoad, KVSave
from replica.request import Request, RequestStatus

_ADMISSIONS = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 watermark: float = 0.0, max_model_len: int | None = None, hash_seed: int = 0,
                 host_pool: HostPool | None = None):
        """host_pool: the node's second tier, which every block the cache takes in is written through to and
        waiting requests load their prefix from past what the device holds."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len if max_model_len is not None else num_blocks * block_size
        self.hash_seed = hash_seed
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_pool = BlockPool(num_blocks, block_size)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: leading blocks already in the cache
        self.num_requests_scheduled_this_step = 0
        self.host_pool = host_pool if enable_caching else None
        self.loads: dict[str, tuple[list[KVCacheBlock], int]] = {}  # per loading request: its blocks, the first loaded
        self._saves: dict[str, KVSave] = {}  # per request: blocks entered into the cache this step
        self._no_blocks = KVCacheBlocks([])

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def new_step_starts(self) -> None:
        self.num_requests_scheduled_this_step = 0

    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over its full blocks that lack a hash (O(new blocks))."""
        if len(request.block_hashes) < len(request.all_token_ids) // self.block_size:
            request.block_hashes.extend(hash_token_blocks(
                request.all_token_ids, self.block_size, cache_salt=request.cache_salt,
                seed=self.hash_seed, parent_hashes=request.block_hashes))

    def fits_when_alone(self, request: Request) -> bool:
        """Whether the request's tokens (up to max_model_len) fit the pool, the null block aside."""
        return self._num_sequence_blocks(request) < self.num_blocks

    def _num_sequence_blocks(self, request: Request) -> int:
        return -(-min(request.num_tokens, self.max_model_len) // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest chain of cached full blocks, leaving at least one token to compute."""
        if not self.enable_caching:
            return self._no_blocks, 0
        self.update_block_hashes(request)
        hits = self._cached_prefix(request)
        return KVCacheBlocks(hits), len(hits) * self.block_size

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """What get_computed_blocks would find now over the request's current block hashes; no side effects."""
        return len(self._cached_prefix(request)) * self.block_size if self.enable_caching else 0

    def _cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> KVCacheBlocks | None:
        """Slots for num_new_tokens more tokens; None, with nothing changed, when the pool is short."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        computed_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                                   self.max_model_len)
        num_held_blocks = len(self.req_to_blocks.get(request.request_id, ())) + len(computed_blocks)
        num_blocks_to_allocate = max(0, -(-num_tokens_need_slot // self.block_size) - num_held_blocks)
        if num_blocks_to_allocate or computed_blocks or full_sequence_must_fit:
            num_blocks_needed = num_blocks_to_allocate
            if full_sequence_must_fit:  # free blocks for the whole sequence, not only this step's tokens
                num_blocks_needed = max(num_blocks_needed, self._num_sequence_blocks(request) - num_held_blocks)
            if not self._can_allocate(request, computed_blocks, num_blocks_needed):
                return None
            new_blocks = self._attach_blocks(request, computed_blocks, num_blocks_to_allocate)
        else:
            new_blocks = self._no_blocks
        self.num_requests_scheduled_this_step += 1
        if self.enable_caching:
            num_full_blocks = min(num_computed_tokens + num_new_tokens, request.num_tokens) // self.block_size
            if num_full_blocks > self.num_cached_blocks.get(request.request_id, 0):
                self._cache_full_blocks(request, num_full_blocks)
        return new_blocks

    def host_hits(self, request: Request, num_device_blocks: int) -> list[int]:
        """The pool's slots holding the request's blocks that follow its device hit (at least one token left
        to compute)."""
        if self.host_pool is None:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        return self.host_pool.find(request.block_hashes[num_device_blocks:max_hit_blocks])

    def start_load(self, request: Request, device_hits: KVCacheBlocks, slots: list[int]) -> KVLoad | None:
        """Device blocks for the pool's blocks at slots, held with the device hits before them until
        finish_load; None, with nothing changed, when the cache is short of blocks."""
        if not self._can_allocate(request, device_hits.blocks, len(slots)):
            return None
        self.block_pool.touch(device_hits.blocks)
        new_blocks = self.block_pool.get_new_blocks(len(slots))
        first = len(device_hits)
        self.loads[request.request_id] = ([*device_hits.blocks, *new_blocks], first)
        return KVLoad(request.request_id, [block.block_id for block in new_blocks], slots,
                      request.block_hashes[first:first + len(slots)])

    def finish_load(self, request: Request, num_loaded: int) -> None:
        """Enter the first num_loaded loaded blocks into the prefix cache, and release the load's blocks."""
        blocks, first = self.loads.pop(request.request_id)
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, request.all_token_ids,
                                          first, first + num_loaded)
        self.block_pool.free_blocks(reversed(blocks))

    def take_saves(self, request_ids: Iterable[str]) -> KVSave | None:
        """The blocks to write through to the pool after this step: those entered into the cache by the
        requests that compute them in it (the others were preempted before it ran)."""
        if not self._saves:  # no pool, or nothing new in the cache
            return None
        saves, self._saves = self._saves, {}
        picked = [saves[request_id] for request_id in request_ids if request_id in saves]
        if not picked:
            return None
        return KVSave([block_id for save in picked for block_id in save.block_ids],
                      [block_hash for save in picked for block_hash in save.block_hashes])

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix stays cached the longest."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self._saves.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        if (load := self.loads.pop(request.request_id, None)) is not None:
            self.block_pool.free_blocks(reversed(load[0]))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.get_blocks(request_id)]

    def get_blocks(self, request_id: str) -> Sequence[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, ())

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        return list(self.block_pool.cached_block_hash_to_block)

    def _can_allocate(self, request: Request, computed_blocks: Sequence[KVCacheBlock], num_blocks: int) -> bool:
        # Touching a hit with ref_cnt 0 takes it out of the free queue, so it costs a free block.
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        watermark = self.watermark_blocks if (
            self.num_requests_scheduled_this_step and request.status in _ADMISSIONS) else 0
        return num_blocks + num_evictable_hits + watermark <= self.block_pool.get_num_free_blocks()

    def _attach_blocks(self, request: Request, computed_blocks: Sequence[KVCacheBlock],
                       num_blocks_to_allocate: int) -> KVCacheBlocks:
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.block_pool.touch(computed_blocks)
        req_blocks.extend(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_blocks_to_allocate)
        req_blocks.extend(new_blocks)
        return KVCacheBlocks(new_blocks)

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        entered = self.block_pool.cache_full_blocks(blocks, request.block_hashes, request.all_token_ids,
                                                    self.num_cached_blocks.get(request.request_id, 0), num_full_blocks)
        self.num_cached_blocks[request.request_id] = num_full_blocks
        if self.host_pool is not None and entered:
            save = self._saves.setdefault(request.request_id, KVSave([], []))
            save.block_ids.extend(blocks[index].block_id for index in entered)
            save.block_hashes.extend(request.block_hashes[index] for index in entered)
