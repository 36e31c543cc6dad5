"""Decode steps through CUDA graphs: the batch sizes captured, and (on a GPU) the same tokens as
launching every kernel eagerly, for batches that fill a graph and batches padded up to one."""
import pytest
import torch

from replica.engine import LLM
from replica.executor.cuda_graphs import capture_sizes
from replica.request import SamplingParams
from tests.executor.test_hf_directory import PROMPTS, llama_dir  # noqa: F401 (a fixture)


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(256)[-4:] == [208, 224, 240, 256] and len(capture_sizes(256)) == 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_prompts", [1, 3, 16, 17])
def test_decode_graphs_give_the_eager_tokens(llama_dir, num_prompts):
    prompts = [PROMPTS[index % len(PROMPTS)] + " " * (index // len(PROMPTS)) for index in range(num_prompts)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for enforce_eager in (True, False):
        llm = LLM(str(llama_dir), dtype="float32", device="cuda", num_kv_blocks=64, max_num_seqs=32,
                  enforce_eager=enforce_eager)
        assert (llm.engine.runner.decode_graphs is None) == enforce_eager
        outputs[enforce_eager] = [output.token_ids for output in llm.generate(prompts, params)]
    assert outputs[False] == outputs[True]
