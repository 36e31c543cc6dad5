"""Triton: scatter new tokens' K/V into the paged cache (see kernels/cache_write.py)."""
import torch
import triton
import triton.language as tl

from kernels.layout import check_last_dim_contiguous


@triton.jit
def _write_kv_cache_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                           num_kv_heads, head_dim, block_size,
                           stride_key_t, stride_key_h, stride_value_t, stride_value_h,
                           stride_cache_n, stride_cache_b, stride_cache_h,
                           HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offsets = ((slot // block_size) * stride_cache_n + (slot % block_size) * stride_cache_b
                     + heads * stride_cache_h + dims)
    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> key_cache/value_cache [num_blocks, block_size, Hkv, D], in place."""
    check_last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same layout")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.to(torch.int64),
        num_kv_heads, head_dim, key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim))
