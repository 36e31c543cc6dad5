"""The pure-torch kernels (the CPU production path) against explicit dense computations."""
import subprocess
import sys

import pytest
import torch

from kernels import (apply_rotary_ref, get_ops, paged_attention_ref, rms_norm_ref, rotary_cos_sin,
                     write_kv_cache_ref)
from tests.kernels.paged_batch import make_paged_batch

ATTENTION_CASES = {
    # name: (query_lens, context_lens); a context longer than its query is a cached prefix
    "prefill": ([9, 24], [9, 24]),
    "prefix_cached_chunks": ([5, 16, 3], [21, 40, 3]),
    "decode_only": ([1, 1, 1, 1], [1, 17, 40, 32]),
    "mixed": ([1, 7, 1, 33], [50, 7, 16, 70]),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_ref_matches_dense_float64(case, num_heads, num_kv_heads, block_size):
    query_lens, context_lens = ATTENTION_CASES[case]
    batch = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads,
                             block_size=block_size)
    out = paged_attention_ref(*batch.args())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), batch.dense_attention(), atol=2e-6, rtol=0)


def test_paged_attention_ref_bf16_stays_close_to_float64():
    batch = make_paged_batch([5, 1, 12], [18, 30, 12], 8, 2, dtype=torch.bfloat16, head_dim=64)
    out = paged_attention_ref(*batch.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), batch.dense_attention(), atol=2e-2, rtol=0)


def test_paged_attention_ref_is_causal_from_each_query_position():
    # zero keys: every visible position gets the same weight, so query i (at position
    # ctx - q_len + i) returns the mean of values 0..position
    batch = make_paged_batch([3, 1], [5, 4], 2, 1, block_size=16)
    batch.key_cache.zero_()
    batch.value_cache.zero_()
    table = batch.block_tables[0, 0]
    batch.value_cache[table, :5, 0, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    out = paged_attention_ref(*batch.args())
    assert out[:3, :, 0].tolist() == [[2.0, 2.0], [2.5, 2.5], [3.0, 3.0]]
    assert out[3].abs().max().item() == 0.0


def test_write_kv_cache_ref_places_tokens_by_slot_and_skips_negative_slots():
    key_cache = torch.zeros(3, 4, 2, 2)
    value_cache = torch.zeros(3, 4, 2, 2)
    key = torch.arange(1, 25, dtype=torch.float32).view(6, 2, 2)
    slot_mapping = torch.tensor([5, -1, 11, 0, -1, 4])
    write_kv_cache_ref(key, -key, key_cache, value_cache, slot_mapping)
    flat_keys = key_cache.view(12, 2, 2)
    for token, slot in [(0, 5), (2, 11), (3, 0), (5, 4)]:
        assert torch.equal(flat_keys[slot], key[token])
    assert torch.equal(value_cache, -key_cache)
    assert flat_keys.abs().sum().item() == key[[0, 2, 3, 5]].sum().item()


def test_rms_norm_ref_values():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    weight = torch.tensor([1.0, 2.0])
    out = rms_norm_ref(x, weight, eps=0.0)
    rms = (12.5 ** 0.5)
    torch.testing.assert_close(out, torch.tensor([[3 / rms, 8 / rms], [1.0, -2.0]]))


def test_rms_norm_ref_with_residual_returns_norm_of_sum_and_the_sum():
    x = torch.tensor([[1.0, 2.0]])
    residual = torch.tensor([[2.0, 2.0]])
    out, new_residual = rms_norm_ref(x, torch.ones(2), 0.0, residual)
    assert new_residual.tolist() == [[3.0, 4.0]]
    rms = 12.5 ** 0.5
    torch.testing.assert_close(out, torch.tensor([[3 / rms, 4 / rms]]))
    assert residual.tolist() == [[2.0, 2.0]]


def test_rms_norm_ref_rounds_like_hf_llama_in_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    hf_norm = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        hf_norm.weight.copy_(torch.randn(64))
        assert torch.equal(rms_norm_ref(x, hf_norm.weight, 1e-5), hf_norm(x))


def test_rotary_cos_sin_layout():
    cache = rotary_cos_sin(4, 3, theta=100.0)
    # inv_freq = [1, 1/10]; row p = [cos(p), cos(p/10), sin(p), sin(p/10)]
    expected = torch.tensor([[torch.cos(torch.tensor(p * f)) for f in (1.0, 0.1)]
                             + [torch.sin(torch.tensor(p * f)) for f in (1.0, 0.1)]
                             for p in range(3)])
    torch.testing.assert_close(cache, expected)


def test_apply_rotary_ref_is_a_complex_rotation_of_half_pairs():
    head_dim = 8
    cache = rotary_cos_sin(head_dim, 32, theta=10000.0)
    query, key = torch.randn(5, 3, head_dim), torch.randn(5, 1, head_dim)
    positions = torch.tensor([0, 1, 7, 31, 7])
    rotated_query, rotated_key = apply_rotary_ref(query, key, positions, cache)

    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2) / head_dim)
    phase = torch.polar(torch.ones(5, head_dim // 2), positions[:, None] * inv_freq)[:, None]
    for x, rotated in [(query, rotated_query), (key, rotated_key)]:
        pairs = torch.complex(x[..., :head_dim // 2], x[..., head_dim // 2:]) * phase
        torch.testing.assert_close(rotated, torch.cat([pairs.real, pairs.imag], dim=-1))
    assert torch.equal(rotated_query[0], query[0])


def test_get_ops_torch_and_unknown_backend():
    ops = get_ops("torch")
    assert (ops.write_kv_cache, ops.paged_attention, ops.rms_norm, ops.apply_rotary) == (
        write_kv_cache_ref, paged_attention_ref, rms_norm_ref, apply_rotary_ref)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_ops("cuda")


def test_kernels_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import kernels\n"
            "ops = kernels.get_ops('torch')\n"
            "try:\n    kernels.get_ops('triton')\nexcept ImportError:\n    print('no triton')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout == "no triton\n"
