"""PoolPuller: an engine replica's side of pulling prefixes between nodes.

It serves its node's pool to the other nodes (replica/kv_cache/pool_transfer.py) and tells the router actor
where (through its RouterPublisher). Before a request goes to the engine it asks the router whether another
node's pool holds more of the request's prefix than this node does and whether pulling it beats computing it
(Router.pull_source, priced with this replica's measured pull time a token, which its stats carry to the router);
if so it copies those blocks into this node's pool, where the scheduler finds them as any pool hit and loads
them. A pull that fails or takes longer than pull_timeout_s leaves the request to compute them.
"""
import asyncio
import logging
import math
import time

import ray

from replica.async_engine import EngineRequest
from replica.kv_cache.host_pool import HostPool, HostPoolSpec
from replica.kv_cache.pool_transfer import PoolServer, pull_blocks
from replica.scheduler.compute_rate import LoadRate
from router.actor import RouterClient
from router.messages import PoolServed, PullSource

logger = logging.getLogger("ray.serve.prefixserve.pulls")
POOLS_CHECK_INTERVAL_S = 1.0  # a node that starts serving its pool is pulled from after at most this long


class PoolPuller:
    def __init__(self, replica_id: str, spec: HostPoolSpec, router: RouterClient, block_size: int,
                 timeout_s: float):
        """router: a client of the router actor's feed of its own (a failed pull resets it)."""
        self._replica_id = replica_id
        self._pool = HostPool(spec)
        self._server = PoolServer(self._pool)
        self._router = router
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._rate = LoadRate(time.monotonic)
        self.served: PoolServed | None = None  # where, once started
        self.num_pulled_tokens = 0
        self.num_failures = 0
        self._any_pools_elsewhere = False
        self._pools_checked_at = -math.inf

    def start(self) -> None:
        """Serves the pool on this node's address."""
        address = self._server.start(ray.util.get_node_ip_address())
        self.served = PoolServed(address, f"{ray.get_runtime_context().get_node_id()}:{self._pool.spec.path}")

    def close(self) -> None:
        self._server.close()
        self._pool.close()

    def seconds_per_token(self) -> float | None:
        """The recent pulls' time a token (the router prices this replica's pulls with it); None before any."""
        return self._rate.seconds_per_token()

    async def pull_for(self, request: EngineRequest) -> None:
        if not request.block_hashes:
            return
        try:
            await asyncio.wait_for(self._pull(request), self._timeout_s)
        except Exception as exc:  # the engine computes what did not come
            self.num_failures += 1
            self._router.reset()  # a call cut short leaves its connection unusable
            logger.warning("replica %s could not pull blocks of request %s: %r", self._replica_id,
                           request.request_id, exc)

    async def _pull(self, request: EngineRequest) -> None:
        feed = await self._router.get("pulls")
        if not await self._pools_elsewhere(feed):
            return
        source: PullSource | None = await feed.call("pull_source", self._replica_id, request.block_hashes)
        if source is None:
            return
        started = time.monotonic()
        wanted = request.block_hashes[source.start:source.start + source.num_blocks]
        num_pulled = await asyncio.to_thread(pull_blocks, source.address, wanted, self._pool, self._timeout_s)
        if num_pulled:
            self._rate.loaded(num_pulled * self._block_size, time.monotonic() - started)
            self.num_pulled_tokens += num_pulled * self._block_size

    async def _pools_elsewhere(self, feed) -> bool:
        """Whether another node serves a pool, asked at most once every POOLS_CHECK_INTERVAL_S: on one node a
        request need not wait for the router's answer to where it could pull from (a round trip of 1-3 ms)."""
        now = time.monotonic()
        if now >= self._pools_checked_at + POOLS_CHECK_INTERVAL_S:
            self._any_pools_elsewhere = await feed.call("pools_elsewhere", self._replica_id)
            self._pools_checked_at = now
        return self._any_pools_elsewhere
