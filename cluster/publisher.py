"""RouterPublisher: an engine replica's side of the router protocol.

Between two engine steps the engine loop records what the step changed (its KV events, its stats)
and the publisher adds the requests that finished; it never waits for the router. One sender task
sends that to the router actor's feed (router/wire.py) as batch seq = 1, 2, 3..., one batch in flight
at a time, and no sooner than send_interval_s after the last one was sent: whatever accumulated
meanwhile goes as the next one, so a slow router or a busy engine sends fewer, larger batches. A
reply saying the router lost track (a gap, a router that restarted), a batch that failed, or a router
that cannot be found makes the next batch a resync: the replica's full list of cached block hashes,
read at the next step boundary, instead of events. An unreachable router is looked up again no
sooner than retry_interval_s later. A replica that serves its node's pool to other nodes tells each
connection where, before its first batch.
"""
import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from replica.kv_cache import BlockHash, KVEvent
from replica.scheduler import SchedulerStats
from router.actor import RouterClient
from router.messages import FinishedRequest

if TYPE_CHECKING:
    from cluster.pulls import PoolPuller
    from replica.core_process import CoreView
    from replica.engine import EngineCore
    from router.wire import FeedConnection

logger = logging.getLogger("ray.serve.prefixserve.publisher")


class RouterPublisher:
    def __init__(self, replica_id: str, router: RouterClient, *, retry_interval_s: float = 1.0,
                 send_interval_s: float = 0.0, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        """Call on the event loop the engine runs on: it starts the sender task there."""
        self.replica_id = replica_id
        self._router = router
        self._retry_interval_s = retry_interval_s
        self._send_interval_s = send_interval_s
        self._sleep = sleep
        self._seq = 0
        self._events: list[KVEvent] = []
        self._stats: SchedulerStats | None = None
        self._finished: list[FinishedRequest] = []
        self._resync_wanted = False  # the next record() reads the cached block hashes
        self._resync_hashes: list[BlockHash] | None = None  # read: the next batch is a resync
        self._recorded = asyncio.Event()  # something to send since the sender last took a batch
        self._router_unreachable = False  # warned once, until it is reached again
        self.puller: "PoolPuller | None" = None  # serving this node's pool, if the replica does: where, and counts
        self._told_pool_served: "FeedConnection | None" = None  # the connection the router actor last heard it on
        self._sender = asyncio.get_running_loop().create_task(self._send_forever())

    def request_finished(self, request_id: str, num_cached_tokens: int | None) -> None:
        """A request ended here (finished or aborted; num_cached_tokens None if it never got scheduled)."""
        self._finished.append(FinishedRequest(request_id, num_cached_tokens))

    def record(self, core: "EngineCore | CoreView") -> None:
        """Call between two engine steps: takes the step's events and the core's stats for the sender (from the
        core, or from its view when it steps in a process of its own)."""
        events = core.take_kv_events()
        if self._resync_wanted:
            self._resync_wanted = False
            self._resync_hashes = core.cached_block_hashes()
            self._events = []  # the hashes cover them
        else:
            self._events += events
        self._stats = core.stats()
        if self.puller is not None:
            self._stats.pulled_tokens = self.puller.num_pulled_tokens
            self._stats.pull_failures = self.puller.num_failures
            self._stats.pull_seconds_per_token = self.puller.seconds_per_token()
        self._recorded.set()

    async def close(self) -> None:
        self._sender.cancel()
        await asyncio.gather(self._sender, return_exceptions=True)

    async def _send_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._recorded.wait()
            self._recorded.clear()
            feed = await self._connect()
            if feed is None:
                await self._sleep(self._retry_interval_s)
                continue
            sent_at = loop.time()
            await self._send(feed)
            if (wait_s := sent_at + self._send_interval_s - loop.time()) > 0:
                await asyncio.sleep(wait_s)

    async def _connect(self) -> "FeedConnection | None":
        try:
            feed = await self._router.get()
        except Exception as exc:
            if not self._router_unreachable:
                logger.warning("replica %s cannot reach the router actor: %r; looking it up again every %ss",
                               self.replica_id, exc, self._retry_interval_s)
            self._router_unreachable = True
            self._want_resync()  # bounds what accumulates while it is gone, and a new one knows nothing
            return None
        if self._router_unreachable:
            logger.warning("replica %s reached the router actor again", self.replica_id)
            self._router_unreachable = False
        return feed

    async def _send(self, feed: "FeedConnection") -> None:
        finished, self._finished = self._finished, []
        self._seq += 1
        if self._resync_hashes is not None:
            method, payload, self._resync_hashes = "resync", self._resync_hashes, None
        else:
            method, payload, self._events = "publish", self._events, []
        try:
            if self.puller is not None and feed is not self._told_pool_served:  # a new actor, perhaps
                await feed.call("serve_pool", self.replica_id, self.puller.served)
                self._told_pool_served = feed
            accepted = await feed.call(method, self.replica_id, self._seq, payload, self._stats, finished)
        except Exception as exc:
            logger.warning("replica %s lost batch %d: %r", self.replica_id, self._seq, exc)
            self._router.reset()
            self._finished[:0] = finished  # the router forgets a finish it cannot match: resending is safe
            self._want_resync()
            return
        if accepted is False:
            self._want_resync()

    def _want_resync(self) -> None:
        # What was recorded before the hashes are read goes nowhere: wait for the record() that reads them.
        self._resync_wanted = True
        self._recorded.clear()
