"""RouterPublisher: an engine replica's side of the router protocol.

After every engine step the replica sends the router actor its KV events as batch seq = 1, 2,
3..., with its stats and the requests that finished. Sending never waits: the actor's reply is
looked at when it arrives. A reply saying the router lost track (a gap, a router that restarted)
or a batch that never arrived makes the next publish a resync: the replica's full list of cached
block hashes instead of events.
"""
import asyncio
import functools
import logging
from typing import TYPE_CHECKING

from router.actor import RouterClient
from router.messages import FinishedRequest

if TYPE_CHECKING:
    from replica.engine import EngineCore

logger = logging.getLogger("ray.serve.prefixserve.publisher")


class RouterPublisher:
    def __init__(self, replica_id: str, router: RouterClient):
        self.replica_id = replica_id
        self._router = router
        self._seq = 0
        self._needs_resync = False
        self._resync_seq = 0  # replies to batches sent before this resync are stale
        self._finished: list[FinishedRequest] = []
        self._router_unreachable = False  # warned once, until it is reached again

    def request_finished(self, request_id: str, num_cached_tokens: int | None) -> None:
        """A request ended here (finished or aborted; num_cached_tokens None if it never got scheduled)."""
        self._finished.append(FinishedRequest(request_id, num_cached_tokens))

    async def publish(self, core: "EngineCore") -> None:
        """Call between two engine steps: it reads the core's events, stats and cached hashes."""
        events = core.take_kv_events()
        stats = core.stats()
        finished, self._finished = self._finished, []
        try:
            router = await self._router.get()
        except Exception as exc:
            if not self._router_unreachable:
                logger.warning("replica %s cannot reach the router actor: %r; looking it up again after every "
                               "step", self.replica_id, exc)
            self._router_unreachable = True
            self._needs_resync = True  # this step's events are lost
            return
        if self._router_unreachable:
            logger.warning("replica %s reached the router actor again", self.replica_id)
            self._router_unreachable = False
        self._seq += 1
        if self._needs_resync:
            self._needs_resync = False
            self._resync_seq = self._seq
            self._send(router.resync, core.cached_block_hashes(), stats, finished)
        else:
            self._send(router.publish, events, stats, finished)

    def _send(self, method, payload: list, stats, finished: list[FinishedRequest]) -> None:
        ref = method.remote(self.replica_id, self._seq, payload, stats, finished)
        reply = asyncio.wrap_future(ref.future())
        reply.add_done_callback(functools.partial(self._on_reply, self._seq))

    def _on_reply(self, seq: int, reply: asyncio.Future) -> None:
        if reply.cancelled() or seq < self._resync_seq:
            return
        if reply.exception() is not None:
            logger.warning("replica %s lost batch %d: %r", self.replica_id, seq, reply.exception())
            self._router.reset()
            self._needs_resync = True
        elif reply.result() is False:
            self._needs_resync = True
