import ctypes
import mmap
import platform

import pytest
import torch

from replica.executor.config import ModelConfig
from replica.executor.paged_cache import allocate_kv_caches, fault_in_background

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


def resident_pages(tensor: torch.Tensor) -> int:
    num_pages = -(-tensor.numel() * tensor.element_size() // mmap.PAGESIZE)
    pages = (ctypes.c_ubyte * num_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(tensor.data_ptr(), tensor.numel() * tensor.element_size(), pages) == 0
    return sum(page & 1 for page in pages)


@pytest.mark.skipif(platform.system() != "Linux" or tuple(map(int, platform.release().split(".")[:2])) < (5, 14),
                    reason="MADV_POPULATE_WRITE is Linux 5.14's")
def test_cpu_caches_fault_their_pages_in_on_a_thread_of_their_own_and_stay_zeroed():
    caches = allocate_kv_caches(CONFIG, num_blocks=1024, block_size=4, dtype=torch.float32,
                                device=torch.device("cpu"))
    tensors = [tensor for pair in caches for tensor in pair]
    num_pages = 1024 * 4 * 2 * 8 * 4 // mmap.PAGESIZE
    assert [resident_pages(tensor) for tensor in tensors] == [0] * 6  # nothing touched yet
    fault_in_background(caches).join(timeout=60)
    assert [resident_pages(tensor) for tensor in tensors] == [num_pages] * 6
    assert all(torch.count_nonzero(tensor) == 0 for tensor in tensors)
