"""Hundreds of requests with shared prefixes through a small pool; every invariant checked every step."""
import random
from collections import Counter

import pytest

from replica.request import Request, SamplingParams

from .scheduler_helpers import fake_model_output, make_scheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 64


def check_invariants(scheduler, output):
    config = scheduler.config
    assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    references = Counter(block.block_id for blocks in manager.req_to_blocks.values() for block in blocks)
    assert all(pool.blocks[i].ref_cnt == references[i] for i in range(1, NUM_BLOCKS))
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.get_num_free_blocks()
    assert {b.block_id for b in free} == {i for i in range(1, NUM_BLOCKS) if pool.blocks[i].ref_cnt == 0}
    assert len(free) + len(references) == NUM_BLOCKS - 1
    assert all(block.block_hash == block_hash for block_hash, block in pool.cached_block_hash_to_block.items())
    assert set(manager.req_to_blocks) <= {r.request_id for r in scheduler.running}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_keeps_invariants(policy, seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, policy=policy,
                               max_num_batched_tokens=48, max_num_seqs=12, max_model_len=128,
                               long_prefill_token_threshold=rng.choice([0, 20]))
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    pending = []
    for i in range(300):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True)
        pending.append(Request(f"r{i}", prompt, params, priority=rng.randrange(3), arrival_time=float(i)))
    expected = {r.request_id: r.max_tokens for r in pending}
    produced = Counter()
    for _ in range(5000):
        for _ in range(rng.randrange(3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        check_invariants(scheduler, output)
        for out in scheduler.update_from_output(output, fake_model_output(scheduler, output, rng.randrange(1000))):
            produced[out.request_id] += len(out.new_token_ids)
    assert not pending and not scheduler.has_unfinished_requests()
    assert produced == expected
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert scheduler.kv_cache_manager.req_to_blocks == {}
    stats = scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
