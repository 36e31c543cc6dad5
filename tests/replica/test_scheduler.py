import pytest

from replica.request import Request, RequestStatus, SamplingParams
from replica.scheduler import ModelRunnerOutput, RequestOutput

from .scheduler_helpers import make_scheduler, step


def test_first_step_sends_new_request_data(make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", list(range(10))))
    output = scheduler.schedule()
    [new] = output.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.block_ids, new.num_computed_tokens) == (
        "a", list(range(10)), [1, 2, 3], 0)
    assert output.scheduled_cached_reqs.req_ids == []
    assert output.num_scheduled_tokens == {"a": 10}
    assert output.total_num_scheduled_tokens == 10
    assert scheduler.requests["a"].num_computed_tokens == 10
    assert scheduler.requests["a"].status == RequestStatus.RUNNING


def test_continuing_requests_send_only_new_blocks(make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", list(range(8))))
    step(scheduler)
    output, _ = step(scheduler)  # 9 tokens, block 3 needed for token index 8
    cached = output.scheduled_cached_reqs
    assert (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens) == (["a"], [[3]], [8])
    assert cached.resumed_req_ids == set()
    output, _ = step(scheduler)
    assert output.scheduled_cached_reqs.new_block_ids == [[]]


def test_one_budget_running_first_then_chunked_waiting(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", list(range(10))))
    step(scheduler)
    scheduler.add_request(make_request("b", list(range(100, 130))))
    scheduler.add_request(make_request("c", list(range(200, 210))))
    output, outs = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [o.request_id for o in outs] == ["a"]  # b is a partial prefill
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 15}
    output, outs = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 1, "c": 10}
    assert [o.request_id for o in outs] == ["a", "b", "c"]


def test_long_prefill_threshold_caps_each_chunk(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=12)
    scheduler.add_request(make_request("a", list(range(30))))
    scheduler.add_request(make_request("b", list(range(100, 105))))
    assert scheduler.schedule().num_scheduled_tokens == {"a": 12, "b": 5}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=20, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", list(range(12))))
    scheduler.add_request(make_request("b", list(range(100, 112))))
    scheduler.add_request(make_request("c", list(range(200, 204))))  # would fit, but no skipping ahead
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 12}
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 12, "c": 4}


def test_max_num_seqs_caps_the_running_set(make_request):
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i] * 5))
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_prefix_hit_recorded_on_first_schedule_and_in_stats(make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", list(range(10))))
    step(scheduler)
    scheduler.add_request(make_request("b", list(range(9)) + [77]))
    output, _ = step(scheduler)
    [new] = output.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == [1, 2]
    assert output.num_scheduled_tokens == {"a": 1, "b": 2}
    assert scheduler.requests["b"].num_cached_tokens == 8
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert stats.num_cached_blocks == 2  # a's two full blocks, which b shares


def test_same_step_identical_prompts_share_blocks(make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", list(range(9))))
    scheduler.add_request(make_request("b", list(range(9))))
    output = scheduler.schedule()
    assert [n.block_ids for n in output.scheduled_new_reqs] == [[1, 2, 3], [1, 2, 4]]
    assert output.num_scheduled_tokens == {"a": 9, "b": 1}


def test_fcfs_preempts_the_tail_and_requeues_it_at_the_head(make_request):
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)  # 4 usable blocks
    scheduler.add_request(make_request("a", list(range(8)), ignore_eos=True))
    scheduler.add_request(make_request("b", list(range(100, 108)), ignore_eos=True))
    scheduler.add_request(make_request("c", list(range(200, 202))))
    step(scheduler)  # a: 2 blocks, b: 2 blocks, c does not fit
    output, _ = step(scheduler)  # a needs a 3rd block for token 8: b (the tail) is preempted
    assert output.num_scheduled_tokens == {"a": 1}
    assert output.preempted_req_ids == {"b"}
    b = scheduler.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert scheduler.make_stats().num_preemptions == 1


def test_preempted_request_resumes_with_all_its_tokens(make_request):
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", list(range(8)), max_tokens=2))
    scheduler.add_request(make_request("b", list(range(100, 108)), max_tokens=4))
    step(scheduler)
    step(scheduler)  # b preempted (its tail block 4 is reused by a), a finishes
    output, _ = step(scheduler)
    cached = output.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.resumed_req_ids == {"b"}
    assert cached.all_token_ids == {"b": list(range(100, 108)) + [7]}
    assert cached.new_block_ids == [[3, 4, 2]]  # block 3 still holds b's first block: a prefix hit
    assert cached.num_computed_tokens == [4]
    assert output.num_scheduled_tokens == {"b": 5}
    assert scheduler.requests["b"].num_cached_tokens == 0  # kept from the first admission


def test_priority_preemption_rolls_back_an_already_scheduled_victim(make_request):
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, policy="priority")
    scheduler.add_request(make_request("low", list(range(4)), priority=5, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("high", list(range(100, 108)), priority=0, ignore_eos=True))
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["low", "high"]
    # low is scheduled first (no new block), then high needs a 3rd block and none is free:
    # low is the victim, its token is given back to the budget
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 1}
    assert output.total_num_scheduled_tokens == 1
    assert output.scheduled_cached_reqs.req_ids == ["high"]
    assert [r.request_id for r in scheduler.running] == ["high"]


def test_priority_request_that_picks_itself_gives_up(make_request):
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, policy="priority")
    scheduler.add_request(make_request("hi", list(range(8)), priority=0, ignore_eos=True))
    scheduler.add_request(make_request("lo", list(range(100, 104)), priority=9, ignore_eos=True))
    step(scheduler)
    output, _ = step(scheduler)  # hi fits (block 2 holds tokens 4..7 -> needs a 3rd for token 8)?
    assert output.preempted_req_ids == {"lo"}
    assert output.num_scheduled_tokens == {"hi": 1}
    for _ in range(3):
        step(scheduler)
    output, _ = step(scheduler)  # hi needs a 4th block, nothing else to evict: it preempts itself
    assert output.preempted_req_ids == {"hi"}
    assert output.num_scheduled_tokens == {}
    assert scheduler.running == []


def test_priority_waiting_order(make_request):
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    scheduler.add_request(make_request("late", [1], priority=1, arrival_time=1))
    scheduler.add_request(make_request("b", [2], priority=0, arrival_time=5))
    scheduler.add_request(make_request("a", [3], priority=0, arrival_time=5))
    scheduler.add_request(make_request("early", [4], priority=0, arrival_time=2))
    assert [r.request_id for r in scheduler.waiting] == ["early", "a", "b", "late"]
    assert list(scheduler.schedule().num_scheduled_tokens) == ["early"]


def test_admission_failure_stops_admission(make_request):
    scheduler = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks
    scheduler.add_request(make_request("first", list(range(8))))
    step(scheduler)  # first holds 2 blocks, and its next token takes a third
    scheduler.add_request(make_request("big", list(range(100, 112))))  # needs 3 blocks: does not fit now
    scheduler.add_request(make_request("small", [1, 2]))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"first": 1}
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]


def test_stop_conditions_and_finish_reasons():
    scheduler = make_scheduler()
    scheduler.add_request(Request("eos", [1, 2], SamplingParams(max_tokens=5), eos_token_id=7))
    scheduler.add_request(Request("ignore", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=7))
    scheduler.add_request(Request("stop_id", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[7])))
    _, outs = step(scheduler, token_id=7)
    assert [(o.request_id, o.finished, o.finish_reason, o.stop_reason) for o in outs] == [
        ("eos", True, "stop", None), ("ignore", False, None, None), ("stop_id", True, "stop", 7)]
    _, outs = step(scheduler, token_id=7)
    assert outs == [RequestOutput("ignore", [7], True, "length", None)]
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 99


def test_max_model_len_caps_generation(make_request):
    scheduler = make_scheduler(max_model_len=6)
    scheduler.add_request(make_request("a", [1, 2, 3, 4], max_tokens=10))
    outs = [step(scheduler)[1] for _ in range(2)]
    assert outs[1] == [RequestOutput("a", [7], True, "length", None)]
    assert len(outs[0][0].new_token_ids) == 1


def test_several_tokens_appended_until_stop(make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    output = scheduler.schedule()
    outs = scheduler.update_from_output(output, ModelRunnerOutput(["a"], [[10, 11, 12, 13]]))
    assert outs == [RequestOutput("a", [10, 11, 12], True, "length", None)]


def test_schedule_again_before_output_passes_over_requests(make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    first = scheduler.schedule()
    scheduler.add_request(make_request("b", [4, 5]))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"b": 2}
    scheduler.update_from_output(first, ModelRunnerOutput(["a"], [[9]]))
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}


def test_finish_requests_aborts_running_and_waiting(make_request):
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("run", list(range(9))))
    scheduler.add_request(make_request("wait", list(range(5))))
    output = scheduler.schedule()
    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.running == [] and len(scheduler.waiting) == 0 and scheduler.requests == {}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 99
    outs = scheduler.update_from_output(output, ModelRunnerOutput(["run"], [[1]]))
    assert outs == []
    assert scheduler.schedule().finished_req_ids == {"run", "wait"}
    with pytest.raises(ValueError, match="not a finished status"):
        scheduler.finish_requests("x", RequestStatus.RUNNING)


def test_bad_input_is_rejected_and_nothing_enqueued(make_request):
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        scheduler.add_request(make_request("a", [2]))
    with pytest.raises(ValueError, match="prompt of 8 tokens leaves no room"):
        scheduler.add_request(make_request("long", list(range(8))))
    with pytest.raises(ValueError, match="prompt is empty"):
        make_request("empty", [])
    assert list(scheduler.requests) == ["a"] and len(scheduler.waiting) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"temperature": -0.5}, "temperature must be non-negative"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be 0"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_watermark_holds_back_admissions_but_not_the_first(make_request):
    scheduler = make_scheduler(num_blocks=11, block_size=4, watermark=0.2)  # 10 usable, 2 reserved
    scheduler.add_request(make_request("a", list(range(28))))  # 7 blocks: alone, no watermark
    scheduler.add_request(make_request("b", list(range(100, 104))))  # 1 block: 3 free - 2 reserved
    scheduler.add_request(make_request("c", list(range(200, 208))))  # 2 blocks: 2 free - 2 reserved
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 28, "b": 4}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_running_requests_grow_into_the_watermark(make_request):
    scheduler = make_scheduler(num_blocks=11, block_size=4, watermark=0.2)  # 10 usable, 2 reserved
    scheduler.add_request(make_request("a", list(range(32))))  # 8 blocks: alone, no watermark
    step(scheduler)
    scheduler.add_request(make_request("b", list(range(100, 104))))  # 1 block: 1 free - 2 reserved after a's
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1}  # a's 9th block leaves 1 free, below the watermark
    assert (scheduler.num_preemptions, [r.request_id for r in scheduler.waiting]) == (0, ["b"])


@pytest.mark.parametrize("request_id, prompt, params, message", [
    ("", [1], SamplingParams(), "request_id must be a non-empty string"),
    ("a", [1, -2], SamplingParams(), "non-negative integers"),
    ("a", [1, 2.0], SamplingParams(), "non-negative integers"),
    ("a", [1], {"max_tokens": 4}, "sampling_params must be SamplingParams"),
])
def test_request_construction_is_the_one_input_check(request_id, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        Request(request_id, prompt, params)


@pytest.mark.parametrize("config", [{}, {"reserve_full_sequence": False}])
def test_a_prompt_larger_than_the_kv_cache_is_ignored_not_stalled(make_request, config):
    scheduler = make_scheduler(num_blocks=5, block_size=4, **config)  # 4 usable blocks: 16 tokens
    scheduler.add_request(make_request("huge", list(range(17))))
    scheduler.add_request(make_request("small", list(range(100, 104))))
    output, outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"small": 4}
    assert "huge" in output.finished_req_ids and "huge" not in scheduler.requests
    assert outputs[0] == RequestOutput("huge", [], True, "length")


def test_a_prompt_longer_than_a_step_without_chunking_is_ignored(make_request):
    scheduler = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=8)
    request = make_request("long", list(range(9)))
    scheduler.add_request(request)
    _, outputs = step(scheduler)
    assert request.status == RequestStatus.FINISHED_IGNORED
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("long", True, "length")]
    assert scheduler.get_num_unfinished_requests() == 0
