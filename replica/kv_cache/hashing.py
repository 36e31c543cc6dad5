"""Chained block hashes: xxh3_128 over a canonical byte encoding, identical in every process.

A block's hash covers its parent's hash, its token ids and its extra keys (the first block
carries the request's cache_salt), so equal hashes mean equal prefixes up to that block.
"""
import struct
from collections.abc import Sequence

import xxhash

BlockHash = bytes  # 16 bytes

_NO_PARENT = b"\x00" * 16


def _encode_key(key, out: bytearray) -> None:
    if isinstance(key, bool) or key is None:
        out += b"n" if key is None else (b"T" if key else b"F")
    elif isinstance(key, int):
        out += b"i" + key.to_bytes(16, "little", signed=True)
    elif isinstance(key, str):
        data = key.encode()
        out += b"s" + struct.pack("<Q", len(data)) + data
    elif isinstance(key, bytes):
        out += b"b" + struct.pack("<Q", len(key)) + key
    elif isinstance(key, (tuple, list)):
        out += b"t" + struct.pack("<Q", len(key))
        for item in key:
            _encode_key(item, out)
    else:
        raise TypeError(f"cannot hash extra key of type {type(key).__name__}")


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None, *, seed: int = 0) -> BlockHash:
    data = bytearray(_NO_PARENT if parent is None else parent)
    data += struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids)
    if extra_keys:
        _encode_key(tuple(extra_keys), data)
    return xxhash.xxh3_128_digest(bytes(data), seed=seed)


def hash_token_blocks(token_ids: Sequence[int], block_size: int, *,
                      cache_salt: str | None = None, seed: int = 0,
                      parent_hashes: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Hashes of the full blocks of token_ids that parent_hashes does not cover yet."""
    hashes: list[BlockHash] = []
    parent = parent_hashes[-1] if parent_hashes else None
    for index in range(len(parent_hashes), len(token_ids) // block_size):
        start = index * block_size
        extra_keys = (cache_salt,) if index == 0 and cache_salt is not None else None
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys, seed=seed)
        hashes.append(parent)
    return hashes
