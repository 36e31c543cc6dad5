"""CPU: a Llama-family model's decoder layers for one small batch in one call (csrc/decoder.cpp)."""
from dataclasses import dataclass

import torch

from kernels.cpu.library import HEAD_DIMS, load, operand_dtype_code
from kernels.layout import check_on_cpu

# A layer's row of the pointer table, as csrc/decoder.cpp's LayerPointer reads it: the weights (the
# projections packed by kernels.cpu.linear; a missing qkv bias, or q and k norms, are 0) and the KV cache.
LAYER_POINTERS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "output", "post_norm", "gate_up", "down",
                  "key_cache", "value_cache")


@dataclass(frozen=True)
class DecoderShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    scale: float


def decoder_layers(hidden: torch.Tensor, layers: torch.Tensor, final_norm: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, key_cache: torch.Tensor,
                   shape: DecoderShape) -> torch.Tensor:
    """hidden [T, hidden_size], the embeddings (overwritten) -> the final norm of the last layer's output.
    layers: int64 [num_layers, len(LAYER_POINTERS)] addresses of tensors the caller keeps alive, every
    cache laid out as key_cache; every token attends in one group (block_tables, query_start_loc, seq_lens)."""
    code = operand_dtype_code({"hidden": hidden, "final_norm": final_norm, "key_cache": key_cache})
    check_on_cpu(layers=layers, positions=positions, cos_sin_cache=cos_sin_cache, slot_mapping=slot_mapping,
                 block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens)
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"the CPU attention kernel takes head_dim in {HEAD_DIMS}, got {shape.head_dim}")
    if layers.dtype != torch.int64 or layers.dim() != 2 or layers.shape[1] != len(LAYER_POINTERS):
        raise ValueError(f"layers must be int64 [num_layers, {len(LAYER_POINTERS)}], got {layers.dtype} "
                         f"{tuple(layers.shape)}")
    if not hidden.is_contiguous() or hidden.shape[1] != shape.hidden_size:
        raise ValueError(f"hidden must be contiguous [T, {shape.hidden_size}], got {tuple(hidden.shape)}")
    positions, slot_mapping = positions.to(torch.int64).contiguous(), slot_mapping.to(torch.int64).contiguous()
    block_tables, query_start_loc, seq_lens = (
        tensor.to(torch.int32).contiguous() for tensor in (block_tables, query_start_loc, seq_lens))
    out = torch.empty_like(hidden)
    load().decoder_layers(
        dtype=code, out=out, hidden=hidden, layers=layers.contiguous(), num_layers=layers.shape[0],
        final_norm=final_norm, positions=positions, cos_sin_cache=cos_sin_cache.to(torch.float32).contiguous(),
        slot_mapping=slot_mapping, block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens,
        num_reqs=seq_lens.shape[0], num_tokens=hidden.shape[0], hidden_size=shape.hidden_size,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size, block_size=key_cache.shape[1],
        stride_cache_block=key_cache.stride(0), stride_cache_slot=key_cache.stride(1),
        stride_cache_head=key_cache.stride(2), stride_block_table=block_tables.stride(0), eps=shape.eps,
        scale=shape.scale)
    return out
