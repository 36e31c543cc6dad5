"""The reference hit rate: one LRU prefix cache as large as all replicas' together.

Requests are looked up in arrival order, each one's prompt and answer blocks inserted right after
its lookup (no prefill time, no blocks pinned by running requests), the hit capped as the engine
caps it (at least one prompt token computed). What a perfect router could not beat by much.
"""
from collections import OrderedDict

from replica.kv_cache import hash_token_blocks

from .cluster import RequestRecord
from .workloads import Program


def pooled_lru_hit_rate(programs: list[Program], records: list[RequestRecord], num_blocks: int,
                        block_size: int) -> float:
    turns = {f"{program.session_id}/{index}": turn for program in programs for index, turn in enumerate(program.turns)}
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for record in sorted(records, key=lambda record: record.arrival_s):
        turn = turns[record.request_id]
        block_hashes = hash_token_blocks(turn.prompt + turn.output, block_size)
        num_hit = 0
        for block_hash in block_hashes[:(len(turn.prompt) - 1) // block_size]:
            if block_hash not in cache:
                break
            num_hit += 1
        hits += num_hit * block_size
        total += len(turn.prompt)
        for block_hash in block_hashes:
            cache[block_hash] = None
            cache.move_to_end(block_hash)
        while len(cache) > num_blocks:
            cache.popitem(last=False)
    return hits / total
