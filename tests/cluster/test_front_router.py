"""FrontRouter's start: ready before any engine replica is, and the model's details fetched again after a failure."""
import asyncio
from types import SimpleNamespace

import pytest

import cluster.front_router as front_router
from cluster.config import ClusterConfig
from replica.async_engine import ModelInfo

from .fakes import BLOCK_SIZE, VOCAB_SIZE, FakeTokenizer

MODEL_INFO = ModelInfo("fake", 64, VOCAB_SIZE, BLOCK_SIZE)


class FakeEngineHandle:
    """model_info.remote(): waits for `ready`, then fails `failures` times before it answers."""

    def __init__(self, failures: int = 0):
        self.ready = asyncio.Event()
        self.failures = failures
        self.calls = 0
        self.model_info = SimpleNamespace(remote=self._model_info)

    async def _model_info(self) -> ModelInfo:
        self.calls += 1
        await self.ready.wait()
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the engine replica died")
        return MODEL_INFO


async def started(engine: FakeEngineHandle) -> front_router.FrontRouter:
    """As Serve makes a replica of a class whose constructor is a coroutine."""
    router = front_router.FrontRouter.__new__(front_router.FrontRouter)
    await router.__init__(engine, ClusterConfig())
    return router


@pytest.fixture(autouse=True)
def outside_serve(monkeypatch):
    monkeypatch.setattr(front_router.serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))
    monkeypatch.setattr(front_router, "load_checkpoint", lambda model: SimpleNamespace(tokenizer=FakeTokenizer()))


def test_the_router_starts_before_an_engine_answers_and_its_first_route_waits_for_one():
    async def main():
        engine = FakeEngineHandle()
        router = await asyncio.wait_for(started(engine), timeout=5)
        waiting = asyncio.ensure_future(router._prepared())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        engine.ready.set()
        preparer = await asyncio.wait_for(waiting, timeout=5)
        return preparer.model, engine.calls

    assert asyncio.run(main()) == (MODEL_INFO, 1)


def test_a_failed_fetch_of_the_model_is_tried_again_at_the_next_route():
    async def main():
        engine = FakeEngineHandle(failures=1)
        engine.ready.set()
        router = await started(engine)
        with pytest.raises(RuntimeError, match="the engine replica died"):
            await router._prepared()
        preparer = await router._prepared()
        return preparer.model, engine.calls

    assert asyncio.run(main()) == (MODEL_INFO, 2)
