"""Pulls between two nodes' pools (two pool files here), over a real TCP connection on loopback."""
import asyncio

import numpy as np
import pytest

from replica.kv_cache.host_pool import HostPool, HostPoolSpec
from replica.kv_cache.pool_transfer import PoolServer, pull_blocks
from tests.replica.test_host_pool import CHAIN, SLOT_BYTES, fill

LAYOUT = "test|float32|4x1x8x2"


def node_pool(tmp_path, name: str, num_slots: int = 8, layout: str = LAYOUT) -> HostPool:
    return HostPool(HostPoolSpec(str(tmp_path / name), num_slots, SLOT_BYTES, layout))


async def pull(source: HostPool, target: HostPool, block_hashes) -> int:
    server = PoolServer(source)
    address = await server.start("127.0.0.1")
    try:
        return await pull_blocks(address, block_hashes, target)
    finally:
        await server.close()


def test_a_pull_copies_the_leading_run_the_remote_pool_holds_into_the_local_one(tmp_path):
    source, target = node_pool(tmp_path, "a"), node_pool(tmp_path, "b")
    fill(source, CHAIN[:3] + CHAIN[4:5], [7, 8, 9, 10])
    assert asyncio.run(pull(source, target, CHAIN[:5])) == 3
    assert target.contents() == set(CHAIN[:3])
    slots = target.find(CHAIN[:3])
    assert [np.unique(target.data[slot]).tolist() for slot in slots] == [[7], [8], [9]]


def test_a_pull_of_blocks_the_remote_pool_lacks_brings_nothing(tmp_path):
    source, target = node_pool(tmp_path, "a"), node_pool(tmp_path, "b")
    fill(source, CHAIN[1:3], [1, 2])
    assert asyncio.run(pull(source, target, CHAIN[:3])) == 0
    assert target.contents() == set()


def test_a_torn_block_ends_the_run_it_would_have_joined(tmp_path):
    source, target = node_pool(tmp_path, "a"), node_pool(tmp_path, "b")
    fill(source, CHAIN[:3], [1, 2, 3])
    torn = source.find(CHAIN[:3])[1]
    source._table["version"][torn] += 1  # a writer died in it
    assert asyncio.run(pull(source, target, CHAIN[:3])) == 1
    assert target.contents() == {CHAIN[0]}


def test_a_pool_of_another_layout_serves_nothing_and_the_puller_is_told(tmp_path):
    source, target = node_pool(tmp_path, "a", layout="other|bfloat16|4x1x8x2"), node_pool(tmp_path, "b")
    fill(source, CHAIN[:2], [1, 2])
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(pull(source, target, CHAIN[:2]))
    assert target.contents() == set()
