"""Each Triton and CPU (C++) kernel against its torch reference at small shapes.

Without a GPU the Triton kernels run in the Triton interpreter on CPU tensors (conftest.py), which
is slow: keep shapes small. Tolerances: fp32 2e-6 (same math, different summation order);
fp16/bf16 one or two units in the last place of the output's magnitude.
"""
import dataclasses

import pytest
import torch

from kernels import KernelOps, get_ops, rotary_cos_sin
from kernels.cpu import library as cpu_library
from tests.kernels.paged_batch import make_paged_batch

ATTENTION_CASES = {
    # name: (query_lens, context_lens, num_heads, num_kv_heads, block_size)
    "prefill_chunks_gqa4": ([20, 3], [20, 35], 8, 2, 16),
    "mixed_gqa3": ([1, 7, 1, 18], [50, 7, 16, 40], 6, 2, 32),
    "mixed_mha_two_query_tiles": ([70, 1, 5], [100, 33, 5], 2, 2, 16),
    "decode_only_gqa1": ([1, 1, 1], [1, 17, 64], 2, 2, 16),
    "decode_only_gqa4": ([1, 1, 1, 1], [9, 32, 33, 80], 8, 2, 32),
    "one_kv_head_group5": ([4, 1], [36, 20], 5, 1, 16),
}
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
torch_ops = get_ops("torch")


@pytest.fixture(params=["triton", "cpu"])
def backend(request) -> str:
    if request.param == "triton":
        pytest.importorskip("triton")
    elif not cpu_library.available():
        pytest.skip("no C++ compiler to build the CPU kernels")
    return request.param


@pytest.fixture
def ops(backend) -> KernelOps:
    return get_ops(backend)


@pytest.fixture
def device(backend) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_paged_attention_matches_reference_fp32(case, ops, device):
    query_lens, context_lens, num_heads, num_kv_heads, block_size = ATTENTION_CASES[case]
    batch = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads,
                             block_size=block_size, head_dim=32, device=device)
    torch.testing.assert_close(ops.paged_attention(*batch.args()),
                               torch_ops.paged_attention(*batch.args()), atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_16bit_matches_float64(dtype, ops, device):
    batch = make_paged_batch([5, 1, 20], [18, 30, 20], 6, 2, block_size=16, head_dim=32,
                             dtype=dtype, device=device)
    out = ops.paged_attention(*batch.args())
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), batch.dense_attention(), atol=TOLERANCE[dtype], rtol=0)


def test_paged_attention_reads_query_through_strides(ops, device):
    batch = make_paged_batch([6, 1], [6, 21], 4, 2, head_dim=32, device=device)
    # the query as the model produces it: a view into a fused [T, (Hq + 2 Hkv) * D] projection
    fused = torch.randn(7, 8 * 32, device=device)
    fused[:, :4 * 32] = batch.query.flatten(1)
    batch.query = fused[:, :4 * 32].view(7, 4, 32)
    torch.testing.assert_close(ops.paged_attention(*batch.args()),
                               torch_ops.paged_attention(*batch.args()), atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_cache_matches_reference(dtype, ops, device):
    key = torch.randn(7, 3, 24, device=device).to(dtype)
    value = torch.randn(7, 3, 24, device=device).to(dtype)
    slot_mapping = torch.tensor([5, -1, 40, 63, 0, 17, -1], device=device)
    caches = [torch.randn(4, 16, 3, 24, device=device).to(dtype) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    ops.write_kv_cache(key, value, *caches, slot_mapping)
    torch_ops.write_kv_cache(key, value, *expected, slot_mapping)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual, ops, device):
    x = torch.randn(5, 96, device=device).to(dtype)
    weight = torch.randn(96, device=device).to(dtype)
    residual = torch.randn(5, 96, device=device).to(dtype) if with_residual else None
    out = ops.rms_norm(x, weight, 1e-5, residual)
    expected = torch_ops.rms_norm(x, weight, 1e-5, residual)
    atol = TOLERANCE[dtype] * 4        # |out| reaches ~4 here
    if with_residual:
        torch.testing.assert_close(out[0], expected[0], atol=atol, rtol=0)
        assert torch.equal(out[1], expected[1])
    else:
        torch.testing.assert_close(out, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_rotary_matches_reference(dtype, ops, device):
    # query and key as views into a fused projection, as the model produces them
    fused = torch.randn(6, (6 + 2 * 2) * 32, device=device).to(dtype)
    query = fused[:, :6 * 32].view(6, 6, 32)
    key = fused[:, 6 * 32:8 * 32].view(6, 2, 32)
    positions = torch.tensor([0, 3, 4, 5, 99, 17], device=device)
    cache = rotary_cos_sin(32, 100, 10000.0, torch.float32, device)
    out = ops.apply_rotary(query, key, positions, cache)
    expected = torch_ops.apply_rotary(query, key, positions, cache)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("size", [48, 37])  # 37: a tail shorter than one vector
def test_silu_and_mul_matches_reference(dtype, size, ops, device):
    # a view with a row stride wider than 2 * size, as a slice of a wider projection would be
    gate_up = (torch.randn(5, 2 * size + 6, device=device) * 4).to(dtype)[:, :2 * size]
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (5, size)
    torch.testing.assert_close(out, torch_ops.silu_and_mul(gate_up), atol=TOLERANCE[dtype] * 8, rtol=0)


def test_silu_and_mul_rejects_an_odd_width(ops, device):
    with pytest.raises(ValueError, match="even last dimension"):
        ops.silu_and_mul(torch.randn(2, 7, device=device))


def test_the_kernels_compared_are_the_backends_not_the_references(backend, ops):
    assert ops.backend == backend
    kernels = [getattr(ops, field.name) for field in dataclasses.fields(ops) if field.name != "backend"]
    assert {kernel.__module__.rsplit(".", 1)[0] for kernel in kernels} == {f"kernels.{backend}"}


@pytest.mark.parametrize("vocab_size, num_words", [(100, 4), (70, 2), (33, 1)])
def test_apply_token_bitmask_matches_reference(vocab_size, num_words, ops, device):
    """Words of all ones, all zeros and mixed; a mask narrower than the vocabulary disallows the tokens past it;
    rows not listed keep their logits."""
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(5, vocab_size, generator=generator).to(device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, num_words), dtype=torch.int32, generator=generator)
    bitmask[0, 0], bitmask[1, -1] = -1, 0
    bitmask = bitmask.to(device)
    logit_rows = torch.tensor([4, 0, 2], device=device)
    expected = logits.clone()
    torch_ops.apply_token_bitmask(expected, bitmask, logit_rows)
    ops.apply_token_bitmask(logits, bitmask, logit_rows)
    assert torch.equal(logits, expected)
    assert torch.isfinite(expected[[1, 3]]).all()
    row_0 = [int(bitmask[1, token // 32]) >> (token % 32) & 1 if token < 32 * num_words else 0
             for token in range(vocab_size)]
    assert torch.isinf(expected[0]).tolist() == [not bit for bit in row_0]
