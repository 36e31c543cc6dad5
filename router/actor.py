"""RouterActor: the one Ray actor per Serve app; the engines' reports in one ordered feed.

Engine replicas publish to it as they step (numbered KV event batches, stats, the requests that
finished; cluster/publisher.py). It keeps them in a Router, so that it knows every replica's state,
and records them in a feed that every ingress replica's request router follows, off the request
path: each ingress routes in its own process on its own copy of that view, and shares its bookings
through the same feed (router/feed.py). A follower with nothing new to read is held (follow's
wait_s) until there is something, so an idle ingress costs next to nothing and news reaches it at once.

Engines and ingress replicas reach the feed through a socket of the actor's (router/wire.py), not
through Ray calls, which cost ten times as much: each caller asks the actor once for its address. Each
connection is served on a thread of its own, so a held sync never holds up a report and a replica's
batches arrive in the order it sent them; a lock keeps reports and syncs apart.

The actor is named after the Serve app and its routing config, and created by an ingress's process
(whichever asks first: get_if_exists). It dies with that process, so it never outlives the app;
engine replicas only look it up. When it dies anyway, routing goes on with each ingress's last
view; the next ingress call creates a fresh one, every replica resyncs into it and every follower
takes its new epoch.
"""
import asyncio
import gc
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import ray
import xxhash
from ray.actor import ActorHandle

from router.feed import Booked, Entry, FeedingRouter, FeedUpdate, SharedBooking
from router.messages import BlockHash, PoolServed, PullSource
from router.policy import PolicyConfig
from router.wire import FeedConnection, FeedServer

NAMESPACE = "prefixserve"
Result = TypeVar("Result")
FEED_METHODS = frozenset({"publish", "resync", "remove_replica", "follow", "share", "serve_pool", "pools_elsewhere",
                         "pull_source"})


class RouterActor(FeedingRouter):
    def __init__(self, config: PolicyConfig, block_size: int, **kwargs):
        super().__init__(config, block_size, **kwargs)
        lock = threading.RLock()  # held while the router or its feed is read or changed
        self._news = threading.Condition(lock)  # anything recorded
        self._shared = threading.Condition(lock)  # bookings recorded
        # Everything imported so far lives as long as the actor: keep the collector off it, so that
        # a full collection walks only what routing creates (the index itself holds no containers).
        gc.freeze()
        self._server: FeedServer | None = None

    def address(self) -> tuple[tuple[str, int], bytes]:
        """Where the feed is served, on this actor's node, and the token a connection starts with."""
        if self._server is None:
            self._server = FeedServer(self, FEED_METHODS, ray.util.get_node_ip_address())
        return self._server.address, self._server.token

    def publish(self, replica_id, seq, events, stats, finished) -> bool:
        return self._recording(super().publish, replica_id, seq, events, stats, finished)

    def resync(self, replica_id, seq, block_hashes, stats, finished) -> None:
        self._recording(super().resync, replica_id, seq, block_hashes, stats, finished)

    def remove_replica(self, replica_id: str) -> None:
        self._recording(super().remove_replica, replica_id)

    def serve_pool(self, replica_id: str, served: PoolServed) -> None:
        with self._news:
            super().serve_pool(replica_id, served)

    def pools_elsewhere(self, replica_id: str) -> bool:
        with self._news:
            return super().pools_elsewhere(replica_id)

    def pull_source(self, replica_id: str, block_hashes: list[BlockHash]) -> PullSource | None:
        with self._news:
            return super().pull_source(replica_id, block_hashes)

    def share(self, follower: str, bookings: list[SharedBooking]) -> None:
        """Bookings as a follower makes them: the others' held syncs return with them at once."""
        with self._news:
            self._recording(super().share, follower, bookings)
            self._shared.notify_all()

    def follow(self, follower: str, epoch: str | None, cursor: int, bookings: list[SharedBooking],
               wait_s: float = 0.0, reports_in_s: float = 0.0) -> FeedUpdate:
        """FeedingRouter.follow, held up to wait_s while there is nothing new for the follower. Another
        follower's booking is answered at once; engines' reports no sooner than reports_in_s from now (the
        follower's interval, counted from its last answer), so a busy feed costs a follower one answer an
        interval."""
        with self._news:
            update = super().follow(follower, epoch, cursor, bookings)  # bookings wake the others in share()
            since = cursor if update.entries else update.cursor  # held reports are answered with what follows
            now = time.monotonic()
            deadline, reports_due = now + wait_s, now + reports_in_s
            while update.states is None:
                news = [entry for entry in update.entries if not _own_booking(entry, follower)]
                if any(isinstance(entry, Booked) for entry in news) or (news and now >= reports_due) or now >= deadline:
                    return update
                if news:  # reports, not due yet: only a booking ends the wait sooner
                    self._shared.wait(timeout=min(reports_due, deadline) - now)
                else:
                    self._news.wait(timeout=deadline - now)
                update, now = self.feed.since(update.epoch, since, self), time.monotonic()
            return update

    def _recording(self, call: Callable[..., Result], *args) -> Result:
        """call(*args) under the lock, then wakes the held syncs to whatever it recorded."""
        with self._news:
            result = call(*args)
            self._news.notify_all()
            return result


def _own_booking(entry: Entry, follower: str) -> bool:
    return isinstance(entry, Booked) and entry.follower == follower


def router_actor_name(app_name: str, config: PolicyConfig, block_size: int) -> str:
    # A redeploy with another policy or block size gets its own actor: the old one, which the
    # old replicas still feed, goes away with them.
    fingerprint = xxhash.xxh3_64_hexdigest(f"{config.model_dump_json()}|{block_size}".encode())
    return f"router:{app_name}:{fingerprint}"


def get_or_create_router(app_name: str, config: PolicyConfig, block_size: int, create: bool = True) -> ActorHandle:
    """The app's RouterActor handle, creating the actor if nobody has yet (unless not create: then
    ValueError). Blocks on Ray's GCS."""
    if not create:
        return ray.get_actor(router_actor_name(app_name, config, block_size), namespace=NAMESPACE)
    return ray.remote(RouterActor).options(
        name=router_actor_name(app_name, config, block_size), namespace=NAMESPACE, get_if_exists=True,
        num_cpus=0, max_restarts=-1,
    ).remote(config, block_size)


class RouterClient:
    """Connections to the app's RouterActor's feed, one a channel, each opened (the actor found, or created)
    on first use and again after reset(). A held call on one channel holds up none on another."""

    def __init__(self, app_name: str, config: PolicyConfig, block_size: int, create: bool = True):
        """create: whether this process creates the actor (and owns it) when there is none."""
        self._args = (app_name, config, block_size, create)
        self._connecting: dict[str, asyncio.Future] = {}
        self._actor: ActorHandle | None = None  # kept: Ray ends an actor once its creator drops this handle

    async def get(self, channel: str = "feed") -> FeedConnection:
        connecting = self._connecting.get(channel)
        if connecting is None:
            connecting = self._connecting[channel] = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(connecting)  # a caller timing out leaves the lookup running
        except Exception:
            if connecting.done() and self._connecting.get(channel) is connecting:
                del self._connecting[channel]
            raise

    def reset(self) -> None:
        """A call failed: the actor may have died (with the process that created it). Connect again next time."""
        connecting, self._connecting = self._connecting, {}
        for future in connecting.values():
            if future.done() and not future.cancelled() and not future.exception():
                future.result().close()

    async def _connect(self) -> FeedConnection:
        actor = await asyncio.to_thread(get_or_create_router, *self._args)
        if self._actor is None or self._actor._actor_id != actor._actor_id:
            self._actor = actor  # a later lookup's handle to the same actor would not keep it alive
        address, token = await asyncio.wrap_future(actor.address.remote().future())
        return await FeedConnection.open(address, token)
