"""The offline LLM and EngineCore on the real default model (fp32, CPU, the default CPU kernels).

The reference for every scheduling variant is the same prompts generated one at a time: batching,
chunked prefill, prefix-cache hits and preemption must not change a single greedy token.
"""
import pytest

from replica.engine import LLM, EngineConfig, EngineCore
from replica.kv_cache import AllBlocksCleared, hash_token_blocks
from replica.request import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    ("Once upon a time, in a small village by the sea, there lived an old fisherman who every "
     "morning walked down to the harbour, mended his nets and told the children stories about"),
    "List three primary colors:",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_llm(**engine_args) -> LLM:
    return LLM(**{"dtype": "float32", "num_kv_blocks": 128, **engine_args})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def one_at_a_time(llm) -> list[list[int]]:
    return [llm.generate(prompt, GREEDY)[0].token_ids for prompt in PROMPTS]


def token_ids(outputs) -> list[list[int]]:
    return [output.token_ids for output in outputs]


def run(engine: EngineCore, request_id: str, prompt: list[int], params: SamplingParams, **kwargs) -> list:
    """Adds one request and steps the engine until nothing is left: every output of every step."""
    engine.add_request(request_id, prompt, params, **kwargs)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_greedy_output_is_the_known_continuation(llm):
    output = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))[0]
    assert output.text == " Paris.\n\n"
    assert output.finish_reason == "length"
    assert len(output.token_ids) == 4


def test_batched_equals_one_at_a_time(llm, one_at_a_time):
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == one_at_a_time


def test_identical_prompts_in_one_step_share_blocks_and_tokens(one_at_a_time):
    llm = make_llm()
    outputs = llm.generate([PROMPTS[2]] * 3, GREEDY)
    assert token_ids(outputs) == [one_at_a_time[2]] * 3
    # the second and third hit the first one's blocks while it was still computing them
    assert [output.num_cached_tokens for output in outputs] == [0, 16 * 2, 16 * 2]


def test_chunked_prefill_gives_the_same_tokens(one_at_a_time):
    llm = make_llm(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == one_at_a_time


def test_prefix_cache_hit_gives_the_same_tokens(one_at_a_time):
    llm = make_llm()
    llm.generate(PROMPTS[2], GREEDY)
    again = llm.generate(PROMPTS[2], GREEDY)[0]
    assert again.token_ids == one_at_a_time[2]
    num_prompt_tokens = len(llm.tokenizer.encode(PROMPTS[2]))
    assert again.num_cached_tokens == (num_prompt_tokens - 1) // 16 * 16 > 0
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == again.num_cached_tokens


def test_preemption_gives_the_same_tokens(one_at_a_time):
    llm = make_llm(num_kv_blocks=6, watermark=0.0)  # 5 usable blocks; together they need 7
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == one_at_a_time
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("engine_args", [{}, {"num_kv_blocks": 6, "watermark": 0.0},
                                         {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}],
                         ids=["batched", "preempted", "chunked"])
def test_async_scheduling_gives_the_same_tokens(one_at_a_time, engine_args):
    llm = make_llm(async_scheduling=True, **engine_args)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == one_at_a_time
    assert (llm.engine.stats().num_preemptions > 0) == ("num_kv_blocks" in engine_args)


def test_async_scheduling_samples_seeded_requests_as_synchronous_scheduling_does(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    assert token_ids(make_llm(async_scheduling=True).generate(PROMPTS, params)) == \
        token_ids(llm.generate(PROMPTS, params))


def test_speculative_decoding_gives_the_same_tokens(one_at_a_time):
    llm = make_llm(num_speculative_tokens=3, max_num_batched_tokens=32)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == one_at_a_time
    assert llm.engine.stats().spec_decoding.num_draft_tokens > 0


def test_seeded_sampling_is_reproducible_alone_and_batched(llm):
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=seed, ignore_eos=True)
              for seed in (1, 2)]
    batched = token_ids(llm.generate([PROMPTS[0], PROMPTS[0]], params))
    alone = [llm.generate(PROMPTS[0], p)[0].token_ids for p in params]
    assert batched == alone
    assert batched[0] != batched[1]


def test_stop_string_trims_text_and_finishes(llm):
    full = llm.generate(PROMPTS[0], GREEDY)[0]
    assert full.text.startswith(" Paris.\n\nThe answer")
    stopped = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=["\n\nThe a", "xyz"]))[0]
    assert stopped.text == " Paris."
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]


def test_token_id_prompts_equal_text_prompts(llm, one_at_a_time):
    ids = [llm.tokenizer.encode(prompt) for prompt in PROMPTS[:2]]
    assert token_ids(llm.generate(ids, GREEDY)) == one_at_a_time[:2]
    assert llm.generate(ids[0], GREEDY)[0].token_ids == one_at_a_time[0]


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0))[0]
    assert output.text == "The capital of France is Paris."
    assert output.finish_reason == "stop"  # EOS (<|im_end|>), which is not in the text
    prompt = llm.tokenizer.apply_chat_template(messages)
    assert output.prompt_token_ids == prompt
    assert llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].token_ids == output.token_ids


def test_streamed_outputs_add_up_and_carry_logprobs(llm):
    prompt = llm.tokenizer.encode(PROMPTS[0])
    outputs = run(llm.engine, "stream", prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=True))
    assert "".join(output.new_text for output in outputs) == " Paris.\n\nThe answer"
    assert [output.finished for output in outputs] == [False] * 5 + [True]
    assert all(output.num_prompt_tokens == len(prompt) and len(output.logprobs) == 1 for output in outputs)
    assert all(-20 < output.logprobs[0] <= 0 for output in outputs)


def test_greedy_tokens_head_their_top_logprobs(llm):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    for output in run(llm.engine, "top", llm.tokenizer.encode(PROMPTS[0]), params):
        (top,) = output.top_logprobs
        assert [len(top), top[0]] == [3, (output.new_token_ids[0], pytest.approx(output.logprobs[0], abs=1e-6))]
        assert [logprob for _, logprob in top] == sorted((logprob for _, logprob in top), reverse=True)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True),
    SamplingParams(max_tokens=12, temperature=0, stop=["\n\nThe a"]),  # completes after " Paris.\n\n"
])
def test_a_request_resumed_with_its_output_continues_as_if_undisturbed(llm, params):
    """Migration: a replica that has never seen the request goes on from any of its tokens, in tokens,
    logprobs, text (stop string across the boundary included) and finish reason."""
    engine = llm.engine
    prompt = llm.tokenizer.encode(PROMPTS[0])
    whole = run(engine, "whole", prompt, params)
    token_ids = [output.new_token_ids[0] for output in whole]
    for split in range(1, len(whole)):
        assert engine.scheduler.reset_prefix_cache()
        rest = run(engine, f"resumed-{split}", prompt, params, output_token_ids=token_ids[:split],
                   block_hashes=hash_token_blocks(prompt + token_ids[:split], 16))
        assert [output.new_token_ids[0] for output in rest] == token_ids[split:]
        assert [output.new_text for output in rest] == [output.new_text for output in whole[split:]]
        assert rest[-1].finish_reason == whole[-1].finish_reason
        assert all(output.num_prompt_tokens == len(prompt) for output in rest)
        if params.logprobs:
            assert [output.logprobs[0] for output in rest] == pytest.approx(
                [output.logprobs[0] for output in whole[split:]], abs=1e-4)


def test_a_request_resumed_in_bf16_runs_to_its_end():
    """bf16 need not recompute prompt + output as decoding made them, so the tokens after a move may
    differ from an undisturbed run's; the count, the logprobs and the finish reason may not."""
    llm = make_llm(dtype="bfloat16")
    prompt = llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    head = [output.new_token_ids[0] for output in run(llm.engine, "whole", prompt, params)[:3]]
    rest = run(llm.engine, "resumed", prompt, params, output_token_ids=head,
               block_hashes=hash_token_blocks(prompt + head, 16))
    assert [(len(output.new_token_ids), len(output.logprobs)) for output in rest] == [(1, 1)] * 5
    assert [output.finish_reason for output in rest] == [None] * 4 + ["length"]
    assert all(output.num_prompt_tokens == len(prompt) for output in rest)


@pytest.mark.parametrize("prompt, error", [
    ([], "empty"),
    ([1, 2, 49152], "token ids"),
    ([5] * 4096, "max_model_len"),
])
def test_bad_prompts_raise_and_queue_nothing(llm, prompt, error):
    with pytest.raises(ValueError, match=error):
        llm.engine.add_request("bad", prompt, GREEDY)
    assert not llm.engine.has_unfinished()


def test_more_block_hashes_than_full_prompt_blocks_raise(llm):
    with pytest.raises(ValueError, match="2 block hashes for 20 tokens"):
        llm.engine.add_request("bad", [5] * 20, GREEDY, block_hashes=[bytes(16)] * 2)
    assert not llm.engine.has_unfinished()


def test_duplicate_id_raises_and_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("dup", [4, 5], GREEDY)
    engine.step()
    assert engine.stats().kv_usage > 0
    engine.abort(["dup", "unknown"])
    assert not engine.has_unfinished()
    assert engine.stats().kv_usage == 0


def test_async_scheduling_abort_while_a_step_executes_drops_its_output_and_frees_everything(one_at_a_time):
    engine = make_llm(async_scheduling=True).engine
    prompts = [engine.tokenizer.encode(prompt) for prompt in PROMPTS[:2]]
    engine.add_request("kept", prompts[0], GREEDY)
    engine.add_request("aborted", prompts[1], GREEDY)
    assert engine.step() == []  # the first step's outputs come with the second's
    outputs = engine.step()
    assert [output.request_id for output in outputs] == ["kept", "aborted"]
    engine.abort(["aborted"])  # while the step scheduled for it executes
    while engine.has_unfinished():
        outputs += engine.step()
    assert {output.request_id for output in outputs[2:]} == {"kept"}
    assert [token for output in outputs if output.request_id == "kept" for token in output.new_token_ids] == \
        one_at_a_time[0]
    stats = engine.stats()
    assert (stats.kv_usage, stats.num_running, stats.num_waiting) == (0, 0, 0)


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError):
        EngineConfig(dtype="float64")
    with pytest.raises(ValueError):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="context length"):
        EngineCore(EngineConfig(max_model_len=10**6, dtype="float32", num_kv_blocks=8))


def test_flat_engine_args_fill_the_nested_sections():
    config = EngineConfig(block_size=32, reserve_full_sequence=False, max_model_len=64)
    assert (config.cache.block_size, config.scheduler.reserve_full_sequence, config.max_model_len) == (32, False, 64)
    assert [EngineConfig(**flag).async_scheduling for flag in ({}, {"async_scheduling": True})] == [None, True]
    assert EngineConfig(async_scheduling=False).scheduler.async_scheduling is False
    with pytest.raises(ValueError, match="not on its scheduler"):
        EngineConfig(scheduler={"max_model_len": 64})


def test_continuum_pins_a_programs_turn_for_the_next_without_changing_a_token(llm):
    engine = make_llm(policy="continuum").engine
    first = llm.generate(PROMPTS[2], GREEDY)[0]
    outputs = run(engine, "p/1", first.prompt_token_ids, GREEDY, session_id="p")
    assert [t for output in outputs for t in output.new_token_ids] == first.token_ids
    assert engine.stats().kv_usage > 0 and engine.stats().pins.pinned == 1  # nothing runs, the pin holds
    history = first.prompt_token_ids + first.token_ids + [11, 12, 13]
    outputs = run(engine, "p/2", history, GREEDY, session_id="p", last_turn=True)
    assert [t for output in outputs for t in output.new_token_ids] == llm.generate(history, GREEDY)[0].token_ids
    computed = len(first.prompt_token_ids) + len(first.token_ids) - 1  # the last token was never fed back
    assert outputs[-1].num_cached_tokens == computed // 16 * 16
    assert engine.stats().pins.hits == 1 and engine.stats().kv_usage == 0  # the last turn ends the pin


@pytest.fixture
def two_engines_on_one_pool(tmp_path) -> tuple[LLM, LLM]:
    pool = {"host_pool_gib": 0.01, "host_pool_path": str(tmp_path / "pool")}  # 14 blocks of 16 tokens
    return make_llm(**pool), make_llm(**pool)


def test_a_prefix_another_engine_computed_is_loaded_from_the_node_pool_with_the_same_tokens(
        llm, two_engines_on_one_pool):
    prompt = llm.tokenizer.encode(PROMPTS[2] * 4)
    expected = llm.generate(prompt, GREEDY)[0].token_ids
    first, second = two_engines_on_one_pool
    assert first.generate(prompt, GREEDY)[0].token_ids == expected
    [cleared, in_pool] = second.engine.take_kv_events()  # the pool's blocks, as the second engine sees them
    assert cleared == AllBlocksCleared("host") and in_pool.medium == "host"
    assert set(hash_token_blocks(prompt, 16)) <= set(in_pool.block_hashes)
    [output] = second.generate(prompt, GREEDY)
    num_hit_tokens = (len(prompt) - 1) // 16 * 16
    assert (output.token_ids, output.num_cached_tokens) == (expected, num_hit_tokens)
    assert second.engine.stats().host_pool_hits == num_hit_tokens


def test_blocks_that_fail_their_check_mid_load_are_computed_instead(llm, two_engines_on_one_pool, monkeypatch):
    prompt = llm.tokenizer.encode(PROMPTS[2] * 4)
    first, second = two_engines_on_one_pool
    first.generate(prompt, GREEDY)
    pool = second.engine.runner.host_copies.pool
    load = pool.load
    monkeypatch.setattr(pool, "load", lambda *args: min(load(*args), 3))  # the fourth block changed meanwhile
    [output] = second.generate(prompt, GREEDY)
    assert (output.token_ids, output.num_cached_tokens) == (llm.generate(prompt, GREEDY)[0].token_ids, 48)
    assert second.engine.stats().host_pool_hits == 48
