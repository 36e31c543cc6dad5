"""The cluster simulator on a tiny seeded workload: exact facts, no timings."""
from collections import Counter

import pytest

from benchmarks.sim.cluster import RequestRecord, SimClock, Simulation
from benchmarks.sim.pooled_lru import pooled_lru
from benchmarks.sim.replica import SimReplica
from benchmarks.sim.routers import make_router
from benchmarks.sim.step_model import StepModel
from benchmarks.sim.workloads import Program, Turn, assign_starts, make_workload
from replica.kv_cache import hash_token_blocks
from replica.kv_cache.host_pool import HostPool, HostPoolSpec

BLOCK_SIZE = 16
STEP_MODEL = StepModel(a=0.01, b=2e-4, c=1e-3, d=1e-6)  # fixed, so the test does not follow calibrations


def simulate(policy: str, workload: str = "multi-turn", num_replicas: int = 3, queue_policy: str = "fcfs"):
    programs = make_workload(workload, seed=1, num_replicas=num_replicas, num_requests=24)
    assign_starts(programs, requests_per_s=6.0, seed=1)
    clock = SimClock()
    replicas = [SimReplica(f"r{i}", 1024, BLOCK_SIZE, STEP_MODEL, clock, queue_policy) for i in range(num_replicas)]
    router = make_router(policy, [replica.replica_id for replica in replicas], BLOCK_SIZE, clock, 0)
    simulation = Simulation(programs, replicas, [router], BLOCK_SIZE, clock)
    return simulation, simulation.run(), programs, replicas


@pytest.mark.parametrize("policy, queue_policy", [("prefix", "fcfs"), ("sglang", "fcfs"), ("ray", "fcfs"),
                                                  ("prefix", "continuum")])
def test_every_turn_finishes_and_no_block_leaks(policy, queue_policy):
    _, records, programs, replicas = simulate(policy, queue_policy=queue_policy)
    assert len(records) == sum(len(program.turns) for program in programs)
    assert all(record.finished_s is not None and record.first_token_s >= record.arrival_s for record in records)
    assert [replica.kv_cache_manager.usage for replica in replicas] == [0.0] * len(replicas)
    assert all(not replica.has_work() for replica in replicas)


def test_router_index_mirrors_every_replica_cache():
    simulation, records, _, replicas = simulate("prefix")
    index = simulation.routers[0].router.index
    assert sum(record.num_cached_tokens for record in records) > 0
    assert sum(len(replica.cached_block_hashes()) for replica in replicas) > 0
    for replica in replicas:
        cached = replica.cached_block_hashes()
        assert index.num_blocks(replica.replica_id) == len(cached)
        assert all(index.match([block_hash]).get(replica.replica_id) == 1 for block_hash in cached)


def test_consistent_hashing_keeps_a_session_on_one_replica():
    _, records, _, _ = simulate("consistent_hash")
    replicas_by_session = {}
    for record in records:
        replicas_by_session.setdefault(record.session_id, set()).add(record.replica_id)
    assert all(len(replica_ids) == 1 for replica_ids in replicas_by_session.values())
    assert len({next(iter(ids)) for ids in replicas_by_session.values()}) > 1


def test_round_robin_deals_in_turn():
    _, records, _, _ = simulate("round_robin", workload="system-prompts", num_replicas=4)
    in_arrival_order = sorted(records, key=lambda record: record.arrival_s)
    assert [record.replica_id for record in in_arrival_order[:8]] == ["r0", "r1", "r2", "r3"] * 2
    assert sorted(Counter(record.replica_id for record in records).values()) == [6, 6, 6, 6]


def test_runs_are_deterministic():
    first = [(r.request_id, r.replica_id, r.first_token_s, r.num_cached_tokens) for r in simulate("prefix")[1]]
    second = [(r.request_id, r.replica_id, r.first_token_s, r.num_cached_tokens) for r in simulate("prefix")[1]]
    assert first == second


def test_pooled_reference_counts_shared_blocks_and_floors_each_ttft_at_its_uncached_prefill():
    shared = list(range(1000, 1032))  # two full blocks both prompts start with
    programs = [Program("a", [Turn(shared + list(range(2000, 2016)), [7, 8])]),
                Program("b", [Turn(shared + list(range(3000, 3016)), [9])])]
    records = [RequestRecord("b/0", "b", "r0", 1.0, 48), RequestRecord("a/0", "a", "r1", 0.0, 48)]
    reference = pooled_lru(programs, records, num_blocks=8, block_size=BLOCK_SIZE,
                           step_model=StepModel(a=0.1, b=0.01, c=0.0, d=0.0))
    # in arrival order: a finds nothing; b finds the two shared blocks, 32 of its 48 tokens
    assert reference.hit_rate == pytest.approx(32 / 96)
    assert reference.ttft_floor == pytest.approx([0.1 + 0.01 * 48, 0.1 + 0.01 * 16])


def test_coding_agents_grow_long_histories_turn_by_turn():
    programs = make_workload("coding-agents", seed=1, num_replicas=1, num_requests=100)
    assert [len(program.turns) for program in programs] == [15, 23, 21, 16, 29]
    assert [len(program.turns[-1].prompt) + len(program.turns[-1].output) for program in programs] == [
        25054, 33069, 31220, 20508, 43339]
    assert [round(turn.gap_s, 2) for turn in programs[0].turns[:6]] == [0.0, 1.0, 3.92, 3.24, 5.28, 7.29]
    for program in programs:  # every turn's prompt starts with the previous turn's prompt and answer
        for previous, turn in zip(program.turns, program.turns[1:]):
            assert turn.prompt[:len(previous.prompt) + len(previous.output)] == previous.prompt + previous.output


def test_replicas_sharing_a_node_pool_load_from_it_and_the_index_mirrors_it(tmp_path):
    programs = make_workload("system-prompts", seed=1, num_replicas=3, num_requests=24)
    assign_starts(programs, requests_per_s=6.0, seed=1)
    clock = SimClock()
    pool = HostPool(HostPoolSpec(str(tmp_path / "pool"), 1024, 1, "sim"))
    replicas = [SimReplica(f"r{i}", 256, BLOCK_SIZE, STEP_MODEL, clock, host_pool=pool, load_s_per_block=1e-4)
                for i in range(3)]
    router = make_router("prefix", [replica.replica_id for replica in replicas], BLOCK_SIZE, clock, 0)
    records = Simulation(programs, replicas, [router], BLOCK_SIZE, clock).run()
    assert len(records) == 24 and all(record.finished_s is not None for record in records)
    assert [replica.kv_cache_manager.usage for replica in replicas] == [0.0] * 3
    loaded = sum(replica.scheduler.host_pool_hits for replica in replicas)
    assert 0 < loaded <= sum(record.num_cached_tokens for record in records)
    for replica in replicas:  # an idle engine publishes every second: its view of the pool catches up
        router.deliver(replica.replica_id, replica.publish())
        assert set(router.router.index.stored_hashes(replica.replica_id, "host")) == pool.contents()
    assert 0 < len(pool.contents()) <= 1024


@pytest.mark.parametrize("pool_write", ["through", "evict"])
def test_a_pool_written_through_holds_every_computed_block_and_one_written_on_evict_what_the_device_evicted(
        tmp_path, pool_write):
    pool = HostPool(HostPoolSpec(str(tmp_path / "pool"), 64, 1, "sim"))
    replica = SimReplica("r0", 6, BLOCK_SIZE, STEP_MODEL, SimClock(), host_pool=pool, pool_write=pool_write)
    chains = {}
    for request_id, first_token in (("a", 100), ("b", 500)):  # 3 full blocks and a token each, of 5 blocks
        prompt = list(range(first_token, first_token + 3 * BLOCK_SIZE + 1))
        chains[request_id] = hash_token_blocks(prompt, BLOCK_SIZE)
        replica.add(request_id, prompt, chains[request_id], [7], 0.0, request_id, True)
        while replica.has_work():
            replica.complete(replica.schedule()[0])
    if pool_write == "through":
        assert pool.contents() == {*chains["a"], *chains["b"]}
    else:  # b took the one block a never used, a's partial block, then a's last two full ones, tail first
        assert pool.contents() == set(chains["a"][1:])
