"""The references: one LRU prefix cache as large as all replicas' together, and the TTFT floor.

Requests are looked up in arrival order, each one's prompt and answer blocks inserted right after
its lookup (no prefill time, no blocks pinned by running requests), the hit capped as the engine
caps it (at least one prompt token computed). What a perfect router could not beat by much. The
floor is each request's TTFT alone on an idle replica holding that pooled cache: one step of its
uncached tokens, no queue, no other request in the batch.
"""
from dataclasses import dataclass
from collections import OrderedDict

from replica.kv_cache import hash_token_blocks

from .cluster import RequestRecord
from .step_model import StepLoad, StepModel
from .workloads import Program


@dataclass(frozen=True)
class PooledReference:
    hit_rate: float
    ttft_floor: list[float]  # seconds, one per request


def pooled_lru(programs: list[Program], records: list[RequestRecord], num_blocks: int, block_size: int,
               step_model: StepModel) -> PooledReference:
    turns = {f"{program.session_id}/{index}": turn for program in programs for index, turn in enumerate(program.turns)}
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    ttft_floor = []
    for record in sorted(records, key=lambda record: record.arrival_s):
        turn = turns[record.request_id]
        block_hashes = hash_token_blocks(turn.prompt + turn.output, block_size)
        num_hit = 0
        for block_hash in block_hashes[:(len(turn.prompt) - 1) // block_size]:
            if block_hash not in cache:
                break
            num_hit += 1
        num_computed = num_hit * block_size
        hits += num_computed
        total += len(turn.prompt)
        ttft_floor.append(step_model.seconds(StepLoad.prefill(len(turn.prompt) - num_computed, num_computed)))
        for block_hash in block_hashes:
            cache[block_hash] = None
            cache.move_to_end(block_hash)
        while len(cache) > num_blocks:
            cache.popitem(last=False)
    return PooledReference(hits / total, ttft_floor)
