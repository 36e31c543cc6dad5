"""The Triton kernels on a GPU and the CPU kernels at real model shapes (vLLM's attention test
shapes), bf16. The Triton cases need a CUDA GPU (marked gpu: never in CI).

Reference: the torch implementation run on fp32 copies of the same inputs.
"""
import pytest
import torch

from kernels import get_ops, rotary_cos_sin
from kernels.cpu import library as cpu_library
from tests.kernels.paged_batch import make_paged_batch

BF16_ATOL = 1.5e-2


@pytest.fixture(params=[
    "cpu",
    pytest.param("triton", marks=[pytest.mark.gpu,
                                  pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
def backend(request) -> str:
    if request.param == "cpu" and not cpu_library.available():
        pytest.skip("no C++ compiler to build the CPU kernels")
    return request.param


@pytest.fixture
def device(backend) -> str:
    return "cuda" if backend == "triton" else "cpu"


def _fp32_args(batch) -> tuple:
    return tuple(arg.float() if torch.is_tensor(arg) and arg.is_floating_point() else arg
                 for arg in batch.args())


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (5, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("query_lens,context_lens", [
    ([1, 5, 129], [1328, 18, 463]),
    ([1] * 8, [1328, 18, 463, 1, 17, 2048, 64, 300]),
])
def test_paged_attention_bf16_real_shapes(num_heads, num_kv_heads, block_size, query_lens,
                                          context_lens, backend, device):
    batch = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads,
                             block_size=block_size, head_dim=128, dtype=torch.bfloat16,
                             device=device)
    out = get_ops(backend).paged_attention(*batch.args())
    expected = get_ops("torch").paged_attention(*_fp32_args(batch))
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=1e-2)


def test_write_kv_cache_bf16_real_shapes(backend, device):
    key = torch.randn(2048, 8, 128, device=device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slot_mapping = torch.randperm(4096, device=device)[:2048]
    slot_mapping[::7] = -1
    caches = [torch.zeros(256, 16, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    get_ops(backend).write_kv_cache(key, value, *caches, slot_mapping)
    get_ops("torch").write_kv_cache(key, value, *expected, slot_mapping)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("hidden_size", [576, 4096])
def test_rms_norm_bf16_real_shapes(hidden_size, backend, device):
    x = torch.randn(300, hidden_size, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden_size, device=device, dtype=torch.bfloat16)
    out, new_residual = get_ops(backend).rms_norm(x, weight, 1e-5, residual)
    expected, expected_residual = get_ops("torch").rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected, atol=BF16_ATOL * 4, rtol=1e-2)


def test_apply_rotary_bf16_real_shapes(backend, device):
    query = torch.randn(300, 32, 128, device=device, dtype=torch.bfloat16)
    key = torch.randn(300, 8, 128, device=device, dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (300,), device=device)
    cache = rotary_cos_sin(128, 8192, 500000.0, torch.float32, device)
    out = get_ops(backend).apply_rotary(query, key, positions, cache)
    expected = get_ops("torch").apply_rotary(query, key, positions, cache)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=1e-2)


def test_silu_and_mul_bf16_real_shapes(backend, device):
    gate_up = torch.randn(300, 2 * 14336, device=device, dtype=torch.bfloat16)
    torch.testing.assert_close(get_ops(backend).silu_and_mul(gate_up), get_ops("torch").silu_and_mul(gate_up),
                               atol=BF16_ATOL, rtol=1e-2)
