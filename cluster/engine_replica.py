"""EngineReplica: the class of the engine deployment; one EngineCore per Serve replica. DirectEngineReplica: one
that also serves the OpenAI API itself (the direct front door)."""
import asyncio
import dataclasses
import functools
import operator
from collections.abc import AsyncIterator, Callable

import ray
from ray import serve

from cluster import front_router
from cluster.api import build_api
from cluster.config import ClusterConfig
from cluster.engine_client import EngineClient, EnginesBusy, ReplicaLost
from cluster.ingress import ServeEngineClient
from cluster.metrics import ServingMetrics
from cluster.publisher import RouterPublisher
from cluster.pulls import PoolPuller
from cluster.serving import OpenAIServing
from replica.async_engine import AsyncEngine, EngineOutput, EngineRequest, ModelInfo, ReplicaStats
from replica.config import EngineConfig
from replica.core_process import EngineCoreLost, ProcessEngine, core_of
from replica.executor.checkpoint import load_checkpoint
from router.actor import RouterClient

RETRY_AFTER_S = 1.0  # what a 429 tells the client to wait
ROUTER_SNAPSHOT_TIMEOUT_S = 2.0


class EngineReplica:
    async def __init__(self, config: ClusterConfig):
        self._engine: AsyncEngine | ProcessEngine | None = None  # Serve may stop a replica while its model loads
        self._puller: PoolPuller | None = None  # with a node pool: pulls from other nodes' pools, serves its own
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        engine_config = replica_engine_config(config)
        block_size = engine_config.cache.block_size
        router = functools.partial(RouterClient, context.app_name, config.routing_config, block_size, create=False)
        self._publisher = RouterPublisher(self.replica_id, router(), send_interval_s=config.publish_interval_s)
        if config.engine_core == "process" and engine_config.tensor_parallel_size == 1:
            self._engine = await ProcessEngine.start(core_of(engine_config), after_step=self._publisher.record)
        else:  # torch is imported here only: the serving side of a core process runs without it (a second saved)
            from cluster.tp_workers import RayExecutor
            from replica.engine import EngineCore

            core = await asyncio.to_thread(EngineCore, engine_config, make_executor=RayExecutor)  # seconds
            self._engine = AsyncEngine(core, after_step=functools.partial(self._publisher.record, core))
        self._stream_interval_s = config.stream_interval_s
        if (pool := self._engine.model_info().host_pool) is not None:
            self._puller = PoolPuller(self.replica_id, pool, router(), block_size, config.pull_timeout_s)
            self._puller.start()
            self._publisher.puller = self._puller

    def model_info(self) -> ModelInfo:
        return self._engine.model_info()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The request's outputs, the first naming this replica; a caller going away aborts it."""
        num_cached_tokens = None
        if self._puller is not None:
            await self._puller.pull_for(request)
        try:
            async for output in self._engine.generate(request, self._stream_interval_s):
                if num_cached_tokens is None:  # the first output
                    output.replica_id = self.replica_id
                num_cached_tokens = output.num_cached_tokens
                yield output
        finally:
            self._publisher.request_finished(request.request_id, num_cached_tokens)

    async def record_routing_stats(self) -> dict[str, float]:
        return dataclasses.asdict(await self._engine.call(operator.methodcaller("stats")))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return dataclasses.asdict(await self._engine.call(ReplicaStats.of))

    async def check_health(self) -> None:
        if self._engine.error is not None:
            raise RuntimeError(f"the engine loop stopped: {self._engine.error!r}")
        await self._engine.check_health()

    async def __del__(self) -> None:
        if self._engine is not None:
            await self._engine.shutdown()
            await self._publisher.close()
        if self._puller is not None:
            self._puller.close()


@serve.ingress()
class DirectEngineReplica(EngineReplica):
    """HAProxy forwards it the requests its FrontRouter sent here: it prepares them again (the router kept only
    its decision) and streams their tokens straight back. A request it has no room for (max_num_seqs +
    max_waiting_requests under way) gets 429. A request whose engine core dies under this process moves to
    another replica (migration), its tokens relayed through here; the client's connection ends with the process."""

    async def __init__(self, config: ClusterConfig):
        # the tokenizer loads while the engine core starts (a process importing torch and loading the model)
        loading = asyncio.ensure_future(asyncio.to_thread(load_checkpoint, config.engine.model))
        await super().__init__(config)
        checkpoint = await loading
        self._metrics = ServingMetrics()
        context = serve.get_replica_context()
        self._by_reference = config.engine_transport == "ray"
        client = LocalEngineClient(self, config.engine.scheduler.max_num_seqs + config.max_waiting_requests,
                                   elsewhere=self._other_replicas)
        self._serving = OpenAIServing(client, checkpoint.tokenizer, self.model_info(), self._metrics,
                                      max_migrations=config.max_migrations)
        self._api_key = config.resolved_api_key()
        self._max_body_bytes = config.max_request_body_bytes
        self._router = serve.get_deployment_handle(front_router.DEPLOYMENT_NAME, context.app_name)

    def __serve_build_asgi_app__(self):
        return build_api(self._serving, render_metrics=self._render_metrics, api_key=self._api_key,
                         max_body_bytes=self._max_body_bytes,
                         routed_request_id_header=front_router.ROUTED_REQUEST_ID_HEADER)

    @functools.cache
    def _other_replicas(self) -> ServeEngineClient:
        """The engine deployment through a handle of this process, whose router sends a request anywhere but where
        it was lost; made at the first migration (its router then follows the feed as an ingress's does)."""
        context = serve.get_replica_context()
        return ServeEngineClient(serve.get_deployment_handle(context.deployment, context.app_name),
                                 by_reference=self._by_reference)

    async def _render_metrics(self) -> bytes:
        """The series of the requests this replica served, and a router's view; its own alone if none answers."""
        try:
            snapshot = await asyncio.wait_for(self._router.snapshot.remote(), ROUTER_SNAPSHOT_TIMEOUT_S)
        except Exception:  # whatever kept the router from answering, the replica's own series still go out
            snapshot = None
        return self._metrics.render(snapshot)


class LocalEngineClient:
    """An engine replica's own engine as serving's EngineClient, taking at most max_requests at once; a request lost
    on a replica (a migration) goes to elsewhere()."""

    def __init__(self, replica: EngineReplica, max_requests: int, *, elsewhere: Callable[[], EngineClient]):
        self._replica = replica
        self._max_requests = max_requests
        self._num_requests = 0
        self._elsewhere = elsewhere

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if request.lost_on is not None:
            async for output in self._elsewhere().generate(request):
                yield output
            return
        if self._num_requests >= self._max_requests:
            raise EnginesBusy(RETRY_AFTER_S)
        self._num_requests += 1
        try:
            async for output in self._replica.generate(request):
                yield output
        except EngineCoreLost as exc:
            raise ReplicaLost(str(exc)) from None
        finally:
            self._num_requests -= 1


def replica_engine_config(config: ClusterConfig) -> EngineConfig:
    """The engine's config; a tensor-parallel replica's ranks hold its GPUs, so its own actor sees none, and a
    pool path's "{node}" is this node's."""
    engine = config.engine
    if engine.tensor_parallel_size > 1 and engine.device is None and config.replica_num_gpus:
        engine = engine.model_copy(update={"device": "cuda"})
    pool_path = engine.cache.host_pool_path
    if pool_path is not None and "{node}" in pool_path:
        cache = engine.cache.model_copy(update={
            "host_pool_path": pool_path.replace("{node}", ray.get_runtime_context().get_node_id()[:16])})
        engine = engine.model_copy(update={"cache": cache})
    return engine

