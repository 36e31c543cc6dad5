"""The paged KV cache tensors: per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""
import torch

from replica.executor.config import ModelConfig
from replica.executor.model import KVCache


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return budget_bytes // block_bytes(config, block_size, dtype)


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[KVCache]:
    # zeros, not empty: padded attention reads masked slots, and 0 * NaN garbage would be NaN
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]
