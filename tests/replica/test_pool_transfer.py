"""Pulls between two nodes' pools (two pool files here), over a real TCP connection on loopback."""
import numpy as np
import pytest

from replica.kv_cache.host_pool import HostPool, HostPoolSpec
from replica.kv_cache import pool_transfer
from replica.kv_cache.pool_transfer import PoolServer, pull_blocks
from tests.replica.test_host_pool import CHAIN, SLOT_BYTES, fill

LAYOUT = "test|float32|4x1x8x2"


def node_pool(tmp_path, name: str, num_slots: int = 8, layout: str = LAYOUT) -> HostPool:
    return HostPool(HostPoolSpec(str(tmp_path / name), num_slots, SLOT_BYTES, layout))


def pull(source: HostPool, target: HostPool, block_hashes) -> int:
    server = PoolServer(source)
    address = server.start("127.0.0.1")
    try:
        return pull_blocks(address, block_hashes, target, timeout_s=10)
    finally:
        server.close()


def test_a_pull_copies_the_leading_run_the_remote_pool_holds_into_the_local_one(tmp_path):
    source, target = node_pool(tmp_path, "a"), node_pool(tmp_path, "b")
    fill(source, CHAIN[:3] + CHAIN[4:5], [7, 8, 9, 10])
    assert pull(source, target, CHAIN[:5]) == 3
    assert target.contents() == set(CHAIN[:3])
    slots = target.find(CHAIN[:3])
    assert [np.unique(target.data[slot]).tolist() for slot in slots] == [[7], [8], [9]]


def test_a_pull_of_blocks_the_remote_pool_lacks_brings_nothing(tmp_path):
    source, target = node_pool(tmp_path, "a"), node_pool(tmp_path, "b")
    fill(source, CHAIN[1:3], [1, 2])
    assert pull(source, target, CHAIN[:3]) == 0
    assert target.contents() == set()


def test_a_torn_block_ends_the_run_it_would_have_joined(tmp_path):
    source, target = node_pool(tmp_path, "a"), node_pool(tmp_path, "b")
    fill(source, CHAIN[:3], [1, 2, 3])
    torn = source.find(CHAIN[:3])[1]
    source._table["version"][torn] += 1  # a writer died in it
    assert pull(source, target, CHAIN[:3]) == 1
    assert target.contents() == {CHAIN[0]}


def test_a_pool_of_another_layout_serves_nothing_and_the_puller_is_told(tmp_path):
    source, target = node_pool(tmp_path, "a", layout="other|bfloat16|4x1x8x2"), node_pool(tmp_path, "b")
    fill(source, CHAIN[:2], [1, 2])
    with pytest.raises(ConnectionError):
        pull(source, target, CHAIN[:2])
    assert target.contents() == set()


class RewrittenWhileSent(HostPool):
    """A pool in which another engine rewrites one block's slot while the server sends that block."""

    def __init__(self, spec: HostPoolSpec, rewritten: bytes):
        super().__init__(spec)
        self.rewritten = rewritten

    def load(self, slots, block_hashes, read):
        def read_then_rewrite(read_slots):
            read(read_slots)
            if self.rewritten in block_hashes:
                self._table["version"][slots[list(block_hashes).index(self.rewritten)]] += 2
        return super().load(slots, block_hashes, read_then_rewrite)


def test_a_pull_goes_in_chunks_and_ends_at_a_block_rewritten_while_it_was_sent(tmp_path, monkeypatch):
    monkeypatch.setattr(pool_transfer, "CHUNK_BLOCKS", 2)
    source = RewrittenWhileSent(HostPoolSpec(str(tmp_path / "a"), 8, SLOT_BYTES, LAYOUT), rewritten=CHAIN[3])
    target = node_pool(tmp_path, "b")
    fill(source, CHAIN[:5], [1, 2, 3, 4, 5])
    assert pull(source, target, CHAIN[:5]) == 3  # chunks [0, 1] and [2, 3], of which 3 changed as it went
    assert target.contents() == set(CHAIN[:3])
    assert [np.unique(target.data[slot]).tolist() for slot in target.find(CHAIN[:3])] == [[1], [2], [3]]
    source.rewritten = None
    target_whole = node_pool(tmp_path, "c")
    assert pull(source, target_whole, CHAIN[:5]) == 5  # three chunks
