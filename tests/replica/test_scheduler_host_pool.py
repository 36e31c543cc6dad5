"""The scheduler with a node's KV pool: a waiting request's prefix that the pool holds past its device hit is
loaded into device blocks, beside the next step's forward pass while it waits out of the queue (or at once, with
load_now, as the CPU engine does), then admitted with it as a prefix hit; the blocks its steps fill are written
through. The runner's copies are faked: kv_loaded (or load_now) says how many arrived."""
import pytest

from replica.kv_cache import hash_token_blocks
from replica.kv_cache.host_pool import HostPool, HostPoolSpec, KVLoad, KVSave
from replica.request import RequestStatus
from replica.scheduler import ModelRunnerOutput

from .scheduler_helpers import FakeClock, fake_model_output, make_scheduler

PROMPT = list(range(10))  # blocks of 4: two full blocks may hit, the last token is computed
CHAIN = hash_token_blocks(PROMPT, 4)


def pool_holding(tmp_path, block_hashes) -> HostPool:
    pool = HostPool(HostPoolSpec(str(tmp_path / "pool"), 8, 16, "test"))
    pool.store(block_hashes, lambda indices, slots: None)
    return pool


def test_a_prefix_in_the_pool_is_loaded_before_the_request_is_admitted_with_it(tmp_path, make_request):
    pool = pool_holding(tmp_path, CHAIN)
    scheduler = make_scheduler(host_pool=pool)
    scheduler.add_request(make_request("a", PROMPT))
    output = scheduler.schedule()
    assert output.kv_loads == [KVLoad("a", [1, 2], pool.find(CHAIN), CHAIN)]
    assert output.num_scheduled_tokens == {} and output.scheduled_new_reqs == []
    assert list(scheduler.loading) == ["a"] and scheduler.get_num_unfinished_requests() == 1
    scheduler.update_from_output(output, ModelRunnerOutput([], [], kv_loaded={"a": 2}))
    output = scheduler.schedule()
    [new] = output.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens, output.num_scheduled_tokens) == ([1, 2, 3], 8, {"a": 2})
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_hits, stats.host_pool_hits) == (8, 8)
    assert output.kv_loads == [] and output.kv_save is None  # the pool holds both full blocks already


def test_a_block_the_pool_lost_before_it_was_copied_is_computed(tmp_path, make_request):
    pool = HostPool(HostPoolSpec(str(tmp_path / "pool"), 2, 16, "test"))
    pool.store(CHAIN, lambda indices, slots: None)
    scheduler = make_scheduler(host_pool=pool)
    scheduler.add_request(make_request("a", PROMPT))
    output = scheduler.schedule()
    pool.store(hash_token_blocks(list(range(50, 58)), 4), lambda indices, slots: None)  # another engine's blocks
    scheduler.update_from_output(output, ModelRunnerOutput([], [], kv_loaded={"a": 1}))
    output = scheduler.schedule()
    assert (output.scheduled_new_reqs[0].num_computed_tokens, output.num_scheduled_tokens) == (4, {"a": 6})
    assert scheduler.make_stats().host_pool_hits == 4
    assert output.kv_save == KVSave([3], [CHAIN[1]])  # computed again (in a fresh block), written through again


def test_the_load_follows_the_device_hit(tmp_path, make_request):
    pool = pool_holding(tmp_path, [])
    scheduler = make_scheduler(host_pool=pool)
    scheduler.add_request(make_request("a", PROMPT[:4] + [99]))  # its one full block enters the device cache
    output = scheduler.schedule()
    scheduler.update_from_output(output, fake_model_output(scheduler, output))
    pool.store(CHAIN[1:], lambda indices, slots: None)
    scheduler.add_request(make_request("b", PROMPT))
    output = scheduler.schedule()
    [load] = output.kv_loads
    assert (load.block_hashes, len(load.block_ids)) == ([CHAIN[1]], 1)


def test_written_through_blocks_are_those_the_step_fills(tmp_path, make_request):
    pool = HostPool(HostPoolSpec(str(tmp_path / "pool"), 8, 16, "test"))
    scheduler = make_scheduler(host_pool=pool, max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", PROMPT))
    assert scheduler.schedule().kv_save == KVSave([1], [CHAIN[0]])  # 6 tokens: block 1 filled, block 2 not yet
    assert scheduler.schedule().kv_save == KVSave([2], [CHAIN[1]])


def test_a_request_aborted_while_it_loads_frees_every_block(tmp_path, make_request):
    scheduler = make_scheduler(host_pool=pool_holding(tmp_path, CHAIN))
    scheduler.add_request(make_request("a", PROMPT))
    output = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 99
    scheduler.update_from_output(output, ModelRunnerOutput([], [], kv_loaded={"a": 2}))
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.cached_block_hashes() == []  # nothing entered for a request that is gone


def test_loads_under_way_are_bounded(tmp_path, make_request):
    scheduler = make_scheduler(host_pool=pool_holding(tmp_path, CHAIN), max_loading_requests=1)
    scheduler.add_request(make_request("a", PROMPT))
    scheduler.add_request(make_request("b", PROMPT + [50]))
    output = scheduler.schedule()
    assert [load.request_id for load in output.kv_loads] == ["a"]
    assert output.num_scheduled_tokens == {"b": 11}  # b computes its prompt rather than wait for a slot to load


def test_a_load_done_at_once_admits_the_request_in_the_same_step_and_prices_a_loaded_token(tmp_path, make_request):
    clock = FakeClock()
    scheduler = make_scheduler(host_pool=pool_holding(tmp_path, CHAIN), clock=clock)
    scheduler.load_now = lambda loads: ({load.request_id: len(load.slots) for load in loads}, 0.004)
    scheduler.add_request(make_request("a", PROMPT))
    output = scheduler.schedule()
    [new] = output.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens, output.num_scheduled_tokens, output.kv_loads) == (
        [1, 2, 3], 8, {"a": 2}, [])
    assert scheduler.make_stats().host_load_token_cost is None  # no step measured yet
    clock.now = 1.0
    scheduler.update_from_output(output, fake_model_output(scheduler, output))
    stats = scheduler.make_stats()
    # 0.004 s for 8 loaded tokens against 1 s for the step's 2 computed ones
    assert (stats.host_pool_hits, stats.host_load_token_cost) == (8, pytest.approx(0.0005 / 0.5))
