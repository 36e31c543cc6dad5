"""CPU: scatter new tokens' K/V into the paged cache (csrc/cache_write.cpp)."""
import torch

from kernels.cpu.library import load, operand_dtype_code
from kernels.layout import check_on_cpu


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> key_cache/value_cache [num_blocks, block_size, Hkv, D], in place."""
    operand_dtype_code({"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache})
    check_on_cpu(slot_mapping=slot_mapping)
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same layout")
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    size = key.element_size()
    load().write_kv_cache(  # strides in bytes
        key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
        num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_bytes=head_dim * size, block_size=key_cache.shape[1],
        stride_key_token=key.stride(0) * size, stride_key_head=key.stride(1) * size,
        stride_value_token=value.stride(0) * size, stride_value_head=value.stride(1) * size,
        stride_cache_block=key_cache.stride(0) * size, stride_cache_slot=key_cache.stride(1) * size,
        stride_cache_head=key_cache.stride(2) * size)
