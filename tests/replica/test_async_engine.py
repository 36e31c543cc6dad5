"""AsyncEngine over a fake core: streaming, aborts, errors, calls between steps, the after-step hook."""
import asyncio

import pytest

from replica.async_engine import AsyncEngine, EngineDeadError, EngineRequest
from replica.request import SamplingParams

from tests.cluster.fakes import FakeEngineCore, output_text


def engine_request(request_id: str, max_tokens: int = 3, prompt: list[int] | None = None) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3] if prompt is None else prompt, [], SamplingParams(max_tokens=max_tokens))


def run(test, core: FakeEngineCore | None = None, **kwargs):
    """Runs test(engine, core) on a fresh AsyncEngine, shutting it down afterwards."""
    core = core or FakeEngineCore()

    async def main():
        engine = AsyncEngine(core, **kwargs)
        try:
            return await test(engine, core)
        finally:
            await engine.shutdown()
    return asyncio.run(main())


async def collect(engine: AsyncEngine, request: EngineRequest) -> list:
    return [output async for output in engine.generate(request)]


def test_streams_each_request_until_finished():
    async def test(engine, core):
        return await asyncio.gather(collect(engine, engine_request("a", 3)), collect(engine, engine_request("b", 2)))

    outputs_a, outputs_b = run(test)
    assert [o.new_text for o in outputs_a] == [output_text(i) for i in range(3)]
    assert [o.finished for o in outputs_a] == [False, False, True]
    assert [o.new_token_ids for o in outputs_b] == [[100], [101]]
    assert outputs_b[-1].finish_reason == "length"


def test_the_core_gets_the_request_as_the_ingress_built_it():
    request = EngineRequest("a", [1, 2, 3, 4], [b"h" * 16], SamplingParams(max_tokens=3), cache_salt="salt",
                            priority=2, session_id="program", last_turn=True, output_token_ids=[100, 101])

    async def test(engine, core):
        await collect(engine, request)
        return core.added

    assert run(test) == [request]


def test_a_rejected_request_raises_to_its_caller_only():
    async def test(engine, core):
        bad = collect(engine, engine_request("bad", prompt=[]))
        good = collect(engine, engine_request("good", 2))
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = run(test)
    assert isinstance(bad, ValueError) and str(bad) == "the prompt is empty"
    assert len(good) == 2


def test_closing_a_stream_early_aborts_the_request():
    async def test(engine, core):
        stream = engine.generate(engine_request("a", 100))
        await anext(stream)
        await stream.aclose()
        await engine.call(lambda core: None)  # the abort is applied before the next call runs
        return core

    core = run(test)
    assert core.aborted == ["a"]
    assert not core.has_unfinished()


def test_cancelling_the_caller_aborts_the_request():
    async def test(engine, core):
        task = asyncio.create_task(collect(engine, engine_request("a", 100)))
        while core.num_steps < 2:
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.call(lambda core: None)
        return core

    assert run(test).aborted == ["a"]


def test_call_runs_between_steps_with_the_core():
    async def test(engine, core):
        stream = collect(engine, engine_request("a", 5))
        stats = engine.call(lambda core: core.stats().num_running)
        return await asyncio.gather(stream, stats)

    outputs, num_running = run(test)
    assert len(outputs) == 5
    assert num_running == 1


def test_after_step_runs_after_every_step_and_when_idle():
    calls = []

    def after_step():
        calls.append(core.num_steps)

    async def test(engine, core):
        await collect(engine, engine_request("a", 3))
        await asyncio.sleep(0.05)  # idle: a few heartbeats
        return calls

    core = FakeEngineCore()
    calls = run(test, core, after_step=after_step, idle_interval_s=0.01)
    assert calls[:3] == [1, 2, 3]  # after each step
    assert len(calls) >= 5 and set(calls[3:]) == {3}  # idle heartbeats
    assert core.num_idle_pin_sweeps == len(calls) - 3  # every idle heartbeat expires pins first


def test_a_request_arriving_while_idle_runs_the_hook_after_its_step_only():
    calls = []

    def after_step():
        calls.append(core.num_steps)

    async def test(engine, core):
        await asyncio.sleep(0.01)  # the loop waits for work; no heartbeat within the hour
        await collect(engine, engine_request("a", 2))
        await engine.call(lambda _: None)  # a wake for anything else runs it
        return calls

    core = FakeEngineCore()
    assert run(test, core, after_step=after_step, idle_interval_s=3600) == [1, 2, 2]


def test_a_failing_hook_does_not_stop_the_engine():
    def after_step():
        raise ConnectionError("router gone")

    async def test(engine, core):
        return await collect(engine, engine_request("a", 2))

    assert len(run(test, after_step=after_step)) == 2


def test_a_failing_step_fails_every_request_and_the_engine():
    async def test(engine, core):
        first = await asyncio.gather(collect(engine, engine_request("a")), return_exceptions=True)
        with pytest.raises(EngineDeadError, match="the model crashed"):
            await collect(engine, engine_request("b"))
        return first[0], engine.error

    failure, error = run(test, FakeEngineCore(fail_step=True))
    assert isinstance(failure, RuntimeError) and str(failure) == "the model crashed"
    assert error is failure


def test_an_unexpected_error_adding_a_request_reaches_its_caller_and_stops_the_engine():
    class BrokenCore(FakeEngineCore):
        def add_request(self, *args, **kwargs):
            raise RuntimeError("the core is broken")

    async def test(engine, core):
        with pytest.raises(RuntimeError, match="the core is broken"):
            await asyncio.wait_for(collect(engine, engine_request("a")), timeout=10)
        return engine.error

    assert str(run(test, BrokenCore())) == "the core is broken"


class FakeCoreFailingOnStep(FakeEngineCore):
    """A FakeEngineCore whose step number `failing_step` (from 1) raises."""
    def __init__(self, failing_step: int):
        super().__init__()
        self.failing_step = failing_step

    def step(self):
        self.fail_step = self.num_steps + 1 == self.failing_step
        return super().step()


async def collect_coalesced(engine: AsyncEngine, request: EngineRequest, interval_s: float) -> list:
    return [output async for output in engine.generate(request, stream_interval_s=interval_s)]


def test_a_stream_interval_merges_outputs_yet_holds_back_neither_the_first_nor_the_finished_one():
    request = EngineRequest("a", [1, 2, 3], [], SamplingParams(max_tokens=5, logprobs=True, top_logprobs=1))

    async def test(engine, core):
        return await asyncio.wait_for(collect_coalesced(engine, request, interval_s=3600), timeout=10)

    first, rest = run(test)
    assert (first.new_token_ids, first.new_text, first.logprobs, first.finished) == ([100], "t0 ", [-0.25], False)
    assert rest.new_token_ids == [101, 102, 103, 104]
    assert rest.new_text == "t1 t2 t3 t4 "
    assert rest.logprobs == [-0.5, -0.75, -1.0, -1.25]
    assert rest.top_logprobs == [[(101, -0.5)], [(102, -0.75)], [(103, -1.0)], [(104, -1.25)]]
    assert (rest.finished, rest.finish_reason) == (True, "length")


def test_what_was_merged_before_the_engine_failed_is_yielded_then_the_error_raised():
    async def test(engine, core):
        outputs = []
        with pytest.raises(RuntimeError, match="the model crashed"):
            async for output in engine.generate(engine_request("a", 10), stream_interval_s=3600):
                outputs.append(output)
        return outputs

    outputs = run(test, FakeCoreFailingOnStep(failing_step=4))
    assert [output.new_token_ids for output in outputs] == [[100], [101, 102]]
