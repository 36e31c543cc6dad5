"""Constraints without a model: compiling off the step path (cache, failures, time limit), the scheduler passing
over requests whose grammar compiles, advancing on committed tokens, and one step's bitmask with drafts. The
grammars are real (llguidance) over a byte-level tokenizer: token b is byte b, </s> (257) ends a sequence."""
import threading
from concurrent.futures import wait

import numpy as np
import pytest

from replica.request import Request, RequestStatus, SamplingParams
from replica.structured_output import ReasoningGate, StructuredOutputsParams
from replica.structured_output.backend import GrammarError, GuidanceBackend
from replica.structured_output.manager import StructuredOutputManager
from tests.executor.helpers import byte_tokenizer_backend
from tests.replica.scheduler_helpers import FakeClock, make_scheduler, step

EOS = 257
DIGITS = StructuredOutputsParams(regex="[0-9]{2}")
TOKENIZER = byte_tokenizer_backend()


def tok(char: str) -> int:
    return TOKENIZER.encode(char).ids[0]


def allowed(bitmask: np.ndarray, row: int) -> set[int]:
    return {token for token in range(bitmask.shape[1] * 32) if (int(bitmask[row, token // 32]) >> (token % 32)) & 1}


@pytest.fixture(scope="module")
def backend() -> GuidanceBackend:
    return GuidanceBackend(TOKENIZER, 260, EOS)


@pytest.fixture
def manager(backend) -> StructuredOutputManager:
    manager = StructuredOutputManager(backend, cache_size=2)
    yield manager
    manager.shutdown()


class GatedFakeBackend:
    """The real backend's compile, once the gate opens."""

    def __init__(self, backend: GuidanceBackend):
        self.backend, self.vocab_size, self.gate = backend, backend.vocab_size, threading.Event()

    def compile(self, params: StructuredOutputsParams):
        self.gate.wait()
        return self.backend.compile(params)

    copy = staticmethod(GuidanceBackend.copy)


def settled(request):
    wait([request.future], timeout=10)
    assert request.poll()
    return request


def test_params_take_exactly_one_kind():
    assert StructuredOutputsParams(choice=["a"]).key() == ("choice", '["a"]', True, None)
    assert StructuredOutputsParams(json_schema={"b": 1, "a": 2}).key() == ("json", '{"a":2,"b":1}', True, None)
    gate = ReasoningGate(closing='"</think>"')
    assert StructuredOutputsParams(choice=["a"], reasoning=gate).key() == ("choice", '["a"]', True, gate)
    with pytest.raises(ValueError, match="got 2: regex, grammar"):
        StructuredOutputsParams(regex="a", grammar="start: /a/")
    with pytest.raises(ValueError, match="got 0"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="NUL"):
        StructuredOutputsParams(regex="a\x00")


def test_one_compile_per_spec_cached_and_bounded(manager):
    first, second = manager.request(DIGITS), manager.request(DIGITS)
    assert first.future is second.future
    manager.request(StructuredOutputsParams(choice=["x"]))
    manager.request(StructuredOutputsParams(choice=["y"]))  # the cache holds 2: DIGITS goes
    assert manager.request(DIGITS).future is not first.future
    assert settled(first).grammar is not settled(second).grammar  # each request advances a copy of its own


def test_a_failed_compile_is_cached_and_fails_each_request(manager):
    bad = StructuredOutputsParams(grammar="start: missing_rule")
    first = settled(manager.request(bad))
    assert first.grammar is None and first.error.startswith("the grammar constraint does not compile: ")
    assert manager.request(bad).future is first.future
    with pytest.raises(GrammarError):
        first.future.result()


def test_a_compile_past_its_deadline_fails_its_request(backend):
    clock, gated = FakeClock(), GatedFakeBackend(backend)
    manager = StructuredOutputManager(gated, compile_timeout_s=5.0, clock=clock)
    request = manager.request(DIGITS)
    clock.now = 4.9
    assert not request.poll()
    clock.now = 5.0
    assert request.poll() and request.error == "the constraint took too long to compile"
    gated.gate.set()
    manager.shutdown()


def test_a_request_replays_the_output_it_brings(manager):
    assert settled(manager.request(DIGITS, [tok("4")])).grammar.validate([tok("2"), EOS]) == 2
    assert settled(manager.request(DIGITS, [tok("x")])).error == \
        "the output so far does not match the regex constraint"


def test_bitmask_rows_follow_the_drafts_and_leave_the_grammar_where_it_was(manager):
    request = settled(manager.request(DIGITS))
    other = settled(manager.request(StructuredOutputsParams(choice=["ok"])))
    bitmask = manager.fill_bitmask([("a", request.grammar, [tok("1"), tok("2")]), ("b", other.grammar, [])])
    assert bitmask.rows == {"a": 0, "b": 3}
    mask = bitmask.result()
    digits = {tok(str(digit)) for digit in range(10)}
    assert [allowed(mask, row) for row in range(4)] == [digits, digits, {EOS}, {tok("o")}]
    assert request.grammar.validate([tok("1"), tok("2"), EOS]) == 3  # rolled back to the start
    assert manager.fill_bitmask([]) is None


def test_a_rejected_draft_leaves_the_rows_after_it_open(manager):
    request = settled(manager.request(DIGITS))
    mask = manager.fill_bitmask([("a", request.grammar, [tok("x"), tok("1")])]).result()
    assert allowed(mask, 0) == {tok(str(digit)) for digit in range(10)}
    assert len(allowed(mask, 1)) == len(allowed(mask, 2)) == mask.shape[1] * 32


def test_rows_filled_in_parallel_equal_rows_filled_one_at_a_time():
    backend = GuidanceBackend(TOKENIZER, 260, EOS, num_fill_threads=3)
    grammars = [backend.compile(params) for params in
                (DIGITS, DIGITS, DIGITS, DIGITS, StructuredOutputsParams(choice=["ok", "no"]))]
    grammars[1].accept(tok("1"))
    assert not grammars[2].accept(tok("x"))  # in error: nothing but the end is allowed
    for token in (tok("1"), tok("2"), EOS):
        grammars[3].accept(token)
    parallel = np.zeros((8, 9), dtype=np.int32)
    backend.fill_bitmasks(parallel, [(grammar, 7 - index) for index, grammar in enumerate(grammars)])
    digits = {tok(str(digit)) for digit in range(10)}
    assert [allowed(parallel, 7 - index) for index in range(5)] == [digits, digits, {EOS}, {EOS}, {tok("o"), tok("n")}]
    one_at_a_time = np.zeros_like(parallel)
    for index, grammar in enumerate(grammars):
        grammar.fill_bitmask(one_at_a_time, 7 - index)
    assert (parallel == one_at_a_time).all() and not parallel[:3].any()


def constrained_request(manager, request_id: str, params: StructuredOutputsParams, compiled: bool = True) -> Request:
    structured = manager.request(params)
    if compiled:
        wait([structured.future], timeout=10)
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=params),
                   eos_token_id=EOS, structured_output=structured)


def test_the_scheduler_passes_over_a_compiling_request(backend):
    gated = GatedFakeBackend(backend)
    manager = StructuredOutputManager(gated)
    scheduler = make_scheduler()
    scheduler.add_request(constrained_request(manager, "grammar", DIGITS, compiled=False))
    scheduler.add_request(Request("plain", [4, 5], SamplingParams(max_tokens=8)))
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["plain"]
    assert scheduler.make_stats().num_waiting == 1 and scheduler.get_num_unfinished_requests() == 2
    gated.gate.set()
    wait([scheduler.waiting_for_grammar[0].structured_output.future], timeout=10)
    output, _ = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"plain", "grammar"}
    assert output.structured_output_drafts == {"grammar": []}
    manager.shutdown()


def test_an_aborted_compiling_request_leaves_nothing(backend):
    gated = GatedFakeBackend(backend)
    manager = StructuredOutputManager(gated)
    scheduler = make_scheduler()
    scheduler.add_request(constrained_request(manager, "grammar", DIGITS, compiled=False))
    scheduler.finish_requests("grammar", RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_num_unfinished_requests() == 0 and scheduler.requests == {}
    gated.gate.set()
    manager.shutdown()


def test_the_grammar_advances_on_committed_tokens_and_ends_the_request(manager):
    """A grammar that can take nothing more ends the request without waiting for end-of-sequence."""
    scheduler = make_scheduler()
    request = constrained_request(manager, "digits", DIGITS)
    scheduler.add_request(request)
    _, outputs = step(scheduler, tok("4"))
    assert not outputs[0].finished
    _, outputs = step(scheduler, tok("2"))
    assert (outputs[0].finished, outputs[0].finish_reason, request.output_token_ids) == \
        (True, "stop", [tok("4"), tok("2")])
    open_ended = constrained_request(manager, "letters", StructuredOutputsParams(regex="[a-z]+"))
    scheduler.add_request(open_ended)
    for token_id in (tok("o"), tok("k"), EOS):
        _, outputs = step(scheduler, token_id)
    assert (outputs[0].finished, outputs[0].finish_reason, open_ended.output_token_ids) == \
        (True, "stop", [tok("o"), tok("k"), EOS])


def test_a_token_the_grammar_rejects_fails_the_request(manager):
    scheduler = make_scheduler()
    scheduler.add_request(constrained_request(manager, "digits", DIGITS))
    _, outputs = step(scheduler, tok("x"))
    assert (outputs[0].finish_reason, outputs[0].error.startswith(f"the constraint rejected token {tok('x')}")) == \
        ("error", True)
    assert scheduler.kv_cache_manager.usage == 0.0


def test_an_unexpected_compile_failure_fails_only_its_request(backend):
    broken = GatedFakeBackend(backend)
    broken.compile = lambda params: {}["no such key"]
    manager = StructuredOutputManager(broken)
    request = settled(manager.request(DIGITS))
    assert request.error == "the regex constraint failed to compile: KeyError('no such key')"
    manager.shutdown()
