"""RouterActor's long poll, without Ray: a follower with nothing new to read is held until a report lands,
or another follower's booking."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from replica.scheduler import SchedulerStats
from router.actor import RouterActor
from router.feed import Booked, Publish, SharedBooking
from router.policy import PolicyConfig

STATS = SchedulerStats(num_running=0, num_waiting=0, kv_usage=0.0, num_preemptions=0, prefix_cache_queries=0,
                       prefix_cache_hits=0)
BOOKING = SharedBooking("r1", "a", [b"h" * 16], 16)


def joined(router: RouterActor, follower: str) -> int:
    """A new follower's first sync, which is never held; its cursor."""
    started = time.monotonic()
    update = router.follow(follower, None, 0, [], wait_s=10)
    assert (update.states, time.monotonic() - started < 1) == ([], True)
    return update.cursor


def test_a_held_sync_returns_as_soon_as_a_replica_publishes():
    router = RouterActor(PolicyConfig(), 16)
    with ThreadPoolExecutor(1) as threads:  # as Ray runs follow: on a thread of its own
        held = threads.submit(router.follow, "f", router.feed.epoch, joined(router, "f"), [], wait_s=10)
        time.sleep(0.05)
        assert not held.done()
        started = time.monotonic()
        assert router.publish("a", 1, [], STATS, [])
        update = held.result(timeout=1)
    assert ([entry.replica_id for entry in update.entries], update.cursor) == (["a"], 1)
    assert time.monotonic() - started < 0.5


def test_an_idle_sync_returns_nothing_after_its_wait():
    router = RouterActor(PolicyConfig(), 16)
    cursor = joined(router, "f")
    started = time.monotonic()
    update = router.follow("f", router.feed.epoch, cursor, [], wait_s=0.1)
    assert (update.entries, update.states, update.cursor) == ([], None, 0)
    assert 0.1 <= time.monotonic() - started < 1


def test_a_booking_wakes_the_other_followers_but_not_the_one_that_shared_it():
    router = RouterActor(PolicyConfig(), 16)
    cursors = {name: joined(router, name) for name in ("first", "second")}
    with ThreadPoolExecutor(1) as threads:
        other = threads.submit(router.follow, "second", router.feed.epoch, cursors["second"], [], wait_s=10)
        time.sleep(0.05)
        own = router.follow("first", router.feed.epoch, cursors["first"], [BOOKING], wait_s=0.05)
        assert (own.entries, own.cursor) == ([], 1)
        assert [entry.booking for entry in other.result(timeout=1).entries] == [BOOKING]


def test_a_booking_is_answered_at_once_and_reports_only_after_the_interval():
    router = RouterActor(PolicyConfig(), 16)
    cursors = {name: joined(router, name) for name in ("first", "second")}
    with ThreadPoolExecutor(1) as threads:
        held = threads.submit(router.follow, "second", router.feed.epoch, cursors["second"], [], wait_s=10,
                              reports_in_s=10)
        router.publish("a", 1, [], STATS, [])
        time.sleep(0.05)
        assert not held.done()  # a report, within the interval
        started = time.monotonic()
        router.share("first", [BOOKING])
        update = held.result(timeout=1)
    assert [type(entry) for entry in update.entries] == [Publish, Booked]
    assert time.monotonic() - started < 0.5


def test_a_followers_own_shared_booking_does_not_end_its_hold():
    router = RouterActor(PolicyConfig(), 16)
    cursor = joined(router, "first")
    with ThreadPoolExecutor(1) as threads:
        held = threads.submit(router.follow, "first", router.feed.epoch, cursor, [], wait_s=0.2)
        time.sleep(0.05)
        router.share("first", [BOOKING])
        time.sleep(0.05)
        assert not held.done()
        assert [entry.booking for entry in held.result(timeout=1).entries] == [BOOKING]


def test_reports_within_the_interval_and_other_syncs_do_not_wake_a_held_sync():
    router = RouterActor(PolicyConfig(), 16)
    cursors = {name: joined(router, name) for name in ("first", "second", "third")}
    held_reads, since = [], router.feed.since
    router.feed.since = lambda *args: (threading.current_thread() is not threading.main_thread()
                                       and held_reads.append(args)) or since(*args)
    router.publish("a", 1, [], STATS, [])
    with ThreadPoolExecutor(2) as threads:
        held = [threads.submit(router.follow, name, router.feed.epoch, cursors[name], [], wait_s=10, reports_in_s=10)
                for name in ("second", "third")]
        time.sleep(0.05)
        for seq in range(2, 22):
            router.publish("a", seq, [], STATS, [])
            router.follow("first", router.feed.epoch, cursors["first"] + seq - 1, [])
            time.sleep(0.005)
        router.share("first", [BOOKING])
        updates = [sync.result(timeout=1) for sync in held]
    # each held sync reads the feed twice: with a report not yet due, then once the booking lands
    assert (len(held_reads), [len(update.entries) for update in updates]) == (4, [22, 22])
