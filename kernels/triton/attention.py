"""Triton: paged attention for a mixed batch of prefill chunks and decodes in one launch.

Semantics are those of kernels.attention.paged_attention_ref. A program computes one tile of
query rows for one KV head: BLOCK_M rows = BLOCK_Q query tokens x the (padded) group of query
heads that share that KV head, so every K/V tile is loaded once for the whole group. It walks
the request's context in TILE_N-token tiles through the block table with an online softmax
(fp32), stopping at the last position any of its rows may see. Programs are numbered over all
requests' query tiles; request r's tiles start at query_start_loc[r] // BLOCK_Q + r, so the grid
needs no host-side sync.
"""
import torch
import triton
import triton.language as tl

from kernels.attention import num_queries_per_kv
from kernels.layout import check_last_dim_contiguous

DECODE_BLOCK_M = 16     # the smallest tensor-core tile (rows past the group are padding)
PREFILL_BLOCK_M = 64
TILE_N = 64


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The last request whose first query tile is <= tile (binary search)."""
    low: tl.int32 = 0
    high = num_reqs
    while low < high:
        mid = (low + high) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _paged_attention_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, out_ptr, block_tables_ptr,
        query_start_loc_ptr, seq_lens_ptr, qk_scale, num_reqs, head_dim,
        stride_query_t, stride_query_h, stride_out_t, stride_out_h,
        stride_cache_n, stride_cache_b, stride_cache_h, stride_block_tables,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - query_start
    q_tile = tile - (query_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + req)

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (token < query_len) & (rows % GROUP_PAD < GROUP)
    position = context_len - query_len + token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q_offsets = (query_start + token)[:, None] * stride_query_t + head[:, None] * stride_query_h
    q = tl.load(query_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    context_end = tl.minimum(context_len, context_len - query_len + (q_tile + 1) * BLOCK_Q)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_block_tables
    for tile_start in range(0, context_end, TILE_N):
        column = tile_start + tl.arange(0, TILE_N)
        column_mask = column < context_end
        block_id = tl.load(block_table_ptr + column // BLOCK_SIZE, mask=column_mask, other=0)
        slot_offsets = (block_id.to(tl.int64) * stride_cache_n
                        + (column % BLOCK_SIZE) * stride_cache_b + kv_head * stride_cache_h)
        kv_offsets = slot_offsets[:, None] + dims[None, :]
        kv_mask = column_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(column[None, :] <= position[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_offsets = (query_start + token)[:, None] * stride_out_t + head[:, None] * stride_out_h
    tl.store(out_ptr + out_offsets + dims[None, :], out, mask=q_mask)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [T, Hq, D], caches [num_blocks, block_size, Hkv, D] -> out [T, Hq, D]."""
    check_last_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache,
                              block_tables=block_tables)
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same layout")
    group = num_queries_per_kv(query, key_cache)
    num_tokens, _, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1:3]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    group_pad = triton.next_power_of_2(group)
    # one token per request (shapes alone say so, no sync): decode-sized tiles
    block_m = max(DECODE_BLOCK_M if num_tokens == num_reqs else PREFILL_BLOCK_M, group_pad)
    num_tiles = num_tokens // (block_m // group_pad) + num_reqs
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        query, key_cache, value_cache, out, block_tables, query_start_loc, seq_lens,
        scale * 1.4426950408889634, num_reqs, head_dim,      # scale * log2(e): softmax via exp2
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_N=TILE_N,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        DOT_DTYPE=_dot_dtype(query), DOT_PRECISION=_dot_precision(query))
    return out


def _dot_precision(query: torch.Tensor) -> str:
    """fp32 in, fp32 products: Triton's default for fp32 operands on a GPU is TF32 (10-bit
    mantissas), which puts 1e-3 errors into attention and breaks fp32's exactness."""
    return "ieee" if query.dtype == torch.float32 else "tf32"


def _dot_dtype(query: torch.Tensor) -> tl.dtype:
    """Tensor-core operands in the input dtype; fp32 for bf16 on CPU, which only the Triton
    interpreter runs and whose bf16 tl.dot is wrong there."""
    if query.dtype == torch.bfloat16 and not query.is_cuda:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
            torch.float32: tl.float32}[query.dtype]
