"""RouterActor's long poll, without Ray: a follower with nothing new to read is held until a report lands."""
import asyncio
import time

from replica.scheduler import SchedulerStats
from router.actor import RouterActor
from router.feed import SharedBooking
from router.policy import PolicyConfig

STATS = SchedulerStats(num_running=0, num_waiting=0, kv_usage=0.0, num_preemptions=0, prefix_cache_queries=0,
                       prefix_cache_hits=0)
BOOKING = SharedBooking("r1", "a", [b"h" * 16], 16)


async def joined(router: RouterActor, follower: str) -> int:
    """A new follower's first sync, which is never held; its cursor."""
    update = await asyncio.wait_for(router.follow(follower, None, 0, [], wait_s=10), timeout=1)
    assert update.states == []
    return update.cursor


def test_a_held_sync_returns_as_soon_as_a_replica_publishes():
    async def main():
        router = RouterActor(PolicyConfig(), 16)
        held = asyncio.create_task(router.follow("f", router.feed.epoch, await joined(router, "f"), [], wait_s=10))
        await asyncio.sleep(0.05)
        assert not held.done()
        started = time.monotonic()
        assert router.publish("a", 1, [], STATS, [])
        update = await asyncio.wait_for(held, timeout=1)
        return [entry.replica_id for entry in update.entries], update.cursor, time.monotonic() - started
    replica_ids, cursor, waited_s = asyncio.run(main())
    assert (replica_ids, cursor) == (["a"], 1)
    assert waited_s < 0.5


def test_an_idle_sync_returns_nothing_after_its_wait():
    async def main():
        router = RouterActor(PolicyConfig(), 16)
        cursor = await joined(router, "f")
        started = time.monotonic()
        update = await router.follow("f", router.feed.epoch, cursor, [], wait_s=0.1)
        return update, time.monotonic() - started
    update, waited_s = asyncio.run(main())
    assert (update.entries, update.states, update.cursor) == ([], None, 0)
    assert 0.1 <= waited_s < 1


def test_a_booking_wakes_the_other_followers_but_not_the_one_that_shared_it():
    async def main():
        router = RouterActor(PolicyConfig(), 16)
        cursors = {name: await joined(router, name) for name in ("first", "second")}
        other = asyncio.create_task(router.follow("second", router.feed.epoch, cursors["second"], [], wait_s=10))
        await asyncio.sleep(0.01)
        own = await router.follow("first", router.feed.epoch, cursors["first"], [BOOKING], wait_s=0.05)
        return own, await asyncio.wait_for(other, timeout=1)
    own, other = asyncio.run(main())
    assert (own.entries, own.cursor) == ([], 1)
    assert [entry.booking for entry in other.entries] == [BOOKING]
