"""BlockIndex: the router's mirror of which block hashes every replica holds in its prefix cache.

Every replica owns one bit; `hash -> bitmask of the replicas storing it` makes matching a chain
one dict lookup and two integer operations per block, whatever the number of replicas. Keys are
the hashes' bytes and values ints: no container per block, so the garbage collector never walks
the index.

Bookings (blocks a request routed to a replica will compute there, until it finishes) are kept
apart, at checkpoints only: the first 8 blocks of the chain, every 8th block after them and the
last. Hashes are chained, so a request whose block k has the hash of a booked chain's block k
shares all k + 1 leading blocks with it: a booked checkpoint stands for every block before it.
Booking a long prompt then costs one entry per 8 blocks, and a booked match is rounded down to a
checkpoint, which the replica's own BlockStored events soon make exact.
"""
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from replica.kv_cache import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

_DENSE_CHECKPOINTS = 8
_CHECKPOINT_STRIDE = 8


@functools.cache
def checkpoints(num_blocks: int) -> tuple[int, ...]:
    """The depths (0-based) of a chain of num_blocks blocks that a booking records."""
    depths = list(range(min(num_blocks, _DENSE_CHECKPOINTS)))
    depths += range(_DENSE_CHECKPOINTS + _CHECKPOINT_STRIDE - 1, num_blocks, _CHECKPOINT_STRIDE)
    if num_blocks and depths[-1] != num_blocks - 1:
        depths.append(num_blocks - 1)
    return tuple(depths)


@dataclass(slots=True)
class _ReplicaBlocks:
    bit: int
    stored: dict[BlockHash, None] = field(default_factory=dict)
    booked: dict[BlockHash, int] = field(default_factory=dict)  # checkpoint hash -> bookings


class BlockIndex:
    def __init__(self) -> None:
        self._stored: dict[BlockHash, int] = {}  # hash -> replicas storing it
        self._booked: dict[BlockHash, int] = {}  # checkpoint hash -> replicas with a booking of it
        self._replicas: dict[str, _ReplicaBlocks] = {}
        self._ids_by_bit: list[str | None] = []

    def apply(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        """Mirror a replica's KV events in order; a replica not seen before is created."""
        replica = self._replica(replica_id)
        for event in events:
            match event:
                case BlockStored():
                    self._store(replica, event.block_hashes)
                case BlockRemoved():
                    self._unstore(replica, event.block_hashes)
                case AllBlocksCleared():
                    self._unstore(replica, list(replica.stored))
                case _:
                    raise TypeError(f"not a KV event: {event!r}")

    def resync(self, replica_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Replace what the replica is known to store with its full list of hashes; bookings stay."""
        replica = self._replica(replica_id)
        self._unstore(replica, list(replica.stored))
        self._store(replica, block_hashes)

    def book(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """Count the chain as held by the replica until unbook(): a request routed there computes it."""
        replica = self._replica(replica_id)
        booked, holders, bit = replica.booked, self._booked, 1 << replica.bit
        for depth in checkpoints(len(block_hashes)):
            block_hash = block_hashes[depth]
            count = booked.get(block_hash, 0)
            booked[block_hash] = count + 1
            if not count:
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def unbook(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        booked, mask = replica.booked, ~(1 << replica.bit)
        for depth in checkpoints(len(block_hashes)):
            block_hash = block_hashes[depth]
            count = booked.get(block_hash, 0)
            if count > 1:
                booked[block_hash] = count - 1
            elif count:
                del booked[block_hash]
                _drop_bit(self._booked, block_hash, mask)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Replica -> how many leading blocks of the chain it holds; replicas holding none are omitted."""
        matched: dict[str, int] = {}
        if block_hashes:
            self._match_stored(block_hashes, matched)
            if self._booked:
                self._match_booked(block_hashes, matched)
        return matched

    def remove_replica(self, replica_id: str) -> None:
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return
        mask = ~(1 << replica.bit)
        for block_hash in replica.stored:
            _drop_bit(self._stored, block_hash, mask)
        for block_hash in replica.booked:
            _drop_bit(self._booked, block_hash, mask)
        self._ids_by_bit[replica.bit] = None

    def num_blocks(self, replica_id: str) -> int:
        """Blocks the replica reported stored (bookings not counted)."""
        replica = self._replicas.get(replica_id)
        return len(replica.stored) if replica else 0

    def _match_stored(self, block_hashes: Sequence[BlockHash], matched: dict[str, int]) -> None:
        stored = self._stored
        alive = stored.get(block_hashes[0], 0)
        for depth in range(1, len(block_hashes)):
            if not alive:
                return
            held = alive & stored.get(block_hashes[depth], 0)
            if held != alive:  # some replicas' match ends here
                self._record(matched, alive & ~held, depth)
                alive = held
        self._record(matched, alive, len(block_hashes))

    def _match_booked(self, block_hashes: Sequence[BlockHash], matched: dict[str, int]) -> None:
        booked, alive, num_leading = self._booked, 0, 0
        for depth in checkpoints(len(block_hashes)):
            held = booked.get(block_hashes[depth], 0)
            if held != alive:  # a checkpoint stands for the blocks before it: replicas only drop out
                self._record(matched, alive & ~held, num_leading, keep_longer=True)
                alive = held
            if not alive:
                return
            num_leading = depth + 1
        self._record(matched, alive, num_leading, keep_longer=True)

    def _replica(self, replica_id: str) -> _ReplicaBlocks:
        replica = self._replicas.get(replica_id)
        if replica is None:
            bit = self._free_bit()
            self._ids_by_bit[bit] = replica_id
            replica = self._replicas[replica_id] = _ReplicaBlocks(bit)
        return replica

    def _free_bit(self) -> int:
        try:
            return self._ids_by_bit.index(None)
        except ValueError:
            self._ids_by_bit.append(None)
            return len(self._ids_by_bit) - 1

    def _store(self, replica: _ReplicaBlocks, block_hashes: Iterable[BlockHash]) -> None:
        stored, holders, bit = replica.stored, self._stored, 1 << replica.bit
        for block_hash in block_hashes:
            if block_hash not in stored:
                stored[block_hash] = None
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def _unstore(self, replica: _ReplicaBlocks, block_hashes: Iterable[BlockHash]) -> None:
        stored, mask = replica.stored, ~(1 << replica.bit)
        for block_hash in block_hashes:
            if block_hash in stored:
                del stored[block_hash]
                _drop_bit(self._stored, block_hash, mask)

    def _record(self, matched: dict[str, int], bits: int, depth: int, *, keep_longer: bool = False) -> None:
        while bits:
            lowest = bits & -bits
            replica_id = self._ids_by_bit[lowest.bit_length() - 1]
            if not keep_longer or matched.get(replica_id, 0) < depth:
                matched[replica_id] = depth
            bits ^= lowest


def _drop_bit(holders: dict[BlockHash, int], block_hash: BlockHash, mask: int) -> None:
    held = holders[block_hash] & mask
    if held:
        holders[block_hash] = held
    else:
        del holders[block_hash]
