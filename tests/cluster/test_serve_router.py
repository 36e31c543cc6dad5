"""PrefixAwareRequestRouter, Serve's side of routing: it decides in its own process, on a view a fake router
feed keeps current (no Ray cluster)."""
import asyncio
import time
from dataclasses import dataclass, field, replace

import pytest

from tests.router.chains import chain, stored
from tests.router.test_core import stats
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from replica.async_engine import EngineRequest
from replica.request import SamplingParams
from router import follower as follower_module
from router.feed import FeedingRouter, SharedBooking
from router.serve_router import PrefixAwareRequestRouter

from .fakes import FakeRouterClient

DEPLOYMENT = DeploymentID("engine", "app")
REQUEST = EngineRequest("req-1", [1, 2, 3, 4], [b"h" * 16], SamplingParams(), session_id="chat-1")


class FakeRunningReplica:
    max_ongoing_requests = 8

    def __init__(self, unique_id: str):
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


@dataclass
class FakePendingRequest:
    args: list
    kwargs: dict = field(default_factory=dict)


class FakeFeed:
    """The router actor's feed side: a FeedingRouter whose calls can be made to hang. A held sync is
    answered after a short while, whatever happened meanwhile."""

    def __init__(self, hang: bool = False, hold: bool = False):
        """hold: a held sync never ends (the engines say nothing)."""
        self.owner = FeedingRouter(block_size=4)
        self.hang = hang
        self.hold = hold
        self.bookings: list[SharedBooking] = []
        self.removed: list[str] = []
        self.reports_in_s: list[float] = []  # each sync's

    async def call(self, method: str, *args):
        if self.hang:
            await asyncio.Event().wait()
        if method == "remove_replica":
            return self.removed.append(*args)
        if method == "share":
            return self._share(*args)
        return await self._follow(*args)

    def _share(self, follower, bookings):
        self.bookings += bookings
        self.owner.share(follower, bookings)

    async def _follow(self, follower, epoch, cursor, bookings, wait_s=0.0, reports_in_s=0.0):
        self.reports_in_s.append(reports_in_s)
        if self.hold and wait_s > 0:
            await asyncio.Event().wait()
        await asyncio.sleep(min(wait_s, 0.01))
        self._share(follower, bookings)
        return self.owner.follow(follower, epoch, cursor, [])


@pytest.fixture(autouse=True)
def one_process_per_test(monkeypatch):
    monkeypatch.setattr(follower_module, "_FOLLOWERS", {})


def run(test, feed: FakeFeed):
    """test(router, replicas) with a router over replicas a, b, c; the feed synced only when the test says."""
    async def main():
        router = PrefixAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(policy={"policy": "prefix"}, block_size=4, sync_interval_s=3600,
                                feed=FakeRouterClient(feed))
        replicas = [FakeRunningReplica(unique_id) for unique_id in "abc"]
        router.update_replicas(replicas)
        return await test(router, replicas)
    return asyncio.run(main())


def ids(tiers) -> list[list[str]]:
    return [[replica.replica_id.unique_id for replica in tier] for tier in tiers]


async def synced(router) -> None:
    await router._following.sync()


def test_it_decides_in_process_while_the_feed_hangs():
    async def test(router, replicas):
        return await asyncio.wait_for(router.choose_replicas(replicas, FakePendingRequest([REQUEST])), timeout=5)

    feed = FakeFeed(hang=True)
    assert ids(run(test, feed)) == [["a"], ["b", "c"]]
    assert feed.bookings == []


def test_the_replica_the_feed_says_caches_the_prefix_comes_first_and_the_booking_is_shared():
    feed = FakeFeed()
    request = EngineRequest("req-1", list(range(8)), chain(1, 2), SamplingParams(), session_id="chat-1")

    async def test(router, replicas):
        feed.owner.publish("b", 1, [stored(chain(1, 2))], stats(), [])
        await synced(router)
        tiers = await router.choose_replicas(replicas, FakePendingRequest([request]))
        await synced(router)
        return tiers

    assert ids(run(test, feed)) == [["b"], ["a", "c"]]
    assert feed.bookings == [SharedBooking("req-1", "b", chain(1, 2), 8, "chat-1")]


def test_a_request_routed_to_a_replica_puts_it_first_and_books_it_there():
    feed = FakeFeed()
    request = replace(REQUEST, route_to="c")

    async def test(router, replicas):
        tiers = await router.choose_replicas(replicas, FakePendingRequest([request]))
        await synced(router)
        return tiers

    assert ids(run(test, feed)) == [["c"], ["a", "b"]]
    assert feed.bookings == [SharedBooking("req-1", "c", REQUEST.block_hashes, 4, "chat-1")]


def test_a_migrated_request_goes_anywhere_but_the_replica_it_was_lost_on_unless_that_is_the_only_one():
    feed = FakeFeed()
    request = replace(REQUEST, prompt_token_ids=list(range(8)), block_hashes=chain(1, 2), lost_on="b")

    async def test(router, replicas):
        feed.owner.publish("b", 1, [stored(chain(1, 2))], stats(), [])  # b caches all of it
        await synced(router)
        return (await router.choose_replicas(replicas, FakePendingRequest([request])),
                await router.choose_replicas(replicas[1:2], FakePendingRequest([request])))

    elsewhere, alone = run(test, feed)
    assert ids(elsewhere) == [["a"], ["c"]]
    assert ids(alone) == [["b"], []]


def test_a_booking_reaches_the_feed_while_the_sync_is_held():
    feed = FakeFeed(hold=True)

    async def test(router, replicas):
        await router.choose_replicas(replicas, FakePendingRequest([REQUEST]))
        await asyncio.sleep(0.05)

    run(test, feed)
    assert feed.bookings == [SharedBooking("req-1", "a", REQUEST.block_hashes, 4, "chat-1")]


class FakeClock:
    """time.monotonic() of a machine booted boot_s seconds ago, as the follower reads it."""
    def __init__(self, boot_s: float):
        self._booted_at = time.monotonic() - boot_s

    def monotonic(self) -> float:
        return time.monotonic() - self._booted_at


def test_a_sync_asks_for_engine_reports_no_sooner_than_the_interval_after_the_last_answer(monkeypatch):
    monkeypatch.setattr(follower_module, "time", FakeClock(boot_s=60))  # up for less than the interval
    feed = FakeFeed()

    async def test(router, replicas):
        await synced(router)
        await synced(router)

    run(test, feed)  # an interval of an hour
    assert feed.reports_in_s[0] == 0.0 and 3599 < feed.reports_in_s[1] <= 3600, feed.reports_in_s


def test_a_request_serve_sends_to_its_second_tier_moves_its_booking_here_and_for_the_others():
    feed = FakeFeed()

    async def test(router, replicas):
        pending = FakePendingRequest([REQUEST])
        tiers = await router.choose_replicas(replicas, pending)
        router.on_request_routed(pending, tiers[1][0].replica_id, None)  # a refused it: b took it
        await synced(router)
        return [router._following.router.num_in_flight(replica) for replica in "abc"]

    assert run(test, feed) == [0, 1, 0]
    assert [(booking.request_id, booking.replica_id) for booking in feed.bookings] == [("req-1", "a"), ("req-1", "b")]


def test_requests_without_block_hashes_are_left_to_serve():
    async def test(router, replicas):
        return [await router.choose_replicas(replicas, pending) for pending in (None, FakePendingRequest([]))]

    feed = FakeFeed()
    assert [ids(tiers) for tiers in run(test, feed)] == [[["a", "b", "c"]]] * 2
    assert feed.bookings == []


def test_replicas_that_leave_or_die_leave_the_view_and_the_feed():
    feed = FakeFeed()

    async def test(router, replicas):
        feed.owner.publish("a", 1, [stored(chain(1))], stats(), [])
        await synced(router)
        router.update_replicas(replicas[1:])
        router.on_replica_actor_died(replicas[2].replica_id)
        await synced(router)
        return router._following.router.index.match(chain(1))

    assert run(test, feed) == {}
    assert feed.removed == ["a", "c"]


def test_a_router_that_routes_nothing_for_a_while_stops_following_and_catches_up_before_its_next_decision(
        monkeypatch):
    monkeypatch.setattr(follower_module, "DORMANT_AFTER_S", 0.1)
    feed = FakeFeed()
    first = EngineRequest("req-1", list(range(8)), chain(3, 4), SamplingParams())
    second = EngineRequest("req-2", list(range(8)), chain(1, 2), SamplingParams())

    async def test(router, replicas):
        await router.choose_replicas(replicas, FakePendingRequest([first]))
        await asyncio.sleep(0.3)  # past the dormancy, and the held sync that ran into it
        syncs_when_dormant = len(feed.reports_in_s)
        await asyncio.sleep(0.2)
        syncs_while_dormant = len(feed.reports_in_s) - syncs_when_dormant
        feed.owner.publish("c", 1, [stored(chain(1, 2))], stats(), [])
        tiers = await router.choose_replicas(replicas, FakePendingRequest([second]))
        await asyncio.sleep(0.05)
        return syncs_while_dormant, tiers, len(feed.reports_in_s) > syncs_when_dormant + 1

    syncs_while_dormant, tiers, following_again = run(test, feed)
    assert syncs_while_dormant == 0
    assert ids(tiers) == [["c"], ["a", "b"]]  # the report it missed while dormant decided it
    assert following_again


def test_a_dormant_router_still_decides_when_the_feed_hangs(monkeypatch):
    monkeypatch.setattr(follower_module, "DORMANT_AFTER_S", 0.1)
    feed = FakeFeed()

    async def test(router, replicas):
        await router.choose_replicas(replicas, FakePendingRequest([REQUEST]))
        await asyncio.sleep(0.3)
        feed.hang = True
        second = replace(REQUEST, request_id="req-2")
        return await asyncio.wait_for(router.choose_replicas(replicas, FakePendingRequest([second])), timeout=5)

    assert ids(run(test, feed)) == [["a"], ["b", "c"]]  # the session's replica, on the view it had
