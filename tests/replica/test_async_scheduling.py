"""Async scheduling: step N+1 is scheduled while step N executes, its samples standing in as placeholders."""
from replica.request import RequestStatus
from replica.scheduler import ModelRunnerOutput, RequestOutput

from .scheduler_helpers import make_scheduler


def test_a_decode_is_scheduled_before_the_token_it_reads_comes_back(make_request):
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3]))
    first = scheduler.schedule()
    a = scheduler.requests["a"]
    assert (first.num_scheduled_tokens, a.num_output_placeholders) == ({"a": 3}, 1)
    second = scheduler.schedule()
    assert (second.num_scheduled_tokens, a.num_computed_tokens, a.num_output_placeholders) == ({"a": 1}, 4, 2)
    assert scheduler.update_from_output(first, ModelRunnerOutput(["a"], [[10]])) == [RequestOutput("a", [10], False)]
    assert scheduler.update_from_output(second, ModelRunnerOutput(["a"], [[11]])) == [RequestOutput("a", [11], False)]
    assert (a.all_token_ids, a.num_computed_tokens, a.num_output_placeholders) == ([1, 2, 3, 10, 11], 4, 0)
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}


def test_skip_ahead_passes_over_a_request_whose_last_token_is_in_flight(make_request):
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    scheduler.add_request(make_request("b", [4, 5], max_tokens=3))
    first = scheduler.schedule()
    second = scheduler.schedule()  # a's one token is in flight: skipped, and b behind it still runs
    assert (first.num_scheduled_tokens, second.num_scheduled_tokens) == ({"a": 3, "b": 2}, {"b": 1})
    assert scheduler.update_from_output(first, ModelRunnerOutput(["a", "b"], [[7], [8]])) == [
        RequestOutput("a", [7], True, "length"), RequestOutput("b", [8], False)]
    assert scheduler.update_from_output(second, ModelRunnerOutput(["b"], [[9]])) == [RequestOutput("b", [9], False)]
    assert scheduler.schedule().num_scheduled_tokens == {"b": 1}
    last = scheduler.schedule()  # b's third and last token is in flight
    assert (last.num_scheduled_tokens, last.total_num_scheduled_tokens, len(scheduler.running)) == ({}, 0, 1)


def preempt_b_while_its_step_executes(make_request, **b_options):
    """3 usable blocks of 4: a and b take one each in step 1; in step 2, scheduled while step 1 still
    executes, a takes the last one for its 5th token and b, the tail, is preempted."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, async_scheduling=True, reserve_full_sequence=False)
    scheduler.add_request(make_request("a", [0, 1, 2, 3], max_tokens=2))
    scheduler.add_request(make_request("b", [100, 101, 102, 103], max_tokens=4, **b_options))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert (second.num_scheduled_tokens, second.preempted_req_ids) == ({"a": 1}, {"b"})
    return scheduler, first, second


def test_a_request_preempted_while_its_step_executes_keeps_that_steps_token(make_request):
    scheduler, first, second = preempt_b_while_its_step_executes(make_request)
    b = scheduler.requests["b"]
    assert scheduler.update_from_output(first, ModelRunnerOutput(["a", "b"], [[7], [8]])) == [
        RequestOutput("a", [7], False), RequestOutput("b", [8], False)]
    assert (b.status, b.output_token_ids, b.num_output_placeholders) == (RequestStatus.PREEMPTED, [8], 0)
    assert scheduler.update_from_output(second, ModelRunnerOutput(["a"], [[9]])) == [
        RequestOutput("a", [9], True, "length")]
    resumed = scheduler.schedule()  # b's first block is a prefix hit; its 5th token, 8, is computed now
    cached = resumed.scheduled_cached_reqs
    assert (cached.resumed_req_ids, cached.all_token_ids) == ({"b"}, {"b": [100, 101, 102, 103, 8]})
    assert (cached.new_block_ids, cached.num_computed_tokens) == ([[2, 3]], [4])
    assert resumed.num_scheduled_tokens == {"b": 1}


def test_the_late_token_of_a_preempted_request_may_finish_it(make_request):
    scheduler, first, second = preempt_b_while_its_step_executes(make_request, eos_token_id=8)
    assert scheduler.update_from_output(first, ModelRunnerOutput(["a", "b"], [[7], [8]])) == [
        RequestOutput("a", [7], False), RequestOutput("b", [8], True, "stop")]
    assert ("b" in scheduler.requests, len(scheduler.waiting)) == (False, 0)
    scheduler.update_from_output(second, ModelRunnerOutput(["a"], [[9]]))
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 3
