"""Writing new tokens' K/V into the paged cache through a slot mapping.

slot = block_id * block_size + offset; a negative slot (a padding token) is skipped.
"""
import torch


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> key_cache/value_cache [num_blocks, block_size, Hkv, D], in place."""
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_ids, offsets = slots // block_size, slots % block_size
    key_cache[block_ids, offsets] = key[valid]
    value_cache[block_ids, offsets] = value[valid]
