"""Blocks pulled from another node's pool: PoolServer serves a node's HostPool over TCP, pull_blocks copies a
run of blocks from one into the local pool, where the scheduler then finds them as it finds any pool hit.

A pull asks for a chain of block hashes and gets the leading run the remote pool holds, each block read
under the pool's seqlock (HostPool.load), so no torn block leaves a node. The pools must share a layout
(model, dtype, block geometry, hash seed), which the request names. There is no token: a block is found
only by its chained hash, which takes the prompt's tokens (and cache salt) to compute, and holds nothing
those tokens do not already give.

Wire, one pull a connection: request = layout fingerprint (8 bytes), count (u32), count hashes of 16 bytes; answer = count of blocks
served (u32), then their bytes, slot after slot.
"""
import asyncio
import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from replica.kv_cache.hashing import BlockHash
from replica.kv_cache.host_pool import HostPool

_COUNT = struct.Struct("<I")
_HASH_BYTES = 16


def _fingerprint(pool: HostPool) -> bytes:
    return xxhash.xxh64_digest(pool.spec.layout.encode())


class PoolServer:
    """Serves the blocks of a node's pool to the replicas of other nodes, on the loop it is started on."""

    def __init__(self, pool: HostPool):
        self._pool = pool
        self._server: asyncio.Server | None = None

    async def start(self, host: str) -> tuple[str, int]:
        """Listens on host (the node's address), on a free port: where other nodes pull from."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            fingerprint = await reader.readexactly(8)
            (count,) = _COUNT.unpack(await reader.readexactly(_COUNT.size))
            if fingerprint != _fingerprint(self._pool) or count > self._pool.spec.num_slots:
                return  # another model's pool, or nonsense: nothing to serve it
            raw = await reader.readexactly(count * _HASH_BYTES)
            blocks = await asyncio.to_thread(self._read, [raw[i:i + _HASH_BYTES] for i in range(0, len(raw),
                                                                                                  _HASH_BYTES)])
            writer.write(_COUNT.pack(len(blocks)))
            writer.write(memoryview(blocks).cast("B"))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the puller went away
        finally:
            writer.close()

    def _read(self, block_hashes: list[BlockHash]) -> np.ndarray:
        """The leading run of the blocks the pool holds and read whole."""
        pool = self._pool
        slots = pool.find(block_hashes)
        blocks = np.empty((len(slots), pool.spec.slot_bytes), np.uint8)
        num_valid = pool.load(slots, block_hashes, lambda read: np.take(pool.data, read, axis=0, out=blocks))
        return blocks[:num_valid]


async def pull_blocks(address: tuple[str, int], block_hashes: Sequence[BlockHash], pool: HostPool) -> int:
    """Copy the leading run of block_hashes that the pool served at address holds into pool; how many came.
    Raises what the connection raises (the caller bounds its time)."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(_fingerprint(pool) + _COUNT.pack(len(block_hashes)) + b"".join(block_hashes))
        await writer.drain()
        (count,) = _COUNT.unpack(await reader.readexactly(_COUNT.size))
        if count > len(block_hashes):
            raise ConnectionError(f"the pool at {address} served {count} blocks for {len(block_hashes)} asked")
        data = await reader.readexactly(count * pool.spec.slot_bytes)
    finally:
        writer.close()
    blocks = np.frombuffer(data, np.uint8).reshape(count, pool.spec.slot_bytes)

    def write(indices: list[int], slots: list[int]) -> None:
        pool.data[slots] = blocks[indices]
    await asyncio.to_thread(pool.store, list(block_hashes[:count]), write)
    return count
