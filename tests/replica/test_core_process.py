"""ProcessEngine: an engine core in a process of its own (a fake core, then the real one), streamed to callers here:
outputs, rejects, aborts, calls, the step hook's view of the KV cache, and a core that fails or dies."""
import asyncio
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from replica.async_engine import AsyncEngine, EngineDeadError, EngineRequest, ModelInfo
from replica.config import EngineConfig
from replica.core_process import CoreView, EngineCoreLost, ProcessEngine, Step, core_of
from replica.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, hash_token_blocks
from replica.request import SamplingParams
from tests.cluster.fakes import BLOCK_SIZE, HASH_SEED, FakeEngineCore, output_text


def engine_request(request_id: str, max_tokens: int = 3, prompt: list[int] | None = None) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3] if prompt is None else prompt, [], SamplingParams(max_tokens=max_tokens))


def run(test, make_core=FakeEngineCore, **kwargs):
    async def main():
        engine = await ProcessEngine.start(make_core, **kwargs)
        try:
            return await test(engine)
        finally:
            await engine.shutdown()
    return asyncio.run(main())


async def collect(engine, request: EngineRequest) -> list:
    return [output async for output in engine.generate(request)]


def aborted(core: FakeEngineCore) -> list[str]:
    return core.aborted


def cached(core: FakeEngineCore) -> list[bytes]:
    return core.cached_block_hashes()


def fail(core) -> None:
    raise KeyError("no such thing")


def pid(core) -> int:
    return os.getpid()


def test_streams_each_request_until_finished_from_a_process_of_its_own():
    async def test(engine):
        outputs = await asyncio.gather(collect(engine, engine_request("a", 3)), collect(engine, engine_request("b", 2)))
        return outputs, engine.model_info(), await engine.call(pid)

    (outputs_a, outputs_b), model_info, core_pid = run(test)
    assert [o.new_text for o in outputs_a] == [output_text(i) for i in range(3)]
    assert [o.finished for o in outputs_a] == [False, False, True]
    assert [o.new_token_ids for o in outputs_b] == [[100], [101]] and outputs_b[-1].finish_reason == "length"
    assert model_info == ModelInfo("fake", 1024, 200, BLOCK_SIZE, HASH_SEED)
    assert core_pid != os.getpid()


def test_a_rejected_request_raises_to_its_caller_only():
    async def test(engine):
        return await asyncio.gather(collect(engine, engine_request("bad", prompt=[])),
                                    collect(engine, engine_request("good", 2)), return_exceptions=True)

    bad, good = run(test)
    assert isinstance(bad, ValueError) and str(bad) == "the prompt is empty"
    assert [o.new_token_ids for o in good] == [[100], [101]]


def test_a_caller_going_away_aborts_its_request_in_the_core():
    async def test(engine):
        stream = engine.generate(engine_request("a", 10**6))  # the fake steps in microseconds
        first = await anext(stream)
        await stream.aclose()
        return first, await engine.call(aborted)

    first, aborted_ids = run(test)
    assert first.new_token_ids == [100] and aborted_ids == ["a"]


def test_a_call_runs_in_the_core_and_brings_back_its_error():
    async def test(engine):
        with pytest.raises(KeyError, match="no such thing"):
            await engine.call(fail)
        return await collect(engine, engine_request("a", 1))

    assert [o.new_token_ids for o in run(test)] == [[100]]


def parents_main_module_ran(core) -> bool:
    return sys.modules["__main__"].__name__ == "__mp_main__"  # spawn's name for the parent's main, run again


SERVING_SCRIPT = """
import asyncio
from replica.core_process import ProcessEngine
from tests.cluster.fakes import FakeEngineCore
from tests.replica.test_core_process import parents_main_module_ran
print("the main module ran", flush=True)

async def main():
    engine = await ProcessEngine.start(FakeEngineCore)
    try:
        print("in the core process:", await engine.call(parents_main_module_ran))
    finally:
        await engine.shutdown()

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_the_core_process_does_not_run_the_parents_main_module_again(tmp_path):
    """A Serve replica's main module is Ray's worker script: run again in the core process, its imports took
    a fifth of a second or more of the core's start."""
    script = tmp_path / "serving.py"
    script.write_text(SERVING_SCRIPT)
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(repo)})
    assert done.stdout.splitlines() == ["the main module ran", "in the core process: False"], done.stderr


def test_the_step_hook_sees_the_cores_kv_events_and_cached_blocks():
    seen: list[tuple[int, list[bytes]]] = []

    def record(view: CoreView) -> None:
        seen.append((len(view.take_kv_events()), view.cached_block_hashes()))

    async def test(engine):
        await collect(engine, engine_request("a", 2, prompt=list(range(2 * BLOCK_SIZE + 1))))
        return await engine.call(cached)

    core_cached = run(test, after_step=record)
    assert core_cached == hash_token_blocks(list(range(2 * BLOCK_SIZE + 1)), BLOCK_SIZE, seed=HASH_SEED)
    counts = [count for count, _ in seen]
    assert counts[0] == sum(counts) == 1  # the blocks stored when the request came, in the first step's message
    assert seen[-1][1] == core_cached


def test_a_failing_step_fails_every_stream_and_the_engine():
    async def test(engine):
        results = await asyncio.gather(collect(engine, engine_request("a")), collect(engine, engine_request("b")),
                                       return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await collect(engine, engine_request("c"))
        return results, engine.error

    results, error = run(test, functools.partial(FakeEngineCore, fail_step=True))
    assert all(type(result) is EngineDeadError for result in results)  # not lost: it would fail elsewhere too
    assert "the model crashed" in str(error)


def test_a_core_process_that_dies_fails_its_streams():
    async def test(engine):
        stream = engine.generate(engine_request("a", 10**6))
        await anext(stream)
        os.kill(await engine.call(pid), signal.SIGKILL)
        with pytest.raises(EngineCoreLost, match=f"exited \\(code {-signal.SIGKILL}\\)"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.call(pid)

    run(test)


def test_a_core_that_cannot_start_raises_its_error():
    async def main():
        await ProcessEngine.start(core_of(EngineConfig(model="/nonexistent/model.gguf")))

    with pytest.raises(Exception, match="nonexistent"):
        asyncio.run(main())


@pytest.mark.slow
def test_the_real_core_in_its_process_gives_the_tokens_it_gives_in_this_one():
    from replica.engine import EngineCore

    config = EngineConfig(dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    requests = [EngineRequest(f"r{index}", [1, 2, 3 + index] * 5, [], SamplingParams(max_tokens=8, temperature=0))
                for index in range(3)]

    async def tokens(engine) -> list[list[int]]:
        outputs = await asyncio.gather(*(collect(engine, request) for request in requests))
        return [[token for output in stream for token in output.new_token_ids] for stream in outputs]

    async def in_thread():
        engine = AsyncEngine(EngineCore(config))
        try:
            return await tokens(engine)
        finally:
            await engine.shutdown()

    here = asyncio.run(in_thread())
    assert run(tokens, core_of(config)) == here and all(len(stream) == 8 for stream in here)


def test_the_view_keeps_the_node_pools_blocks_apart_and_reports_them_all_after_a_resync_read():
    view = CoreView()
    device, host = hash_token_blocks(list(range(8)), 4), hash_token_blocks(list(range(100, 112)), 4)
    view.apply(Step([], [BlockStored(device, None, [], 4), BlockStored(host, None, [], 4, "host")], None))
    view.apply(Step([], [BlockRemoved(host[:1], "host")], None))
    assert len(view.take_kv_events()) == 3
    assert view.cached_block_hashes() == device  # what a resync sends: the device's blocks
    view.apply(Step([], [BlockRemoved(device[:1])], None))
    assert view.take_kv_events() == [BlockRemoved(device[:1]), AllBlocksCleared("host"),
                                     BlockStored(host[1:], None, [], 4, "host")]
    assert view.take_kv_events() == []
