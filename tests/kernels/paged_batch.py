"""Builds paged-attention inputs from dense per-request K/V, and the dense float64 answer."""
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor                 # [T, Hq, D]
    key_cache: torch.Tensor             # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor          # [R, max_blocks] int32, padded with block 0
    query_start_loc: torch.Tensor       # [R + 1] int32
    seq_lens: torch.Tensor              # [R] int32
    scale: float
    keys: list[torch.Tensor]            # dense [context_len, Hkv, D] per request
    values: list[torch.Tensor]

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.query_start_loc, self.seq_lens, self.scale)

    def dense_attention(self) -> torch.Tensor:
        """Per-request causal softmax attention in float64 from the unpaged K/V."""
        starts = self.query_start_loc.tolist()
        return torch.cat([dense_causal_attention(self.query[starts[r]:starts[r + 1]], keys, values,
                                                 self.scale)
                          for r, (keys, values) in enumerate(zip(self.keys, self.values))])


def dense_causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """query [q_len, Hq, D] at the last q_len of the context positions of keys [ctx, Hkv, D]."""
    q_len, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    positions = torch.arange(context_len - q_len, context_len, device=query.device)
    hidden = torch.arange(context_len, device=query.device) > positions[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def make_paged_batch(query_lens: list[int], context_lens: list[int], num_heads: int,
                     num_kv_heads: int, *, block_size: int = 16, head_dim: int = 16,
                     dtype: torch.dtype = torch.float32, device: str = "cpu",
                     seed: int = 0) -> PagedBatch:
    """Each request's K/V in randomly chosen (shuffled) blocks; every other cache slot is noise."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_per_request) + 3
    block_ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    key_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_request) + 1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for r, (length, num_request_blocks) in enumerate(zip(context_lens, blocks_per_request)):
        table = block_ids[used:used + num_request_blocks]
        used += num_request_blocks
        block_tables[r, :num_request_blocks] = table
        slots = (table[:, None].long() * block_size + torch.arange(block_size)).flatten()[:length]
        keys.append(randn(length, num_kv_heads, head_dim))
        values.append(randn(length, num_kv_heads, head_dim))
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = keys[-1]
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = values[-1]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                   dtype=torch.int32)
    return PagedBatch(
        query=randn(sum(query_lens), num_heads, head_dim).to(device),
        key_cache=key_cache.to(device), value_cache=value_cache.to(device),
        block_tables=block_tables.to(device), query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5,
        keys=[k.to(device) for k in keys], values=[v.to(device) for v in values])
