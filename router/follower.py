"""FollowingRouter: an ingress process's own Router, kept current from the router actor's feed.

Requests are routed on it in this process, with no call to another one. Each booking made here goes to
the feed as it is made, on a connection of its own, and the router actor answers the other ingresses'
held syncs with it at once: K ingresses that do not know of each other's last requests pile bursts
onto one replica (benchmarks/results/routing-sim-routers.md). A background task syncs the rest: it
replays what the engines reported (router/feed.py), which the actor answers no sooner than the interval
after the last answer, and with nothing new it holds a sync until there is (a long poll of up to
LONG_POLL_S), so an idle ingress makes about one call a second. While the actor is slow or gone,
routing goes on with the last view, and this process's own bookings keep counting. A process that has routed
nothing for DORMANT_AFTER_S stops following (Serve's proxy holds a router that the direct front door's HAProxy
passes by: it replayed every booking and report, 0.7 ms of CPU a request, benchmarks/results/path-costs.md);
its next request waits for one sync (WAKE_SYNC_TIMEOUT_S at most) before it is routed, and the following resumes.
"""
import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Sequence

from replica.kv_cache import BlockHash
from router.actor import RouterClient
from router.core import Router
from router.feed import FeedUpdate, SharedBooking, replay
from router.messages import RouterSnapshot, RoutingDecision
from router.policy import PolicyConfig

logger = logging.getLogger("ray.serve.prefixserve.router")

LONG_POLL_S = 1.0
DORMANT_AFTER_S = 10.0
WAKE_SYNC_TIMEOUT_S = 0.25
_FOLLOWERS: dict[str, "FollowingRouter"] = {}  # by app name: one per process, shared by its request routers


class FollowingRouter:
    def __init__(self, router: Router, feed: RouterClient, name: str, interval_s: float):
        self.router = router
        self.name = name
        self._feed = feed
        self._interval_s = interval_s
        self._epoch: str | None = None
        self._cursor = 0
        self._answered_at = -math.inf  # time.monotonic() of the last sync's answer (it starts at boot)
        self._outbox: list[SharedBooking] = []
        self._removed: list[str] = []
        self._feed_ok = True
        self._pusher: asyncio.Task | None = None  # sends the outbox; kept: the loop holds tasks weakly
        self._loop: asyncio.AbstractEventLoop | None = None
        self._syncing = asyncio.Lock()  # one sync at a time: each replays from the cursor the last one left
        self._following: asyncio.Task | None = None  # the syncs in the background, while this process routes
        self._routed_at = time.monotonic()

    @property
    def started(self) -> bool:
        return self._loop is not None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sync on loop from now on (the first call's loop): routing calls come from that loop's thread."""
        if self.started:
            return
        self._loop = loop
        loop.call_soon_threadsafe(self._follow)

    async def wake(self) -> None:
        """Call before each decision, on the routing loop: a follower gone dormant catches up first, unless the
        feed is slow or gone (routing then goes on with the last view)."""
        self._routed_at = time.monotonic()
        if self._following is None or not self._following.done():
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.sync(), WAKE_SYNC_TIMEOUT_S)
        if self._following.done():  # another decision's wake may have resumed it meanwhile
            self._follow()

    def choose(self, request_id: str, block_hashes: Sequence[BlockHash], candidates: Sequence[str], *,
               num_prompt_tokens: int, session_id: str | None, route_to: str | None = None) -> RoutingDecision:
        decision = self.router.choose(request_id, block_hashes, candidates, num_prompt_tokens=num_prompt_tokens,
                                      session_id=session_id, route_to=route_to)
        self._share(SharedBooking(request_id, decision.replica_id, block_hashes, num_prompt_tokens, session_id))
        return decision

    def routed(self, request_id: str, replica_id: str, block_hashes: Sequence[BlockHash], *,
               num_prompt_tokens: int, session_id: str | None) -> None:
        """Serve sent the request elsewhere than chosen: its booking moves, here and for the others."""
        self.router.routed(request_id, replica_id)
        self._share(SharedBooking(request_id, replica_id, block_hashes, num_prompt_tokens, session_id))

    def remove_replica(self, replica_id: str) -> None:
        self.router.remove_replica(replica_id)
        self._removed.append(replica_id)

    async def snapshot(self) -> RouterSnapshot:
        """From any thread: taken on the routing loop, so no routing call runs meanwhile."""
        async def take() -> RouterSnapshot:
            return self.router.snapshot()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(take(), self._loop))

    async def sync(self, wait_s: float = 0.0) -> bool:
        """wait_s: how long the router actor may hold the sync while it has nothing new for this process.
        False if the feed could not be reached."""
        async with self._syncing:
            return await self._sync(wait_s)

    async def _sync(self, wait_s: float) -> bool:
        # once started, bookings go as they are made (_push); before, with the sync
        bookings, self._outbox = ([], self._outbox) if self.started else (self._outbox, [])
        removed, self._removed = self._removed, []
        try:
            feed = await self._feed.get()
            for replica_id in removed:
                await feed.call("remove_replica", replica_id)
            reports_in_s = max(0.0, self._answered_at + self._interval_s - time.monotonic())
            update: FeedUpdate = await feed.call("follow", self.name, self._epoch, self._cursor, bookings, wait_s,
                                                 reports_in_s)
        except Exception as exc:  # the bookings are lost to the others; the replicas' reports will cover them
            self._warn_once(exc)
            self._removed = removed + self._removed
            return False
        if not self._feed_ok:
            logger.info("router feed reached again: %s follows it", self.name)
            self._feed_ok = True
        replay(self.router, update, self.name)
        self._epoch, self._cursor, self._answered_at = update.epoch, update.cursor, time.monotonic()
        return True

    def _follow(self) -> None:
        self._following = self._loop.create_task(self._run())

    async def _run(self) -> None:
        # the router actor paces the syncs that reach it; one that fails waits an interval
        while time.monotonic() - self._routed_at < DORMANT_AFTER_S:
            if not await self.sync(LONG_POLL_S):
                await asyncio.sleep(self._interval_s)

    def _share(self, booking: SharedBooking) -> None:
        self._outbox.append(booking)
        if self.started and (self._pusher is None or self._pusher.done()):
            self._pusher = self._loop.create_task(self._push())

    async def _push(self) -> None:
        """Sends the outbox as it fills, a call at a time, on a connection whose calls are never held."""
        while self._outbox:
            bookings, self._outbox = self._outbox, []
            try:
                feed = await self._feed.get("bookings")
                await feed.call("share", self.name, bookings)
            except Exception as exc:  # lost to the others; the replicas' reports will cover them
                self._warn_once(exc)
                return

    def _warn_once(self, exc: Exception) -> None:
        self._feed.reset()
        if self._feed_ok:
            logger.warning("%s cannot sync with the router feed (%r); routing on its last view", self.name, exc)
        self._feed_ok = False


def following_router(app_name: str, policy: PolicyConfig, block_size: int, interval_s: float,
                     feed: RouterClient | None = None) -> FollowingRouter:
    """This process's FollowingRouter for the app, created (not started) on first call."""
    follower = _FOLLOWERS.get(app_name)
    if follower is None:
        feed = feed or RouterClient(app_name, policy, block_size)
        name = f"{app_name}:{uuid.uuid4().hex[:12]}"
        follower = _FOLLOWERS[app_name] = FollowingRouter(Router(policy, block_size), feed, name, interval_s)
    return follower


def running_follower(app_name: str) -> FollowingRouter | None:
    """This process's started FollowingRouter for the app, if its request router has been set up."""
    follower = _FOLLOWERS.get(app_name)
    return follower if follower is not None and follower.started else None
