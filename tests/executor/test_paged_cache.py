import pytest
import torch

from replica.executor.config import ModelConfig
from replica.executor.paged_cache import allocate_kv_caches

CONFIG = ModelConfig(architecture="llama", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position=64, tie_word_embeddings=True, attention_bias=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_caches_are_zeroed_writable_and_apart(dtype):
    caches = allocate_kv_caches(CONFIG, num_blocks=5, block_size=4, dtype=dtype, device=torch.device("cpu"))
    tensors = [tensor for pair in caches for tensor in pair]
    assert [(tuple(t.shape), t.dtype, t.is_contiguous()) for t in tensors] == [((5, 4, 2, 8), dtype, True)] * 6
    assert all(torch.count_nonzero(t) == 0 for t in tensors)
    tensors[0][2, 1] = 1.5
    assert [torch.count_nonzero(t).item() for t in tensors] == [16, 0, 0, 0, 0, 0]
    assert tensors[0][2, 1, 1, 7].item() == 1.5
