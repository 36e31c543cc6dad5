"""Many requests with shared prefixes through a small pool; every invariant checked every step."""
import random
from collections import Counter

import pytest

from replica.request import Request, RequestStatus, SamplingParams

from .scheduler_helpers import FakeClock, fake_model_output, make_scheduler

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
    assert set(manager.req_to_blocks) <= ({r.request_id for r in scheduler.running}
                                          | {pin.request.request_id for pin in scheduler.pins})


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_workload_keeps_invariants(policy, seed, async_scheduling):
    """With async scheduling each step's output comes back after the next step is scheduled."""
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, policy=policy,
                               max_num_batched_tokens=48, max_num_seqs=12, max_model_len=128,
                               long_prefill_token_threshold=rng.choice([0, 20]), async_scheduling=async_scheduling)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    pending = []
    for i in range(300):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True)
        pending.append(Request(f"r{i}", prompt, params, priority=rng.randrange(3), arrival_time=float(i)))
    expected = {r.request_id: r.max_tokens for r in pending}
    produced = Counter()
    in_flight = []
    for _ in range(5000):
        for _ in range(rng.randrange(3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests() and not in_flight:
            break
        output = scheduler.schedule()
        check_invariants(scheduler, output)
        in_flight.append((output, fake_model_output(scheduler, output, rng.randrange(1000))))
        if len(in_flight) > async_scheduling or not scheduler.has_unfinished_requests():
            for out in scheduler.update_from_output(*in_flight.pop(0)):
                produced[out.request_id] += len(out.new_token_ids)
    assert not pending and not scheduler.has_unfinished_requests()
    assert produced == expected
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert scheduler.kv_cache_manager.req_to_blocks == {}
    stats = scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


class _Program:
    def __init__(self, name: str, history: list[int], num_turns: int, ends_with_last_turn: bool):
        self.name = name
        self.history = history
        self.turns_left = num_turns
        self.ends_with_last_turn = ends_with_last_turn
        self.ready_at = 0.0
        self.num_turns_sent = 0
        self.in_flight: Request | None = None

    def next_turn(self, rng: random.Random) -> Request:
        self.turns_left -= 1
        self.num_turns_sent += 1
        params = SamplingParams(max_tokens=rng.randrange(1, 8), ignore_eos=True)
        self.in_flight = Request(f"{self.name}/{self.num_turns_sent}", self.history, params, session_id=self.name,
                                 last_turn=self.turns_left == 0 and self.ends_with_last_turn)
        return self.in_flight


def test_agent_programs_under_continuum_leave_no_block_pinned_or_held():
    """10^4 turns of programs that end with a last turn, stop sending, grow out of the context, or get
    aborted; tool gaps around the pins' time-to-live; steps that take 20 ms a token, so that pins' recompute
    prices reach past pin_max_wait_s."""
    rng, clock = random.Random(0), FakeClock()
    scheduler = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, policy="continuum", clock=clock,
                               max_num_batched_tokens=48, max_num_seqs=12, max_model_len=128,
                               pin_ttl_default_s=1.0, pin_ttl_max_s=3.0, pin_max_wait_s=1.0)
    system_prompts = [[rng.randrange(1000) for _ in range(rng.randrange(8, 24))] for _ in range(3)]
    programs: list[_Program] = []
    num_sent = num_aborted = 0
    while num_sent < 10_000 or programs:
        clock.now += 0.05
        if num_sent < 10_000 and len(programs) < 16:
            programs.append(_Program(f"p{num_sent}", rng.choice(system_prompts) + [rng.randrange(1000)],
                                     rng.randrange(1, 8), rng.random() < 0.7))
        for program in programs:
            if program.in_flight is None and program.ready_at <= clock.now:
                scheduler.add_request(program.next_turn(rng))
                num_sent += 1
        in_flight = [program for program in programs if program.in_flight is not None]
        if in_flight and rng.random() < 0.02:
            aborted = rng.choice(in_flight)
            scheduler.finish_requests(aborted.in_flight.request_id, RequestStatus.FINISHED_ABORTED)
            aborted.in_flight, aborted.turns_left = None, 0
            num_aborted += 1
        output = scheduler.schedule()
        check_invariants(scheduler, output)
        clock.now += 0.02 * output.total_num_scheduled_tokens
        finished = {out.request_id for out in scheduler.update_from_output(
            output, fake_model_output(scheduler, output, rng.randrange(1000))) if out.finished}
        for program in programs:
            request = program.in_flight
            if request is not None and request.request_id in finished:
                program.history = request.all_token_ids + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
                program.in_flight, program.ready_at = None, clock.now + rng.lognormvariate(0, 0.8)
        programs = [program for program in programs if program.in_flight is not None or (
            program.turns_left > 0 and len(program.history) < 100)]
    clock.now += 3.0
    scheduler.schedule()
    pins = scheduler.make_stats().pins
    assert len(scheduler.pins) == 0 and scheduler.kv_cache_manager.req_to_blocks == {}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert num_aborted > 0 and min(pins.hits, pins.expired, pins.released) > 0, pins
