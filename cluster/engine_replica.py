"""EngineReplica: the class of the engine deployment; one EngineCore per Serve replica."""
import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator

from ray import serve

from cluster.config import ClusterConfig
from cluster.publisher import RouterPublisher
from cluster.tp_workers import RayExecutor
from replica.async_engine import AsyncEngine, EngineOutput, EngineRequest, ModelInfo, ReplicaStats
from replica.config import EngineConfig
from replica.core_process import ProcessEngine, core_of
from replica.engine import EngineCore
from router.actor import RouterClient


class EngineReplica:
    async def __init__(self, config: ClusterConfig):
        self._engine: AsyncEngine | ProcessEngine | None = None  # Serve may stop a replica while its model loads
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        engine_config = replica_engine_config(config)
        self._publisher = RouterPublisher(
            self.replica_id,
            RouterClient(context.app_name, config.routing_config, engine_config.cache.block_size, create=False),
            send_interval_s=config.publish_interval_s)
        if config.engine_core == "process" and engine_config.tensor_parallel_size == 1:
            self._engine = await ProcessEngine.start(core_of(engine_config), after_step=self._publisher.record)
        else:
            core = await asyncio.to_thread(EngineCore, engine_config, make_executor=RayExecutor)  # seconds
            self._engine = AsyncEngine(core, after_step=functools.partial(self._publisher.record, core))
        self._stream_interval_s = config.stream_interval_s

    def model_info(self) -> ModelInfo:
        return self._engine.model_info()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The request's outputs, the first naming this replica; a caller going away aborts it."""
        num_cached_tokens = None
        try:
            async for output in self._engine.generate(request, self._stream_interval_s):
                if num_cached_tokens is None:  # the first output
                    output.replica_id = self.replica_id
                num_cached_tokens = output.num_cached_tokens
                yield output
        finally:
            self._publisher.request_finished(request.request_id, num_cached_tokens)

    async def record_routing_stats(self) -> dict[str, float]:
        return dataclasses.asdict(await self._engine.call(EngineCore.stats))

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


def replica_engine_config(config: ClusterConfig) -> EngineConfig:
    """The engine's config; a tensor-parallel replica's ranks hold its GPUs, so its own actor sees none."""
    engine = config.engine
    if engine.tensor_parallel_size > 1 and engine.device is None and config.replica_num_gpus:
        return engine.model_copy(update={"device": "cuda"})
    return engine

