"""BlockIndex: the router's mirror of which block hashes every replica holds in its prefix cache.

Every replica owns one bit; `hash -> bitmask of the replicas storing it` makes matching a chain
one dict lookup and two integer operations per block, whatever the number of replicas. Keys are
the hashes' bytes and values ints: no container per block, so the garbage collector never walks
the index.

Per replica it also mirrors the blocks its node's pool holds (events of medium "host", as the replica
sees the pool), apart: a replica loads those instead of computing them, which the policy prices.

Bookings (blocks a request routed to a replica will compute there, until it finishes) are kept
apart, at checkpoints only: the first 8 blocks of the chain, every 16th block after them and the
last, from where the replica's match ended. Hashes are chained, so a request whose block k has
the hash of a booked chain's block k shares all k + 1 leading blocks with it: one booked
checkpoint stands for every block before it. Booking a long prompt then costs one entry per 16
blocks, and a booked match is rounded down to a checkpoint, which the replica's own BlockStored
events soon make exact.
"""
import bisect
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from replica.kv_cache import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from replica.kv_cache.events import Medium

_DENSE_CHECKPOINTS = 8
_CHECKPOINT_STRIDE = 16


@functools.cache
def checkpoints(num_blocks: int) -> tuple[int, ...]:
    """The depths (0-based) of a chain of num_blocks blocks that a booking records."""
    depths = list(range(min(num_blocks, _DENSE_CHECKPOINTS)))
    depths += range(_DENSE_CHECKPOINTS + _CHECKPOINT_STRIDE - 1, num_blocks, _CHECKPOINT_STRIDE)
    if num_blocks and depths[-1] != num_blocks - 1:
        depths.append(num_blocks - 1)
    return tuple(depths)


def _checkpoints_from(num_blocks: int, start: int) -> tuple[int, ...]:
    depths = checkpoints(num_blocks)
    return depths[bisect.bisect_left(depths, start):] if start else depths


@dataclass(slots=True)
class _ReplicaBlocks:
    bit: int
    stored: dict[BlockHash, None] = field(default_factory=dict)
    booked: dict[BlockHash, int] = field(default_factory=dict)  # checkpoint hash -> bookings
    host: dict[BlockHash, None] = field(default_factory=dict)  # in its node's pool


class BlockIndex:
    def __init__(self) -> None:
        self._stored: dict[BlockHash, int] = {}  # hash -> replicas storing it
        self._booked: dict[BlockHash, int] = {}  # checkpoint hash -> replicas with a booking of it
        self._replicas: dict[str, _ReplicaBlocks] = {}
        self._ids_by_bit: list[str | None] = []

    def apply(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        """Mirror a replica's KV events in order; a replica not seen before is created."""
        replica = self._replica(replica_id)
        stored, holders, bit = replica.stored, self._stored, 1 << replica.bit
        for event in events:
            kind = type(event)
            if kind is BlockStored and event.medium == "device":  # the common case, inlined: a step stores
                for block_hash in event.block_hashes:                # a block per running request
                    if block_hash not in stored:
                        stored[block_hash] = None
                        holders[block_hash] = holders.get(block_hash, 0) | bit
            elif kind is BlockStored:
                replica.host.update(dict.fromkeys(event.block_hashes))
            elif kind is BlockRemoved and event.medium == "host":
                for block_hash in event.block_hashes:
                    replica.host.pop(block_hash, None)
            elif kind is BlockRemoved:
                self._unstore(replica, event.block_hashes)
            elif kind is AllBlocksCleared and event.medium == "host":
                replica.host.clear()
            elif kind is AllBlocksCleared:
                self._unstore(replica, list(stored))
            else:
                raise TypeError(f"not a KV event: {event!r}")

    def resync(self, replica_id: str, block_hashes: Iterable[BlockHash], medium: Medium = "device") -> None:
        """Replace what the replica (or its node's pool) is known to store with its full list of hashes;
        bookings stay."""
        self.apply(replica_id, [AllBlocksCleared(medium), BlockStored(list(block_hashes), None, [], 0, medium)])

    def book(self, replica_id: str, block_hashes: Sequence[BlockHash], start: int = 0) -> None:
        """Count the chain as held by the replica until unbook(): a request routed there computes it.

        Checkpoints before `start` (blocks the replica already holds) are left out; unbook() the same.
        """
        replica = self._replica(replica_id)
        booked, holders, bit = replica.booked, self._booked, 1 << replica.bit
        for depth in _checkpoints_from(len(block_hashes), start):
            block_hash = block_hashes[depth]
            count = booked.get(block_hash, 0)
            booked[block_hash] = count + 1
            if not count:
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def unbook(self, replica_id: str, block_hashes: Sequence[BlockHash], start: int = 0) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        booked, mask = replica.booked, ~(1 << replica.bit)
        for depth in _checkpoints_from(len(block_hashes), start):
            block_hash = block_hashes[depth]
            count = booked.get(block_hash, 0)
            if count > 1:
                booked[block_hash] = count - 1
            elif count:
                del booked[block_hash]
                _drop_bit(self._booked, block_hash, mask)

    def match(self, block_hashes: Sequence[BlockHash], *, booked: bool = True) -> dict[str, int]:
        """Replica -> how many leading blocks of the chain it holds (or, if booked, will compute for a request
        routed to it); replicas holding none are omitted."""
        matched: dict[str, int] = {}
        if block_hashes:
            self._match_stored(block_hashes, matched)
            if booked and self._booked:
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

    def host_run(self, replica_id: str, block_hashes: Sequence[BlockHash], start: int) -> int:
        """How many blocks of the chain from start on the replica's node pool holds, one after the other."""
        replica = self._replicas.get(replica_id)
        if replica is None or not replica.host:
            return 0
        held = replica.host
        depth = start
        while depth < len(block_hashes) and block_hashes[depth] in held:
            depth += 1
        return depth - start

    def stored_hashes(self, replica_id: str, medium: Medium = "device") -> list[BlockHash]:
        """The hashes the replica reported stored, in the order it stored them (bookings not counted)."""
        replica = self._replicas.get(replica_id)
        return list(replica.stored if medium == "device" else replica.host) if replica else []

    def num_blocks(self, replica_id: str, medium: Medium = "device") -> int:
        """Blocks the replica reported stored (bookings not counted)."""
        replica = self._replicas.get(replica_id)
        return len(replica.stored if medium == "device" else replica.host) if replica else 0

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
        """Deepest checkpoint first: a replica's deepest booked checkpoint is its booked match."""
        booked, seen = self._booked, 0
        for depth in reversed(checkpoints(len(block_hashes))):
            held = booked.get(block_hashes[depth], 0) & ~seen
            if held:
                self._record(matched, held, depth + 1, keep_longer=True)
                seen |= held

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
