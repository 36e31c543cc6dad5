"""Speculative decoding end to end on a tiny random Llama: greedy tokens identical to transformers'
argmax, speculation on or off, batched, chunked with preemption, and from the prefix cache."""
import pytest
import torch

from replica.engine import LLM
from replica.request import SamplingParams
from tests.executor.test_hf_directory import SHAPE, save_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = ["abcabcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "hello world"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Smaller weights than test_hf_directory's: its greedy continuations fall into loops now and then,
    so some drafts are accepted and some rejected."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPE, "initializer_range": 0.1}, tie_word_embeddings=False)
    return save_checkpoint(transformers.LlamaForCausalLM(config).eval(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    return [LLM(str(llama[0]), dtype="float32", num_kv_blocks=8).tokenizer.encode(text) for text in PROMPTS]


@pytest.fixture(scope="module")
def reference(llama, prompts) -> list[list[int]]:
    """transformers' greedy tokens, one at a time."""
    _, hf_model = llama
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            token_ids = list(prompt)
            for _ in range(GREEDY.max_tokens):
                token_ids.append(int(hf_model(torch.tensor([token_ids])).logits[0, -1].argmax()))
            outputs.append(token_ids[len(prompt):])
    return outputs


def make_llm(llama, num_speculative_tokens: int, **engine_args) -> LLM:
    return LLM(str(llama[0]), dtype="float32", num_speculative_tokens=num_speculative_tokens,
               **{"num_kv_blocks": 32, **engine_args})


@pytest.mark.parametrize("num_speculative_tokens", [0, 1, 3])
def test_greedy_tokens_match_transformers_with_and_without_speculation(llama, prompts, reference,
                                                                        num_speculative_tokens):
    llm = make_llm(llama, num_speculative_tokens)
    assert [output.token_ids for output in llm.generate(prompts, GREEDY)] == reference
    stats = llm.engine.stats().spec_decoding
    assert (stats.num_accepted_tokens > 0) == (num_speculative_tokens > 0)
    assert len(stats.num_accepted_tokens_per_pos) == num_speculative_tokens


def test_speculation_chunked_and_preempted_keeps_the_tokens(llama, prompts, reference):
    # 6 usable blocks of 16 for sequences that grow to 2-5 blocks; prefills in chunks of 8 tokens
    llm = make_llm(llama, 3, num_kv_blocks=7, max_num_batched_tokens=8, reserve_full_sequence=False)
    assert [output.token_ids for output in llm.generate(prompts, GREEDY)] == reference
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decoding.num_accepted_tokens > 0


def test_speculation_from_the_prefix_cache_keeps_the_tokens(llama, prompts, reference):
    llm = make_llm(llama, 3)
    llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [output.token_ids for output in again] == reference
    assert [output.num_cached_tokens for output in again] == [16, 32, 0]  # prompts of 18, 42 and 11 tokens


def test_logprobs_come_one_per_token_as_without_speculation(llama, prompts):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    plain, speculative = (make_llm(llama, k).generate(prompts, params) for k in (0, 3))
    for a, b in zip(plain, speculative):
        assert a.token_ids == b.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


def test_sampling_with_speculation_stops_at_max_tokens(llama, prompts):
    """The last prompt holds nearly every byte token, so the n-gram lookup finds almost anything sampled:
    drafts are proposed whatever random stream the device draws."""
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    llm = make_llm(llama, 3)
    outputs = llm.generate([*prompts, list(range(240))], params)
    assert [len(output.token_ids) for output in outputs] == [10] * 4
    assert llm.engine.stats().spec_decoding.num_draft_tokens > 0


def test_drafts_never_reach_past_max_tokens_or_max_model_len(llama, prompts):
    engine = make_llm(llama, 3, max_model_len=48).engine  # the second prompt (42 tokens) meets max_model_len
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    num_drafted = 0
    while engine.has_unfinished():
        engine.step()
        for request in engine.scheduler.running:
            num_drafted += len(request.spec_token_ids)
            # the step verifying them emits one more token than it accepts
            assert request.num_output_tokens + len(request.spec_token_ids) < request.max_tokens
            assert request.num_tokens + len(request.spec_token_ids) < engine.max_model_len
    assert num_drafted > 0
