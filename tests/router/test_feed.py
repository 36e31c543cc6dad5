"""The router feed: followers replaying the owner's reports see every replica as the owner does, and
count each other's bookings."""
from replica.kv_cache import AllBlocksCleared
from router import FinishedRequest, PolicyConfig, Router
from router.feed import FeedingRouter, SharedBooking, replay

from .chains import BLOCK_SIZE, chain, stored
from .test_core import ARITHMETIC_WEIGHTS, stats

CONFIG = PolicyConfig(**ARITHMETIC_WEIGHTS)


class Follower:
    """A follower's side of the sync, without Ray: its Router, its cursor and the bookings it shares."""

    def __init__(self, name: str, owner: FeedingRouter):
        self.name, self.owner = name, owner
        self.router = Router(CONFIG, BLOCK_SIZE)
        self.epoch, self.cursor, self.outbox = None, 0, []

    def choose(self, request_id: str, block_hashes, candidates) -> str:
        num_prompt_tokens = len(block_hashes) * BLOCK_SIZE
        decision = self.router.choose(request_id, block_hashes, candidates, num_prompt_tokens=num_prompt_tokens)
        self.outbox.append(SharedBooking(request_id, decision.replica_id, block_hashes, num_prompt_tokens))
        return decision.replica_id

    def sync(self):
        bookings, self.outbox = self.outbox, []
        update = self.owner.follow(self.name, self.epoch, self.cursor, bookings)
        replay(self.router, update, self.name)
        self.epoch, self.cursor = update.epoch, update.cursor
        return update


def reports(owner: FeedingRouter) -> None:
    """a caches chain 1-2-3 in two batches, b's batch 2 is lost (refused), then b resyncs with chain 4-5."""
    assert owner.publish("a", 1, [stored(chain(1, 2))], stats(num_running=1), [])
    assert owner.publish("a", 2, [stored(chain(1, 2, 3)[2:])], stats(num_running=2), [])
    assert owner.publish("b", 1, [stored(chain(7))], stats(), [])
    assert not owner.publish("b", 3, [AllBlocksCleared()], stats(), [])
    owner.resync("b", 3, chain(4, 5), stats(num_waiting=1), [])


def views(router: Router) -> dict:
    snapshot = router.snapshot()
    return {"matches": [router.index.match(chain(*keys)) for keys in ((1, 2, 3), (4, 5), (7,))],
            "stats": {replica_id: replica.stats for replica_id, replica in snapshot.replicas.items()}}


def test_a_follower_replaying_the_feed_sees_every_replica_as_the_owner():
    owner = FeedingRouter(CONFIG, BLOCK_SIZE)
    follower = Follower("f", owner)
    assert follower.sync().states == []  # joins: nothing reported yet
    reports(owner)
    update = follower.sync()
    assert (update.cursor, len(update.entries), update.states) == (5, 5, None)
    assert views(follower.router) == views(owner) == {
        "matches": [{"a": 3}, {"b": 2}, {}],
        "stats": {"a": stats(num_running=2), "b": stats(num_waiting=1)}}
    assert owner.publish("b", 4, [stored(chain(4, 5, 6)[2:])], stats(), [])
    assert follower.sync().cursor == 6
    assert follower.router.index.match(chain(4, 5, 6)) == {"b": 3}


def test_a_follower_the_feed_no_longer_reaches_back_to_gets_every_replicas_state():
    owner = FeedingRouter(CONFIG, BLOCK_SIZE, max_entries=2)
    follower = Follower("f", owner)
    follower.sync()
    reports(owner)
    update = follower.sync()
    assert (update.cursor, update.entries, [state.replica_id for state in update.states]) == (5, [], ["a", "b"])
    assert views(follower.router) == views(owner)
    assert follower.sync().states is None


def test_a_restarted_owner_is_a_new_epoch_and_its_followers_start_over_from_its_state():
    owner = FeedingRouter(CONFIG, BLOCK_SIZE)
    follower = Follower("f", owner)
    reports(owner)
    follower.sync()
    follower.owner = restarted = FeedingRouter(CONFIG, BLOCK_SIZE)
    restarted.resync("a", 9, chain(1), stats(), [])
    update = follower.sync()
    assert (update.epoch, update.cursor, [state.seq for state in update.states]) == (restarted.feed.epoch, 1, [9])
    assert follower.router.index.match(chain(1, 2, 3)) == {"a": 1}


def test_followers_count_each_others_bookings_until_the_replica_reports_the_request_finished():
    owner = FeedingRouter(CONFIG, BLOCK_SIZE)
    first, second = Follower("first", owner), Follower("second", owner)
    first.sync()
    second.sync()
    assert first.choose("r1", chain(1, 2), ["a", "b"]) == "a"
    first.sync()
    second.sync()
    assert [router.num_in_flight("a") for router in (first.router, second.router, owner)] == [1, 1, 0]
    assert second.router.index.match(chain(1, 2)) == {"a": 2}  # booked: counted as cached there
    assert second.choose("r2", chain(8), ["a", "b"]) == "b"  # a looks busier to the second router too
    owner.publish("a", 1, [], stats(), [FinishedRequest("r1", 0)])
    first.sync()
    second.sync()  # shares r2's booking: the first router sees it at its next sync
    assert [router.num_in_flight(replica) for router in (first.router, second.router) for replica in "ab"] == [
        0, 0, 0, 1]
    first.sync()
    assert (first.router.num_in_flight("b"), second.router.num_in_flight("b")) == (1, 1)


def test_a_follower_is_past_its_own_bookings_once_it_has_shared_them():
    owner = FeedingRouter(CONFIG, BLOCK_SIZE)
    follower = Follower("f", owner)
    follower.sync()
    follower.choose("r1", chain(1), ["a"])
    assert follower.sync().cursor == owner.feed.cursor == 1
    assert follower.sync().entries == []

