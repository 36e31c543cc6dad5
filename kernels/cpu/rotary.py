"""CPU: rotate-half rotary embedding of query and key (csrc/rotary.cpp)."""
import torch

from kernels.cpu.library import load, operand_dtype_code
from kernels.layout import check_on_cpu, dense_like


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hkv, D], positions [T] -> new rotated (query, key), fp32 math."""
    code = operand_dtype_code({"query": query, "key": key})
    check_on_cpu(positions=positions, cos_sin_cache=cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    positions = positions.to(torch.int64).contiguous()
    cos_sin_cache = cos_sin_cache.to(torch.float32).contiguous()
    query_out = dense_like(query)
    key_out = dense_like(key)
    load().apply_rotary(
        dtype=code, query_out=query_out, key_out=key_out, query=query, key=key, positions=positions,
        cos_sin_cache=cos_sin_cache, num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=key.shape[1],
        head_dim=head_dim, stride_query_token=query.stride(0), stride_query_head=query.stride(1),
        stride_key_token=key.stride(0), stride_key_head=key.stride(1))
    return query_out, key_out
