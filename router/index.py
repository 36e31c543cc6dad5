"""BlockIndex: the router's mirror of which block hashes every replica holds in its prefix cache.

Two maps kept in step: replica -> its hashes (to clear or resync one replica) and hash -> the
replicas holding it (so matching a chain costs O(chain length x replicas that match), whatever
the number of blocks cached).
"""
from collections.abc import Iterable, Sequence

from replica.kv_cache import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

_NOBODY: frozenset[str] = frozenset()


class BlockIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[BlockHash]] = {}
        self._holders: dict[BlockHash, set[str]] = {}

    def apply(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        """Mirror a replica's KV events in order; a replica not seen before is created."""
        self._held.setdefault(replica_id, set())
        for event in events:
            match event:
                case BlockStored():
                    self.add(replica_id, event.block_hashes)
                case BlockRemoved():
                    self._discard(replica_id, event.block_hashes)
                case AllBlocksCleared():
                    self._clear(replica_id)
                case _:
                    raise TypeError(f"not a KV event: {event!r}")

    def add(self, replica_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Count the blocks as held by the replica (stored there, or about to be)."""
        held = self._held.setdefault(replica_id, set())
        for block_hash in block_hashes:
            held.add(block_hash)
            holders = self._holders.get(block_hash)
            if holders is None:
                self._holders[block_hash] = {replica_id}
            else:
                holders.add(replica_id)

    def resync(self, replica_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Replace everything known about a replica's cache with its full list of hashes."""
        self._clear(replica_id)
        self.add(replica_id, block_hashes)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Replica -> how many leading blocks of the chain it holds; replicas holding none are omitted."""
        matched: dict[str, int] = {}
        if not block_hashes:
            return matched
        alive = self._holders.get(block_hashes[0], _NOBODY)
        for depth in range(1, len(block_hashes)):
            if not alive:
                return matched
            holders = self._holders.get(block_hashes[depth], _NOBODY)
            if alive <= holders:  # the common case: nobody's match ends here
                continue
            matched.update(dict.fromkeys(alive - holders, depth))
            alive = alive & holders
        matched.update(dict.fromkeys(alive, len(block_hashes)))
        return matched

    def remove_replica(self, replica_id: str) -> None:
        self._clear(replica_id)
        del self._held[replica_id]

    def num_blocks(self, replica_id: str) -> int:
        return len(self._held.get(replica_id, ()))

    def _discard(self, replica_id: str, block_hashes: Iterable[BlockHash]) -> None:
        held = self._held[replica_id]
        for block_hash in block_hashes:
            if block_hash in held:
                held.remove(block_hash)
                self._drop_holder(block_hash, replica_id)

    def _clear(self, replica_id: str) -> None:
        for block_hash in self._held.get(replica_id, ()):
            self._drop_holder(block_hash, replica_id)
        self._held[replica_id] = set()

    def _drop_holder(self, block_hash: BlockHash, replica_id: str) -> None:
        holders = self._holders[block_hash]
        holders.discard(replica_id)
        if not holders:
            del self._holders[block_hash]
