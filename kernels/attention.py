"""Paged attention over block tables for a mixed batch of prefill chunks and decodes.

Request r owns query rows query_start_loc[r]:query_start_loc[r+1]; its context is seq_lens[r]
tokens (cached prefix + its new tokens, whose K/V are already in the cache). Query row i of r sits
at position seq_lens[r] - q_len + i and attends causally to positions <= its own. Query head h
reads KV head h // (Hq // Hkv). Block-table entries past a request's last block are not read.
"""
import torch
import torch.nn.functional as F


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [T, Hq, D], caches [num_blocks, block_size, Hkv, D] -> out [T, Hq, D].

    All one-token (decode) requests go through one batched SDPA, every other request through an
    SDPA on its gathered context. The query heads sharing a KV head are folded into query rows,
    so K/V are never repeated.
    """
    num_queries_per_kv(query, key_cache)
    starts = query_start_loc.tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    out = torch.empty_like(query)
    decodes = [r for r, query_len in enumerate(query_lens) if query_len == 1]
    if decodes:
        rows = torch.tensor([starts[r] for r in decodes], device=query.device)
        requests = torch.tensor(decodes, device=query.device)
        out[rows] = _decode_attention(query[rows], key_cache, value_cache, block_tables[requests],
                                      seq_lens[requests], scale)
    for r, context_len in enumerate(seq_lens.tolist()):
        if query_lens[r] > 1:
            keys, values = _gather_context(key_cache, value_cache, block_tables[r], context_len)
            out[starts[r]:starts[r + 1]] = _causal_attention(
                query[starts[r]:starts[r + 1]], keys, values, scale)
    return out


def num_queries_per_kv(query: torch.Tensor, key_cache: torch.Tensor) -> int:
    """Query heads per KV head (GQA group size); ValueError if they do not divide."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    return num_heads // num_kv_heads


def _gather_context(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                    context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[context_len, Hkv, D] keys and values of one request."""
    block_size = key_cache.shape[1]
    block_ids = block_table[:-(-context_len // block_size)]
    keys = key_cache[block_ids].flatten(0, 1)[:context_len]
    values = value_cache[block_ids].flatten(0, 1)[:context_len]
    return keys, values


def _causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """query [q_len, Hq, D] at the last q_len positions of keys/values [ctx, Hkv, D]."""
    q_len, num_heads, head_dim = query.shape
    context_len, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    # rows (token, head-in-group) of each KV head: [1, Hkv, q_len * group, D]; SDPA takes its
    # fast (flash) CPU path only for 4-D inputs
    rows = query.view(q_len, num_kv_heads, group, head_dim).transpose(0, 1).flatten(1, 2)
    mask = None
    if q_len > 1:
        positions = torch.arange(context_len - q_len, context_len, device=query.device)
        columns = torch.arange(context_len, device=query.device)
        mask = (columns <= positions[:, None]).repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(rows[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, scale=scale)
    return out.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1).reshape(query.shape)


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query token per request: a single SDPA over contexts padded to the longest one."""
    num_reqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    max_blocks = -(-int(seq_lens.max()) // block_size)
    block_ids = block_tables[:, :max_blocks]
    keys = key_cache[block_ids].flatten(1, 2).transpose(1, 2)      # [R, Hkv, ctx, D]
    values = value_cache[block_ids].flatten(1, 2).transpose(1, 2)
    columns = torch.arange(max_blocks * block_size, device=query.device)
    mask = (columns < seq_lens[:, None])[:, None, None, :]
    rows = query.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(query.shape)
