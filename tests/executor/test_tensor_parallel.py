"""Tensor parallelism on CPU: two gloo ranks in processes of their own give the greedy tokens of one
process (fp32), batched, chunked, preempted and from the prefix cache; a model that does not split is
refused by name; a rank that dies fails the engine instead of hanging it."""
import os
import signal

import pytest
import torch

from replica.engine import LLM, EngineConfig, EngineCore
from replica.executor.config import ModelConfig
from replica.executor.parallel import HeadShard, TensorParallel, check_divisible, shard_heads, vocab_slice
from replica.executor.worker import WorkerLost
from replica.request import SamplingParams
from tests.executor.helpers import assert_tight_runs_give
from tests.executor.test_hf_directory import PROMPTS, SHAPE, save_checkpoint
from tests.test_engine import PROMPTS as ENGINE_PROMPTS

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ON_CPU = {"dtype": "float32", "device": "cpu"}  # gloo, also where a GPU is: one rank would not have one of its own
# 4 query heads over 2 KV heads (one each per rank); and over 1 KV head (replicated), a tied LM head, q/k/v
# biases and a vocabulary of 259 (the second rank's slice padded)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False)),
    "qwen2_one_kv_head": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **{**SHAPE, "num_key_value_heads": 1, "vocab_size": 259}, tie_word_embeddings=True)),
}


def model_config(num_heads: int, num_kv_heads: int, intermediate_size: int = 96) -> ModelConfig:
    return ModelConfig("llama", vocab_size=258, hidden_size=64, intermediate_size=intermediate_size, num_layers=1,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, rope_theta=1e4,
                       rms_norm_eps=1e-6, max_position=256, tie_word_embeddings=False)


def test_heads_split_across_ranks_and_kv_heads_replicate_when_fewer():
    assert [shard_heads(model_config(8, 4), TensorParallel(rank, 2)) for rank in (0, 1)] == [
        HeadShard(4, 2, 0, 0), HeadShard(4, 2, 4, 2)]
    # 2 KV heads on 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    assert [shard_heads(model_config(8, 2), TensorParallel(rank, 4)).kv_start for rank in range(4)] == [0, 0, 1, 1]
    assert [vocab_slice(259, TensorParallel(rank, 2)) for rank in (0, 1)] == [(0, 130), (130, 130)]


@pytest.mark.parametrize("num_heads, num_kv_heads, intermediate_size, message", [
    (9, 3, 96, "does not divide the model's 9 query heads"),  # the default model, SmolLM2-135M, on 2 ranks
    (12, 3, 96, "neither divides the model's 3 KV heads"),
    (4, 2, 95, "does not divide intermediate_size 95"),
])
def test_models_that_do_not_split_are_refused_by_name(num_heads, num_kv_heads, intermediate_size, message):
    with pytest.raises(ValueError, match=message):
        check_divisible(model_config(num_heads, num_kv_heads, intermediate_size), 2)


@pytest.mark.slow
def test_the_default_model_is_refused_on_two_ranks():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's 9 query heads "
                                         r"\(3 KV heads\)"):
        EngineCore(EngineConfig(tensor_parallel_size=2, dtype="float32", num_kv_blocks=8))


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    return save_checkpoint(MODELS[request.param]().eval(), tmp_path_factory.mktemp(request.param))[0]


def tight_llm(model_dir, tensor_parallel_size: int) -> LLM:
    """6 usable blocks of 16 for sequences that grow to 2, 3 and 4 blocks; prefills in chunks of 8 tokens."""
    return LLM(str(model_dir), **ON_CPU, num_kv_blocks=7, max_num_batched_tokens=8,
               reserve_full_sequence=False, tensor_parallel_size=tensor_parallel_size)


@pytest.fixture(scope="module")
def two_ranks(model_dir):
    llm = tight_llm(model_dir, 2)
    yield llm
    llm.engine.shutdown()


@pytest.mark.slow
def test_two_ranks_give_one_process_tokens_batched_chunked_preempted_and_cached(model_dir, two_ranks):
    one = LLM(str(model_dir), **ON_CPU, num_kv_blocks=32)
    prompts = [one.tokenizer.encode(text) for text in PROMPTS]
    expected = [output.token_ids for output in one.generate(prompts, GREEDY)]
    assert_tight_runs_give(tight_llm(model_dir, 1), prompts, GREEDY, expected)

    assert_tight_runs_give(two_ranks, prompts, GREEDY, expected)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"async_scheduling": True}, {"num_speculative_tokens": 3}])
def test_two_ranks_schedule_asynchronously_and_verify_drafts(tmp_path, options):
    """Async scheduling (the default on CUDA) and speculative decoding, whose accepted counts the ranks share."""
    torch.manual_seed(0)
    model_dir = save_checkpoint(MODELS["llama"]().eval(), tmp_path)[0]
    one = LLM(str(model_dir), **ON_CPU, num_kv_blocks=32)
    prompts = [one.tokenizer.encode(text) for text in PROMPTS]
    expected = [output.token_ids for output in one.generate(prompts, GREEDY)]
    two = LLM(str(model_dir), **ON_CPU, num_kv_blocks=32, max_num_batched_tokens=16, tensor_parallel_size=2,
              **options)
    try:
        assert [output.token_ids for output in two.generate(prompts, GREEDY)] == expected
    finally:
        two.engine.shutdown()


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_engine_instead_of_hanging(two_ranks):
    """Runs after the equality test on the same engine, whose ranks it kills."""
    processes = two_ranks.engine.runner._processes
    os.kill(processes[1].pid, signal.SIGKILL)
    processes[1].join()
    with pytest.raises(WorkerLost, match=r"\{1: -9\}"):
        two_ranks.generate(PROMPTS[0], GREEDY)
    with pytest.raises(WorkerLost):
        two_ranks.engine.check_health()


@pytest.mark.slow
def test_the_default_model_splits_over_three_ranks():
    """SmolLM2-135M's 9 query heads and 3 KV heads: 3 and 1 on each rank, with one process's greedy tokens."""
    one = LLM(**ON_CPU, num_kv_blocks=64)
    expected = [output.token_ids for output in one.generate(ENGINE_PROMPTS, GREEDY)]
    # 4 usable blocks of 16 for sequences of 1, 1, 3 and 1 blocks; prefills in chunks of 8 tokens
    three = LLM(**ON_CPU, num_kv_blocks=5, max_num_batched_tokens=8, reserve_full_sequence=False,
                tensor_parallel_size=3)
    try:
        assert [output.token_ids for output in three.generate(ENGINE_PROMPTS, GREEDY)] == expected
        assert three.engine.stats().num_preemptions > 0
        again = three.generate(ENGINE_PROMPTS, GREEDY)
        assert [output.token_ids for output in again] == expected
        assert again[2].num_cached_tokens > 0  # its 37-token prompt's full blocks, those not evicted since
    finally:
        three.engine.shutdown()
