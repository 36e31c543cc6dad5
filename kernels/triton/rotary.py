"""Triton: rotate-half rotary embedding of query and key (see kernels/rotary.py)."""
import torch
import triton
import triton.language as tl

from kernels.layout import check_last_dim_contiguous


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, num_heads, stride_x_t, stride_x_h, stride_out_t,
                  stride_out_h, cos, sin, half_dim, HEADS_PAD: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < half_dim)
    x_offsets = token * stride_x_t + heads * stride_x_h + dims
    x1 = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offsets + half_dim, mask=mask, other=0.0).to(tl.float32)
    out_offsets = token * stride_out_t + heads * stride_out_h + dims
    tl.store(out_ptr + out_offsets, x1 * cos - x2 * sin, mask=mask)
    tl.store(out_ptr + out_offsets + half_dim, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rotary_kernel(query_ptr, key_ptr, query_out_ptr, key_out_ptr, positions_ptr, cos_sin_ptr,
                   num_heads, num_kv_heads, half_dim,
                   stride_query_t, stride_query_h, stride_key_t, stride_key_h,
                   stride_query_out_t, stride_query_out_h, stride_key_out_t, stride_key_out_h,
                   stride_cos_sin, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + token) * stride_cos_sin
    cos = tl.load(cos_sin_row + dims, mask=dims < half_dim, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_row + half_dim + dims, mask=dims < half_dim, other=0.0).to(tl.float32)
    _rotate_heads(query_ptr, query_out_ptr, token, num_heads, stride_query_t, stride_query_h,
                  stride_query_out_t, stride_query_out_h, cos, sin, half_dim, HEADS_PAD, HALF_PAD)
    _rotate_heads(key_ptr, key_out_ptr, token, num_kv_heads, stride_key_t, stride_key_h,
                  stride_key_out_t, stride_key_out_h, cos, sin, half_dim, KV_HEADS_PAD, HALF_PAD)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hkv, D], positions [T] -> new rotated (query, key), fp32 math."""
    check_last_dim_contiguous(query=query, key=key, cos_sin_cache=cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            query, key, query_out, key_out, positions, cos_sin_cache,
            num_heads, num_kv_heads, head_dim // 2,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
            cos_sin_cache.stride(0),
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF_PAD=triton.next_power_of_2(head_dim // 2))
    return query_out, key_out
