"""Replica <-> router protocol without Ray: RouterPublisher talking to a RouterActor through a fake handle, fed
by a fake engine core, alone or driven by AsyncEngine."""
import asyncio
import dataclasses
import functools
import logging

from cluster.publisher import RouterPublisher
from replica.async_engine import AsyncEngine, EngineRequest
from replica.kv_cache import BlockStored, hash_token_blocks
from replica.request import SamplingParams
from replica.scheduler import SchedulerStats
from router.actor import RouterActor, router_actor_name
from router.messages import FinishedRequest, PoolServed
from router.policy import PolicyConfig

from tests.replica.scheduler_helpers import FakeClock

from .fakes import BLOCK_SIZE, HASH_SEED, FakeEngineCore, FakeRouterClient

STATS = SchedulerStats(num_running=0, num_waiting=0, kv_usage=0.0, num_preemptions=0, prefix_cache_queries=0,
                       prefix_cache_hits=0)


class FakeFeedConnection:
    """A RouterActor reached like a feed connection: a slow one, whose calls wait until deliver() runs them
    in order."""

    def __init__(self, actor: RouterActor):
        self.actor = actor
        self.pending: list[tuple[str, tuple, asyncio.Future]] = []
        self.delivered: list[tuple[str, int]] = []  # (method, seq)
        self.payloads: list[tuple[list, list[FinishedRequest]]] = []  # (events or hashes, finished) of each

    async def call(self, method: str, *args):
        future = asyncio.get_running_loop().create_future()
        self.pending.append((method, args, future))
        return await future

    async def deliver(self, *, lose: bool = False) -> None:
        pending, self.pending = self.pending, []
        for method, args, future in pending:
            if lose:
                future.set_exception(ConnectionError("the router actor died"))
            elif method == "serve_pool":
                self.delivered.append((method, args[1].pool))
                future.set_result(self.actor.serve_pool(*args))
            else:
                replica_id, seq, payload, stats, finished = args
                self.delivered.append((method, seq))
                self.payloads.append((payload, finished))
                future.set_result(getattr(self.actor, method)(*args))
        await settle()  # the publisher takes the reply, and sends what accumulated meanwhile


class FakeSleep:
    """The publisher's retry wait: it records each delay and lasts until the test calls wake()."""

    def __init__(self):
        self.delays: list[float] = []
        self._woken: asyncio.Event | None = None

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        self._woken = asyncio.Event()
        await self._woken.wait()

    async def wake(self) -> None:
        self._woken.set()
        await settle()


async def settle() -> None:
    """Lets the publisher's sender task run until it waits again."""
    for _ in range(5):
        await asyncio.sleep(0)


def new_router() -> RouterActor:
    return RouterActor(PolicyConfig(), BLOCK_SIZE)


def prompt_hashes(prompt: list[int]) -> list[bytes]:
    return hash_token_blocks(prompt, BLOCK_SIZE, seed=HASH_SEED)


def add_prompt(core: FakeEngineCore, request_id: str, prompt: list[int]) -> None:
    core.add_request(request_id, prompt, SamplingParams(max_tokens=1))


async def record(publisher: RouterPublisher, core: FakeEngineCore) -> None:
    """What the engine loop does after a step."""
    publisher.record(core)
    await settle()


def engine_request(request_id: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, prompt, [], SamplingParams(max_tokens=max_tokens))


async def collect(outputs) -> None:
    async for _ in outputs:
        pass


def stored(prompt: list[int]) -> BlockStored:
    return BlockStored(prompt_hashes(prompt), None, [], BLOCK_SIZE)


def test_batches_are_numbered_and_mirrored_by_the_router():
    async def test():
        core, handle = FakeEngineCore(), FakeFeedConnection(new_router())
        publisher = RouterPublisher("r1", FakeRouterClient(handle))
        add_prompt(core, "a", list(range(8)))
        await record(publisher, core)
        await handle.deliver()
        add_prompt(core, "b", list(range(12)))
        await record(publisher, core)
        await handle.deliver()
        await record(publisher, core)
        await handle.deliver()
        await publisher.close()
        return handle

    handle = asyncio.run(test())
    assert handle.delivered == [("publish", 1), ("publish", 2), ("publish", 3)]
    assert handle.actor.index.match(prompt_hashes(list(range(12)))) == {"r1": 3}


def test_what_accumulates_while_a_batch_is_in_flight_goes_as_the_next_batch():
    async def test():
        core, handle = FakeEngineCore(), FakeFeedConnection(new_router())
        publisher = RouterPublisher("r1", FakeRouterClient(handle))
        add_prompt(core, "a", list(range(4)))
        await record(publisher, core)
        for request_id, prompt in (("b", list(range(10, 14))), ("c", list(range(20, 28)))):
            add_prompt(core, request_id, prompt)
            publisher.request_finished(request_id, 4)
            await record(publisher, core)
        await record(publisher, core)
        num_pending = len(handle.pending)
        await handle.deliver()
        await handle.deliver()
        await publisher.close()
        return handle, num_pending

    handle, num_pending = asyncio.run(test())
    assert num_pending == 1  # batch 1: nothing else is sent before the router answers it
    assert handle.delivered == [("publish", 1), ("publish", 2)]
    assert handle.payloads == [
        ([stored(list(range(4)))], []),
        ([stored(list(range(10, 14))), stored(list(range(20, 28)))],
         [FinishedRequest("b", 4), FinishedRequest("c", 4)]),
    ]


def test_what_is_recorded_within_the_send_interval_goes_as_one_batch_once_it_has_passed():
    async def test():
        core, handle = FakeEngineCore(), FakeFeedConnection(new_router())
        publisher = RouterPublisher("r1", FakeRouterClient(handle), send_interval_s=0.2)
        add_prompt(core, "a", list(range(4)))
        await record(publisher, core)
        await handle.deliver()
        for request_id, prompt in (("b", list(range(10, 14))), ("c", list(range(20, 28)))):
            add_prompt(core, request_id, prompt)
            await record(publisher, core)
        num_pending_within = len(handle.pending)
        await asyncio.sleep(0.3)
        await handle.deliver()
        await publisher.close()
        return handle, num_pending_within

    handle, num_pending_within = asyncio.run(test())
    assert num_pending_within == 0
    assert handle.delivered == [("publish", 1), ("publish", 2)]
    assert handle.payloads[1] == ([stored(list(range(10, 14))), stored(list(range(20, 28)))], [])


def test_a_lost_batch_makes_the_next_batch_a_resync_with_its_finished_requests():
    client = FakeRouterClient(FakeFeedConnection(new_router()))

    async def test():
        core, handle = FakeEngineCore(), client.connection
        publisher = RouterPublisher("r1", client)
        add_prompt(core, "a", list(range(8)))
        publisher.request_finished("a", 0)
        await record(publisher, core)
        await handle.deliver(lose=True)
        add_prompt(core, "b", list(range(100, 108)))
        await record(publisher, core)
        await handle.deliver()
        await record(publisher, core)
        await handle.deliver()
        await publisher.close()
        return handle

    handle = asyncio.run(test())
    assert client.resets == 1
    assert handle.delivered == [("resync", 2), ("publish", 3)]
    assert handle.payloads[0] == (prompt_hashes(list(range(8))) + prompt_hashes(list(range(100, 108))),
                                  [FinishedRequest("a", 0)])
    assert handle.actor.index.match(prompt_hashes(list(range(8)))) == {"r1": 2}
    assert handle.actor.index.match(prompt_hashes(list(range(100, 108)))) == {"r1": 2}


def test_a_new_router_gets_a_resync_once():
    async def test():
        core, handle = FakeEngineCore(), FakeFeedConnection(new_router())
        publisher = RouterPublisher("r1", FakeRouterClient(handle))
        add_prompt(core, "a", list(range(8)))
        await record(publisher, core)
        await handle.deliver()
        handle.actor = new_router()  # restarted: it knows nothing
        for _ in range(3):
            await record(publisher, core)
            await handle.deliver()
        await publisher.close()
        return handle

    handle = asyncio.run(test())
    assert handle.delivered == [("publish", 1), ("publish", 2), ("resync", 3), ("publish", 4)]
    assert handle.actor.index.match(prompt_hashes(list(range(8)))) == {"r1": 2}


@dataclasses.dataclass
class FakePuller:
    """A PoolPuller as its publisher reads it."""
    served: PoolServed
    num_pulled_tokens: int
    num_failures: int
    pull_seconds_per_token: float

    def seconds_per_token(self) -> float:
        return self.pull_seconds_per_token


def test_a_replica_serving_its_node_pool_tells_each_connection_where_and_sends_its_pull_counts_and_rate():
    async def test():
        core, handle = FakeEngineCore(), FakeFeedConnection(new_router())
        client = FakeRouterClient(handle)
        publisher = RouterPublisher("r1", client)
        publisher.puller = FakePuller(PoolServed(("127.0.0.1", 5000), "node-1:/dev/shm/kv"), 32, 1, 0.0005)
        for _ in range(2):
            await record(publisher, core)
            await handle.deliver()
            await handle.deliver()
        first = handle
        client.connection = handle = FakeFeedConnection(handle.actor)  # a new connection (a new actor, perhaps)
        await record(publisher, core)
        await handle.deliver()
        await handle.deliver()
        await publisher.close()
        return first, client

    first, client = asyncio.run(test())
    assert first.delivered == [("serve_pool", "node-1:/dev/shm/kv"), ("publish", 1), ("publish", 2)]
    assert client.connection.delivered == [("serve_pool", "node-1:/dev/shm/kv"), ("publish", 3)]
    assert client.connection.actor._pool_servers == {"r1": PoolServed(("127.0.0.1", 5000), "node-1:/dev/shm/kv")}
    stats = client.connection.actor.snapshot().replicas["r1"].stats
    assert (stats.pulled_tokens, stats.pull_failures, stats.pull_seconds_per_token) == (32, 1, 0.0005)


def test_an_unreachable_router_is_looked_up_once_per_retry_interval_then_resynced():
    client = FakeRouterClient(FakeFeedConnection(new_router()), unreachable=2)
    sleep = FakeSleep()

    async def test():
        core = FakeEngineCore()
        publisher = RouterPublisher("r1", client, retry_interval_s=5.0, sleep=sleep)
        add_prompt(core, "a", list(range(8)))
        lookups = []
        for _ in range(2):
            for _ in range(3):  # steps while the sender waits out the interval
                await record(publisher, core)
            lookups.append(client.lookups)
            await sleep.wake()  # the first time, the lookup fails again
        await client.connection.deliver()
        await publisher.close()
        return lookups

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    publisher_logger = logging.getLogger("ray.serve.prefixserve.publisher")  # ray's loggers do not propagate
    publisher_logger.addHandler(handler)
    try:
        lookups = asyncio.run(test())
    finally:
        publisher_logger.removeHandler(handler)
    assert lookups == [1, 2]
    assert (client.lookups, sleep.delays) == (3, [5.0, 5.0])
    assert client.connection.delivered == [("resync", 1)]
    assert [record.getMessage().split(":")[0] for record in records] == [
        "replica r1 cannot reach the router actor", "replica r1 reached the router actor again"]
    assert client.connection.actor.index.match(prompt_hashes(list(range(8)))) == {"r1": 2}


async def step_two_requests(publisher: RouterPublisher, core: FakeEngineCore) -> AsyncEngine:
    """Runs "a" (5 steps) and "b" (1 step, added after a's first) on an AsyncEngine publishing through publisher."""
    engine = AsyncEngine(core, after_step=functools.partial(publisher.record, core), idle_interval_s=3600)
    outputs = engine.generate(engine_request("a", list(range(4)), max_tokens=5))
    await anext(outputs)
    await collect(engine.generate(engine_request("b", list(range(10, 14)), max_tokens=1)))
    await collect(outputs)
    return engine


def test_the_engine_steps_on_while_the_router_has_not_answered():
    async def test():
        core, handle = FakeEngineCore(), FakeFeedConnection(new_router())
        publisher = RouterPublisher("r1", FakeRouterClient(handle))
        engine = await step_two_requests(publisher, core)
        num_steps_unanswered = core.num_steps
        await handle.deliver()
        await handle.deliver()
        await engine.shutdown()
        await publisher.close()
        return handle, num_steps_unanswered

    handle, num_steps_unanswered = asyncio.run(test())
    assert num_steps_unanswered == 5  # every step of "a" ("b" shares its second) while batch 1 is unanswered
    assert handle.delivered == [("publish", 1), ("publish", 2)]
    assert [events for events, _ in handle.payloads] == [[stored(list(range(4)))], [stored(list(range(10, 14)))]]


def test_the_engine_steps_on_while_the_router_is_being_looked_up():
    async def test():
        core, handle = FakeEngineCore(), FakeFeedConnection(new_router())
        client = FakeRouterClient(handle, gate=asyncio.Event())
        publisher = RouterPublisher("r1", client)
        engine = await step_two_requests(publisher, core)
        unanswered = (core.num_steps, client.lookups)
        client.gate.set()
        await settle()
        await handle.deliver()
        await engine.shutdown()
        await publisher.close()
        return handle, unanswered

    handle, (num_steps, num_lookups) = asyncio.run(test())
    assert (num_steps, num_lookups) == (5, 1)
    assert handle.delivered == [("publish", 1)]
    assert [events for events, _ in handle.payloads] == [[stored(list(range(4))), stored(list(range(10, 14)))]]


def test_finished_requests_release_bookings_and_score_predictions():
    router = new_router()
    hashes = prompt_hashes(list(range(12)))
    router.resync("r1", 1, hashes[:2], STATS, [])
    decision = router.choose("req", hashes, ["r1", "r2"])
    assert (decision.replica_id, decision.matched_blocks, decision.outcome) == ("r1", 2, "prefix_hit")
    router.choose("other", [], ["r2"])
    assert router.snapshot().replicas["r1"].num_in_flight == 1

    router.publish("r1", 2, [], STATS, [FinishedRequest("req", 4), FinishedRequest("unknown", 8)])
    snapshot = router.snapshot()
    replica = snapshot.replicas["r1"]
    assert (replica.num_in_flight, replica.predicted_cached_tokens, replica.actual_cached_tokens) == (0, 8, 4)
    assert replica.index_blocks == 2  # what r1 reported stored; the routed request's booking is released
    assert snapshot.decisions == {"prefix_hit": 1, "no_hit": 1}
    assert snapshot.policy == "prefix"


def test_routing_a_request_again_moves_its_booking():
    router = new_router()
    router.resync("r1", 1, [], STATS, [])
    router.resync("r2", 1, [], STATS, [])
    first = router.choose("req", [], ["r1", "r2"])
    second = router.choose("req", [], ["r1", "r2"])
    in_flight = {replica_id: replica.num_in_flight for replica_id, replica in router.snapshot().replicas.items()}
    assert sum(in_flight.values()) == 1
    assert in_flight[second.replica_id] == 1
    assert first.outcome == second.outcome == "no_hit"


def test_a_removed_replica_stays_forgotten():
    router = new_router()
    router.resync("r1", 1, prompt_hashes(list(range(8))), STATS, [])
    router.choose("req", [], ["r1"])
    router.remove_replica("r1")
    assert router.publish("r1", 2, [], STATS, [FinishedRequest("req", 0)]) is True  # not asked to resync
    router.resync("r1", 3, prompt_hashes(list(range(8))), STATS, [])
    assert router.snapshot().replicas == {}
    assert router.choose("x", prompt_hashes(list(range(8))), ["r2"]).matched_blocks == 0


def test_each_routing_config_of_an_app_has_its_own_router_actor():
    name = router_actor_name("app", PolicyConfig(), 16)
    assert name.startswith("router:app:")
    assert router_actor_name("app", PolicyConfig(), 16) == name
    assert len({name, router_actor_name("app", PolicyConfig(policy="round_robin"), 16),
                router_actor_name("app", PolicyConfig(), 32), router_actor_name("other", PolicyConfig(), 16)}) == 4


def test_bookings_whose_finish_never_comes_expire():
    clock = FakeClock()
    router = RouterActor(PolicyConfig(), BLOCK_SIZE, clock=clock)
    router.resync("r1", 1, [], STATS, [])
    router.choose("lost", [], ["r1"])
    clock.now = 30.0
    router.choose("kept", [], ["r1"])
    clock.now = PolicyConfig().booking_ttl_s
    router.choose("new", [], ["r1"])
    assert router.snapshot().replicas["r1"].num_in_flight == 2
    router.publish("r1", 2, [], STATS, [FinishedRequest("lost", 0), FinishedRequest("kept", 0)])
    assert router.snapshot().replicas["r1"].num_in_flight == 1
