from replica.kv_cache import hash_token_blocks
from replica.request import Request, RequestStatus, SamplingParams

from .scheduler_helpers import make_scheduler, step


def test_counters_and_token_lists():
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    request.append_output_token_ids(4)
    request.append_output_token_ids([5, 6])
    assert request.output_token_ids == [4, 5, 6]
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert (request.num_prompt_tokens, request.num_output_tokens, request.num_tokens) == (3, 3, 6)
    assert request.prompt_token_ids == [1, 2, 3]
    assert request.num_cached_tokens == -1 and request.status == RequestStatus.WAITING


def test_status_order_finished_after_preempted():
    assert [s.name for s in RequestStatus] == [
        "WAITING", "RUNNING", "PREEMPTED", "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED",
        "FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR"]
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_STOPPED)


def test_block_hashes_kept_current_as_tokens_are_appended(make_request):
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", list(range(6)), max_tokens=8)
    scheduler.add_request(request)
    for _ in range(3):
        step(scheduler, token_id=9)
    assert request.all_token_ids == list(range(6)) + [9, 9, 9]
    assert request.block_hashes == hash_token_blocks(request.all_token_ids, 4)
    assert len(request.block_hashes) == 2


def test_a_migrated_request_recomputes_its_output_and_counts_it_against_max_tokens():
    scheduler = make_scheduler(block_size=4)
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), output_token_ids=[4, 5])
    assert (request.num_prompt_tokens, request.num_output_tokens, request.all_token_ids) == (3, 2, [1, 2, 3, 4, 5])
    scheduler.add_request(request)
    assert request.block_hashes == hash_token_blocks([1, 2, 3, 4], 4)
    output, [first] = step(scheduler, token_id=6)
    [new] = output.scheduled_new_reqs
    assert (new.prompt_token_ids, new.output_token_ids, output.num_scheduled_tokens) == ([1, 2, 3], [4, 5], {"a": 5})
    assert (first.new_token_ids, first.finished) == ([6], False)
    _, [last] = step(scheduler, token_id=7)
    assert (last.new_token_ids, last.finished, last.finish_reason) == ([7], True, "length")
    assert request.output_token_ids == [4, 5, 6, 7]
