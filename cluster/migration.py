"""Request migration: a request whose engine replica is lost goes on, on another, from the tokens it produced.

The continuation is the same request carrying those tokens as output_token_ids, with the block hashes of
prompt + output so the router matches its longer prefix. The new replica recomputes them as after a
preemption: they count against max_tokens, stop conditions see them, and its detokenizer releases the
text the lost replica still held back (replica.engine.EngineCore.add_request). The caller reads one
stream: each replica's outputs, each replica's first output naming it.
"""
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable

from cluster.engine_client import EngineClient, ReplicaLost
from replica.async_engine import EngineOutput, EngineRequest, ModelInfo
from replica.kv_cache import hash_token_blocks

logger = logging.getLogger("ray.serve.prefixserve.migration")


class MigratingEngineClient:
    """An EngineClient that moves a request to another replica when its own is lost, at most max_migrations
    times; after that the caller gets ReplicaLost. on_migrate runs at each move."""

    def __init__(self, engine: EngineClient, model: ModelInfo, max_migrations: int, on_migrate: Callable[[], None]):
        self._engine = engine
        self._model = model
        self._max_migrations = max_migrations
        self._on_migrate = on_migrate

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        output_token_ids: list[int] = []
        attempt, num_migrations, replica_id = request, 0, None
        while True:
            try:
                async with contextlib.aclosing(self._engine.generate(attempt)) as outputs:
                    async for output in outputs:
                        replica_id = output.replica_id or replica_id
                        output_token_ids += output.new_token_ids
                        yield output
                return
            except ReplicaLost as exc:
                if num_migrations == self._max_migrations:
                    raise
                num_migrations += 1
                logger.warning("request %s lost its replica after %d tokens (%s); migration %d of %d",
                               request.request_id, len(output_token_ids), exc, num_migrations, self._max_migrations)
                self._on_migrate()
                attempt = self._continuation(request, output_token_ids, replica_id)

    def _continuation(self, request: EngineRequest, output_token_ids: list[int], lost_on: str | None
                      ) -> EngineRequest:
        """The request as another replica than lost_on takes it up once output_token_ids are produced."""
        block_hashes = request.block_hashes + hash_token_blocks(
            request.prompt_token_ids + output_token_ids, self._model.block_size, cache_salt=request.cache_salt,
            seed=self._model.hash_seed, parent_hashes=request.block_hashes)
        return dataclasses.replace(request, output_token_ids=list(output_token_ids), block_hashes=block_hashes,
                                   route_to=None, lost_on=lost_on)
