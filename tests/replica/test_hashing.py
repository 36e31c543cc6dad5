import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from replica.kv_cache import hash_block_tokens, hash_token_blocks


def test_hash_is_16_bytes_and_deterministic():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 16
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first


def test_canonical_encoding_is_fixed():
    # parent (16 zero bytes for none), token count, tokens: little-endian int64
    data = b"\x00" * 16 + (2).to_bytes(8, "little") + (5).to_bytes(8, "little") + (7).to_bytes(8, "little")
    assert hash_block_tokens(None, [5, 7], seed=3) == xxhash.xxh3_128_digest(data, seed=3)


def test_every_input_changes_the_hash():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    variants = [
        hash_block_tokens(None, [1, 2, 3, 5]),
        hash_block_tokens(base, [1, 2, 3, 4]),
        hash_block_tokens(None, [1, 2, 3, 4], ("salt",)),
        hash_block_tokens(None, [1, 2, 3, 4], seed=1),
    ]
    assert len({base, *variants}) == 5


def test_chain_matches_block_by_block_hashing():
    tokens = list(range(10))
    chain = hash_token_blocks(tokens, 4, cache_salt="s", seed=7)
    first = hash_block_tokens(None, [0, 1, 2, 3], ("s",), seed=7)
    second = hash_block_tokens(first, [4, 5, 6, 7], None, seed=7)
    assert chain == [first, second]  # the partial last block is not hashed
    assert hash_token_blocks(tokens + [10, 11], 4, cache_salt="s", seed=7, parent_hashes=chain) == [
        hash_block_tokens(second, [8, 9, 10, 11], seed=7)]


def test_salt_only_enters_the_first_block():
    salted = hash_token_blocks(list(range(8)), 4, cache_salt="tenant-a")
    plain = hash_token_blocks(list(range(8)), 4)
    assert salted[0] != plain[0]
    assert salted[1] == hash_block_tokens(salted[0], [4, 5, 6, 7])


def test_same_hash_in_another_process():
    code = ("from replica.kv_cache import hash_token_blocks;"
            "print(hash_token_blocks(list(range(32)), 16, cache_salt='x', seed=5)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == hash_token_blocks(list(range(32)), 16, cache_salt="x", seed=5)[1].hex()


def test_unhashable_extra_key_is_rejected():
    with pytest.raises(TypeError, match="cannot hash extra key of type float"):
        hash_block_tokens(None, [1], (1.5,))
