"""Blocks pulled from another node's pool: PoolServer serves a node's HostPool over TCP, pull_blocks copies a
run of blocks from one into the local pool, where the scheduler then finds them as it finds any pool hit.

A pull asks for a chain of block hashes and gets the leading run the remote pool holds, each block read
under the pool's seqlock (HostPool.load), so no torn block leaves a node. The pools must share a layout
(model, dtype, block geometry, hash seed), which the request names. There is no token: a block is found
only by its chained hash, which takes the prompt's tokens (and cache salt) to compute, and holds nothing
those tokens do not already give.

Both sides do their socket work on threads with blocking sockets, off the replica's event loop, and go in
chunks of at most 16 blocks: a 2,000-token prefix is about 90 MB in float32, and neither side holds more than
a chunk of it (the server sends straight from the pool's mapping, then says how many of the chunk's blocks
were whole while it sent them).

Wire, one pull a connection: request = layout fingerprint (8 bytes), count (u32), count hashes of 16 bytes;
answer = chunks, each its number of blocks n (u32), their bytes slot after slot and how many of them, from
the first, are whole (u32); a chunk of 0 blocks, or one with fewer whole than sent, ends the answer.
"""
import socket
import struct
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from replica.kv_cache.hashing import BlockHash
from replica.kv_cache.host_pool import HostPool

_COUNT = struct.Struct("<I")
_HASH_BYTES = 16
_SERVE_TIMEOUT_S = 30.0  # a puller that stops reading or writing for this long is dropped
CHUNK_BLOCKS = 16


def _fingerprint(pool: HostPool) -> bytes:
    return xxhash.xxh64_digest(pool.spec.layout.encode())


class PoolServer:
    """Serves the blocks of a node's pool to the replicas of other nodes, a thread a connection."""

    def __init__(self, pool: HostPool):
        self._pool = pool
        self._listener: socket.socket | None = None

    def start(self, host: str) -> tuple[str, int]:
        """Listens on host (the node's address), on a free port: where other nodes pull from."""
        self._listener = socket.create_server((host, 0), family=_family(host))
        threading.Thread(target=self._accept, args=(self._listener,), name="pool-server", daemon=True).start()
        return self._listener.getsockname()[:2]

    def close(self) -> None:
        if self._listener is not None:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            self._listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(connection,), name="pool-server-pull", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(_SERVE_TIMEOUT_S)
            try:
                fingerprint = _receive(connection, 8)
                (count,) = _COUNT.unpack(_receive(connection, _COUNT.size))
                if fingerprint != _fingerprint(self._pool) or count > self._pool.spec.num_slots:
                    return  # another model's pool, or nonsense: nothing to serve it
                raw = _receive(connection, count * _HASH_BYTES)
                self._send([raw[i:i + _HASH_BYTES] for i in range(0, len(raw), _HASH_BYTES)], connection)
            except OSError:
                pass  # the puller went away

    def _send(self, block_hashes: list[BlockHash], connection: socket.socket) -> None:
        """The leading run of the blocks the pool holds, chunk after chunk, while each chunk's blocks stay whole."""
        pool = self._pool

        def send(read: list[int]) -> None:
            for slot in read:
                connection.sendall(pool.data[slot])
        slots = pool.find(block_hashes)
        for start in range(0, len(slots), CHUNK_BLOCKS):
            chunk = slots[start:start + CHUNK_BLOCKS]
            connection.sendall(_COUNT.pack(len(chunk)))
            num_whole = pool.load(chunk, block_hashes[start:start + CHUNK_BLOCKS], send)
            connection.sendall(_COUNT.pack(num_whole))
            if num_whole < len(chunk):
                return
        connection.sendall(_COUNT.pack(0))


def pull_blocks(address: tuple[str, int], block_hashes: Sequence[BlockHash], pool: HostPool,
                timeout_s: float) -> int:
    """Copy the leading run of block_hashes that the pool served at address holds into pool; how many came.
    Raises OSError where the connection fails or stalls for timeout_s."""
    buffer = np.empty((min(len(block_hashes), CHUNK_BLOCKS), pool.spec.slot_bytes), np.uint8)

    def write(indices: list[int], slots: list[int]) -> None:
        pool.data[slots] = buffer[indices]
    num_pulled = 0
    with socket.create_connection(address, timeout=timeout_s) as connection:
        connection.sendall(_fingerprint(pool) + _COUNT.pack(len(block_hashes)) + b"".join(block_hashes))
        while num_pulled < len(block_hashes):
            (count,) = _COUNT.unpack(_receive(connection, _COUNT.size))
            if count == 0:
                break
            if count > min(CHUNK_BLOCKS, len(block_hashes) - num_pulled):
                raise ConnectionError(f"the pool at {address} sent a chunk of {count} blocks")
            _receive_into(connection, memoryview(buffer[:count].reshape(-1)))
            (num_whole,) = _COUNT.unpack(_receive(connection, _COUNT.size))
            pool.store(block_hashes[num_pulled:num_pulled + min(num_whole, count)], write)
            num_pulled += min(num_whole, count)
            if num_whole < count:
                break
    return num_pulled


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _receive(connection: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    _receive_into(connection, memoryview(buffer))
    return bytes(buffer)


def _receive_into(connection: socket.socket, buffer: memoryview) -> None:
    received = 0
    while received < len(buffer):
        count = connection.recv_into(buffer[received:])
        if not count:
            raise ConnectionError(f"the connection closed after {received} of {len(buffer)} bytes")
        received += count
