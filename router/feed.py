"""The router feed: what the engines report, numbered, so that every ingress's Router follows it.

The feed's owner (the router actor) records each report it takes, publish, resync or a replica's
removal, exactly as it was called, and the bookings each follower shares. A follower asks for the
entries after its cursor and replays them on its own Router: the same calls in the same order, so
its view of every replica is the owner's, gaps and resyncs included. A follower the feed no longer
reaches back to (it fell behind, or the owner restarted: a new epoch) gets every replica's state
instead and goes on from there. No Ray here: the actor, simulators and tests share it.
"""
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from replica.kv_cache import BlockHash, KVEvent
from replica.scheduler import SchedulerStats
from router.core import Router
from router.messages import FinishedRequest, ReplicaState
from router.policy import PolicyConfig

MAX_ENTRIES = 50_000  # 64 engines stepping 50 times a second: about 15 s of reports


@dataclass(frozen=True, slots=True)
class SharedBooking:
    """A request one router sent to a replica, for the others to count there until it finishes."""
    request_id: str
    replica_id: str
    block_hashes: Sequence[BlockHash]
    num_prompt_tokens: int
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class Publish:
    replica_id: str
    seq: int
    events: list[KVEvent]
    stats: SchedulerStats
    finished: list[FinishedRequest]


@dataclass(frozen=True, slots=True)
class Resync:
    replica_id: str
    seq: int
    block_hashes: list[BlockHash]
    stats: SchedulerStats
    finished: list[FinishedRequest]


@dataclass(frozen=True, slots=True)
class Removal:
    replica_id: str


@dataclass(frozen=True, slots=True)
class Booked:
    follower: str  # who shared it: it is already booked there
    booking: SharedBooking


Entry = Publish | Resync | Removal | Booked


@dataclass(frozen=True, slots=True)
class FeedUpdate:
    epoch: str
    cursor: int  # the follower's next ask starts here
    entries: list[Entry]
    states: list[ReplicaState] | None = None  # instead of the entries it missed: resync every replica first


class RouterFeed:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.epoch = uuid.uuid4().hex
        self._entries: deque[Entry] = deque(maxlen=max_entries)
        self._cursor = 0  # entries recorded so far

    @property
    def cursor(self) -> int:
        return self._cursor

    def record(self, entry: Entry) -> None:
        self._entries.append(entry)
        self._cursor += 1

    def since(self, epoch: str | None, cursor: int, router: Router) -> FeedUpdate:
        """The entries after cursor; every replica's state from router (the owner's) if they are gone."""
        oldest = self._cursor - len(self._entries)
        if epoch != self.epoch or not oldest <= cursor <= self._cursor:
            return FeedUpdate(self.epoch, self._cursor, [], router.replica_states())
        # Followers ask for the newest few entries: index from the deque's right end, where that is cheap.
        unseen = [self._entries[i] for i in range(cursor - oldest, len(self._entries))]
        return FeedUpdate(self.epoch, self._cursor, unseen)


class FeedingRouter(Router):
    """The feed's owner: a Router that records every report it takes, for its followers."""

    def __init__(self, config: PolicyConfig | None = None, block_size: int = 16, *, max_entries: int = MAX_ENTRIES,
                 **kwargs):
        super().__init__(config, block_size, **kwargs)
        self.feed = RouterFeed(max_entries)

    def publish(self, replica_id, seq, events, stats, finished) -> bool:
        self.feed.record(Publish(replica_id, seq, events, stats, finished))
        return super().publish(replica_id, seq, events, stats, finished)

    def resync(self, replica_id, seq, block_hashes, stats, finished) -> None:
        self.feed.record(Resync(replica_id, seq, block_hashes, stats, finished))
        super().resync(replica_id, seq, block_hashes, stats, finished)

    def remove_replica(self, replica_id: str) -> None:
        self.feed.record(Removal(replica_id))
        super().remove_replica(replica_id)

    def follow(self, follower: str, epoch: str | None, cursor: int, bookings: list[SharedBooking]) -> FeedUpdate:
        """A follower's sync: answer what it has not seen, then record the bookings it made since its last one
        (the cursor it gets is past them: it has them already)."""
        update = self.feed.since(epoch, cursor, self)
        if bookings:
            self.share(follower, bookings)
        return FeedUpdate(update.epoch, self.feed.cursor, update.entries, update.states)

    def share(self, follower: str, bookings: list[SharedBooking]) -> None:
        """Record bookings a follower made, for the others to replay."""
        for booking in bookings:
            self.feed.record(Booked(follower, booking))


def replay(router: Router, update: FeedUpdate, follower: str) -> None:
    """Apply a feed update to a follower's Router (its own shared bookings are already there)."""
    for state in update.states or ():
        router.resync(state.replica_id, state.seq, state.block_hashes, state.stats, [], state.host_block_hashes)
    for entry in update.entries:
        match entry:
            case Publish():
                router.publish(entry.replica_id, entry.seq, entry.events, entry.stats, entry.finished)
            case Resync():
                router.resync(entry.replica_id, entry.seq, entry.block_hashes, entry.stats, entry.finished)
            case Removal():
                router.remove_replica(entry.replica_id)
            case Booked(follower=origin, booking=booking) if origin != follower:
                router.book(booking.request_id, booking.block_hashes, booking.replica_id,
                            num_prompt_tokens=booking.num_prompt_tokens, session_id=booking.session_id)
