"""Speculative decoding in the scheduler: drafts in the budget, lookahead slots, clawback of rejected drafts."""
import random
from collections import Counter

from replica.request import Request, RequestStatus, SamplingParams
from replica.scheduler import ModelRunnerOutput, SpecDecodingStats

from .scheduler_helpers import make_scheduler, step
from .test_scheduler_random import BLOCK_SIZE, NUM_BLOCKS, check_invariants


def decoding(scheduler, make_request, request_id: str = "a", prompt_len: int = 10, **kwargs):
    """A request whose prompt is computed and whose first token (7) is out (by default: num_tokens 11,
    computed 10). Prompts of different requests share no prefix."""
    first = 1000 * len(scheduler.requests)
    request = make_request(request_id, list(range(first, first + prompt_len)), ignore_eos=True, **kwargs)
    scheduler.add_request(request)
    step(scheduler)
    return request


def verified(output, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    """The runner's answer: per request, the accepted drafts and the token after them."""
    return ModelRunnerOutput(list(output.num_scheduled_tokens),
                             [tokens.get(req_id, []) for req_id in output.num_scheduled_tokens])


def test_drafts_count_in_the_gap_and_the_budget(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=16, num_speculative_tokens=3)
    a = decoding(scheduler, make_request)
    a.spec_token_ids = [1, 2, 3]
    assert a.num_tokens_with_spec == 14
    scheduler.add_request(make_request("b", list(range(100, 130))))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4, "b": 12}  # the last token and 3 drafts; b gets the rest
    assert output.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert (a.spec_token_ids, a.num_computed_tokens) == ([], 14)


def test_a_short_budget_trims_the_drafts(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=3, num_speculative_tokens=3)
    a = decoding(scheduler, make_request, prompt_len=2)  # num_tokens 3, computed 2
    a.spec_token_ids = [1, 2, 3]
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 3}
    assert output.scheduled_spec_decode_tokens == {"a": [1, 2]}
    assert (a.spec_token_ids, a.num_computed_tokens) == ([], 5)


def test_a_budget_of_one_token_schedules_no_draft_and_drops_them(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=1, num_speculative_tokens=3)
    a = decoding(scheduler, make_request, prompt_len=1)
    a.spec_token_ids = [1, 2, 3]
    output = scheduler.schedule()
    assert (output.num_scheduled_tokens, output.scheduled_spec_decode_tokens) == ({"a": 1}, {})
    assert a.spec_token_ids == []


def test_running_requests_get_lookahead_slots_for_the_next_drafts(make_request):
    scheduler = make_scheduler(block_size=4, num_speculative_tokens=3)
    a = decoding(scheduler, make_request)  # admitted without lookahead: 10 tokens in blocks 1-3
    assert scheduler.kv_cache_manager.get_block_ids("a") == [1, 2, 3]
    a.spec_token_ids = [1, 2, 3]
    output = scheduler.schedule()
    # slots for 10 computed + 4 scheduled + 3 lookahead = 17 tokens: 5 blocks (without lookahead 4)
    assert output.scheduled_cached_reqs.new_block_ids == [[4, 5]]
    scheduler.update_from_output(output, verified(output, {"a": [1, 2, 3, 4]}))  # all accepted, and 4
    assert (a.num_tokens, a.num_computed_tokens) == (15, 14)
    output = scheduler.schedule()  # no drafts this time: 14 + 1 + 3 = 18 tokens, 5 blocks
    assert output.scheduled_cached_reqs.new_block_ids == [[]]
    scheduler.update_from_output(output, verified(output, {"a": [5]}))
    a.spec_token_ids = [6, 7, 8]
    output = scheduler.schedule()  # 15 + 4 + 3 = 22 tokens: 6 blocks
    assert output.scheduled_cached_reqs.new_block_ids == [[6]]
    assert scheduler.kv_cache_manager.get_block_ids("a") == [1, 2, 3, 4, 5, 6]


def test_rejected_drafts_are_taken_back_and_computed_again(make_request):
    scheduler = make_scheduler(num_speculative_tokens=3)
    a = decoding(scheduler, make_request)
    a.spec_token_ids = [1, 2, 3]
    output = scheduler.schedule()
    assert a.num_computed_tokens == 14
    [out] = scheduler.update_from_output(output, verified(output, {"a": [1, 9]}))  # 1 accepted, 9 instead of 2
    assert out.new_token_ids == [1, 9]
    assert a.output_token_ids == [7, 1, 9]
    assert (a.num_tokens, a.num_computed_tokens) == (13, 12)
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}  # token 9 only: the drafts after it are gone


def test_after_a_rejection_the_next_drafts_follow_the_new_token(make_request):
    scheduler = make_scheduler(num_speculative_tokens=3)
    a = decoding(scheduler, make_request)
    a.spec_token_ids = [1, 2, 3]
    output = scheduler.schedule()
    scheduler.update_from_output(output, verified(output, {"a": [5]}))  # nothing accepted
    assert (a.num_tokens, a.num_computed_tokens) == (12, 11)
    a.spec_token_ids = [6, 7]
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 3}
    assert output.scheduled_spec_decode_tokens == {"a": [6, 7]}
    assert output.scheduled_cached_reqs.num_computed_tokens == [11]


def test_drafts_are_discarded_on_preemption(make_request):
    scheduler = make_scheduler(num_blocks=6, block_size=4, num_speculative_tokens=2)  # 5 usable blocks
    a = decoding(scheduler, make_request, "a", prompt_len=8)
    b = decoding(scheduler, make_request, "b", prompt_len=8)
    kv = scheduler.kv_cache_manager
    assert (kv.get_block_ids("a"), kv.get_block_ids("b"), a.num_computed_tokens) == ([1, 2, 3], [4, 5], 9)
    a.spec_token_ids, b.spec_token_ids = [1, 2], [3, 4]
    output = scheduler.schedule()
    # a's 9 + 3 tokens fit its 3 blocks, but not with 2 lookahead slots: b, the tail, is preempted
    assert output.preempted_req_ids == {"b"}
    assert (b.status, b.spec_token_ids, b.num_computed_tokens) == (RequestStatus.PREEMPTED, [], 0)
    assert output.num_scheduled_tokens == {"a": 3}
    assert output.scheduled_spec_decode_tokens == {"a": [1, 2]}
    assert output.scheduled_cached_reqs.new_block_ids == [[5]]  # b's blocks were freed tail first


def test_a_preempted_victim_scheduled_earlier_takes_its_drafts_back(make_request):
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, policy="priority",
                               num_speculative_tokens=1)
    low = decoding(scheduler, make_request, "low", prompt_len=2, priority=5)
    high = decoding(scheduler, make_request, "high", prompt_len=7, priority=0)
    low.spec_token_ids, high.spec_token_ids = [1], [2]
    output = scheduler.schedule()  # low (3 + 1 slots fit its block) first; high needs a third block: low goes
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 2}
    assert output.scheduled_spec_decode_tokens == {"high": [2]}
    assert low.spec_token_ids == []


def test_no_block_is_cached_over_draft_positions(make_request):
    scheduler = make_scheduler(block_size=4, num_speculative_tokens=5)
    a = decoding(scheduler, make_request, prompt_len=7)  # 8 tokens: 2 full blocks
    kv = scheduler.kv_cache_manager
    a.spec_token_ids = [1, 2, 3, 4, 5]
    output = scheduler.schedule()  # computes through position 12, of which 8-12 are drafts
    assert a.num_computed_tokens == 13
    assert kv.num_cached_blocks["a"] == 2
    third = kv.block_pool.blocks[kv.get_block_ids("a")[2]]
    assert third.block_hash is None
    scheduler.update_from_output(output, verified(output, {"a": [1, 2, 3, 4, 5, 6]}))
    scheduler.schedule()  # now the accepted drafts are tokens: 14 tokens, 3 full blocks
    assert kv.num_cached_blocks["a"] == 3
    assert third.block_hash == a.block_hashes[2]


def test_a_stop_inside_the_accepted_drafts_drops_the_rest(make_request):
    scheduler = make_scheduler(num_speculative_tokens=3)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=16, stop_token_ids=[2]))
    scheduler.add_request(a)
    step(scheduler)
    a.spec_token_ids = [1, 2, 3]
    output = scheduler.schedule()
    [out] = scheduler.update_from_output(output, verified(output, {"a": [1, 2, 3, 4]}))
    assert (out.new_token_ids, out.finished, out.finish_reason, out.stop_reason) == ([1, 2], True, "stop", 2)
    assert a.output_token_ids == [7, 1, 2]
    assert "a" in scheduler.finished_req_ids and scheduler.running == []


def test_spec_decoding_stats_count_drafts_and_acceptance_by_position(make_request):
    scheduler = make_scheduler(num_speculative_tokens=3)
    a = decoding(scheduler, make_request, "a")
    b = decoding(scheduler, make_request, "b", prompt_len=5)
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3], [4, 5]
    output = scheduler.schedule()
    scheduler.update_from_output(output, verified(output, {"a": [1, 2, 9], "b": [4, 8]}))
    output = scheduler.schedule()  # no drafts: not counted
    scheduler.update_from_output(output, verified(output, {"a": [1], "b": [1]}))
    assert scheduler.make_stats().spec_decoding == SpecDecodingStats(
        num_drafts=2, num_draft_tokens=5, num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1, 0])


def test_random_workload_with_drafts_keeps_invariants():
    """Random drafts, a random number of them accepted, through a pool small enough to preempt."""
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=32,
                               max_num_seqs=12, max_model_len=64, num_speculative_tokens=3)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    pending = [Request(f"r{i}", rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 8))],
                       SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True)) for i in range(150)]
    expected = {r.request_id: min(r.max_tokens, 64 - r.num_prompt_tokens) for r in pending}
    produced = Counter()
    while pending or scheduler.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        output = scheduler.schedule()
        check_invariants(scheduler, output)
        kv = scheduler.kv_cache_manager
        for request in scheduler.running:  # no block is cached over positions that hold no token yet
            assert kv.num_cached_blocks.get(request.request_id, 0) * BLOCK_SIZE <= request.num_tokens
        tokens = {}
        for req_id in output.num_scheduled_tokens:
            request = scheduler.requests[req_id]
            drafts = output.scheduled_spec_decode_tokens.get(req_id, [])
            if request.num_computed_tokens >= request.num_tokens:
                tokens[req_id] = drafts[:rng.randrange(len(drafts) + 1)] + [rng.randrange(1000)]
        for out in scheduler.update_from_output(output, verified(output, tokens)):
            produced[out.request_id] += len(out.new_token_ids)
        for request in scheduler.running:
            assert request.num_computed_tokens <= request.num_tokens
            if request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = [rng.randrange(1000) for _ in range(rng.randrange(4))]
    assert produced == expected
    stats = scheduler.make_stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens
    assert kv.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
