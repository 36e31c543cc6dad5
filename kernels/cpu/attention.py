"""CPU: paged attention for a mixed batch of prefill chunks and decodes (csrc/attention.cpp)."""
import torch

from kernels.attention import num_queries_per_kv
from kernels.cpu.library import HEAD_DIMS, load, operand_dtype_code
from kernels.layout import check_on_cpu, dense_like


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [T, Hq, D], caches [num_blocks, block_size, Hkv, D] -> out [T, Hq, D]."""
    args = kernel_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    load().paged_attention(**args)
    return args["out"]


def kernel_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, scale: float) -> dict:
    """paged_attention's operands, checked, as the C kernel's arguments: its output tensor (out) among them."""
    code = operand_dtype_code({"query": query, "key_cache": key_cache, "value_cache": value_cache})
    check_on_cpu(block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens)
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same layout")
    num_queries_per_kv(query, key_cache)
    head_dim = query.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the CPU attention kernel takes head_dim in {HEAD_DIMS}, got {head_dim}")
    block_tables, query_start_loc, seq_lens = (
        tensor.to(torch.int32).contiguous() for tensor in (block_tables, query_start_loc, seq_lens))
    out = dense_like(query)
    return dict(
        dtype=code, out=out, query=query, key_cache=key_cache,
        value_cache=value_cache, block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens,
        num_reqs=seq_lens.shape[0], num_heads=query.shape[1], num_kv_heads=key_cache.shape[2], head_dim=head_dim,
        block_size=key_cache.shape[1], stride_query_token=query.stride(0), stride_query_head=query.stride(1),
        stride_out_token=out.stride(0), stride_out_head=out.stride(1), stride_cache_block=key_cache.stride(0),
        stride_cache_slot=key_cache.stride(1), stride_cache_head=key_cache.stride(2),
        stride_block_table=block_tables.stride(0), scale=scale)
