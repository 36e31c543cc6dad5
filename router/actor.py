"""RouterActor: the one Ray actor per Serve app; the engines' reports in one ordered feed.

Engine replicas publish to it as they step (numbered KV event batches, stats, the requests that
finished; cluster/publisher.py). It keeps them in a Router, so that it knows every replica's state,
and records them in a feed that every ingress replica's request router follows, off the request
path: each ingress routes in its own process on its own copy of that view, and shares its bookings
through the same feed (router/feed.py). A follower with nothing new to read is held (follow's
wait_s) until there is something, so an idle ingress costs next to nothing and news reaches it at once.
That makes it an async actor: Ray runs all its methods on one event loop thread, the synchronous
ones (publish, resync, remove_replica) whole and in the order each caller sent them, so a replica's
batches still arrive in sequence (and a replica has one in flight at a time anyway).

The actor is named after the Serve app and its routing config, and created by an ingress's process
(whichever asks first: get_if_exists). It dies with that process, so it never outlives the app;
engine replicas only look it up. When it dies anyway, routing goes on with each ingress's last
view; the next ingress call creates a fresh one, every replica resyncs into it and every follower
takes its new epoch.
"""
import asyncio
import gc

import ray
import xxhash
from ray.actor import ActorHandle

from router.feed import FeedingRouter, FeedUpdate, SharedBooking
from router.policy import PolicyConfig

NAMESPACE = "prefixserve"


class RouterActor(FeedingRouter):
    def __init__(self, config: PolicyConfig, block_size: int, **kwargs):
        super().__init__(config, block_size, **kwargs)
        # Everything imported so far lives as long as the actor: keep the collector off it, so that
        # a full collection walks only what routing creates (the index itself holds no containers).
        gc.freeze()

    async def follow(self, follower: str, epoch: str | None, cursor: int, bookings: list[SharedBooking],
                     wait_s: float = 0.0) -> FeedUpdate:
        """FeedingRouter.follow; with nothing new for the follower, held until there is or wait_s passes."""
        update = super().follow(follower, epoch, cursor, bookings)
        if update.entries or update.states is not None or wait_s <= 0:
            return update
        await self.feed.wait_past(update.cursor, wait_s)
        return super().follow(follower, update.epoch, update.cursor, [])


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
    """The app's RouterActor, found (or created) on first use and again after reset()."""

    def __init__(self, app_name: str, config: PolicyConfig, block_size: int, create: bool = True):
        """create: whether this process creates the actor (and owns it) when there is none."""
        self._args = (app_name, config, block_size, create)
        self._lookup: asyncio.Future | None = None

    async def get(self) -> ActorHandle:
        if self._lookup is None:
            self._lookup = asyncio.ensure_future(asyncio.to_thread(get_or_create_router, *self._args))
        try:
            return await asyncio.shield(self._lookup)  # a caller timing out leaves the lookup running
        except Exception:
            if self._lookup.done():
                self._lookup = None
            raise

    def reset(self) -> None:
        """A call failed because the actor died (with the process that created it): look again next time."""
        self._lookup = None
