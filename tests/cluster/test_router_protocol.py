"""Replica <-> router protocol without Ray: RouterPublisher talking to a RouterActor through a fake handle."""
import asyncio
import concurrent.futures
import logging

from cluster.publisher import RouterPublisher
from replica.kv_cache import hash_token_blocks
from replica.request import SamplingParams
from replica.scheduler import SchedulerStats
from router.actor import RouterActor, router_actor_name
from router.messages import FinishedRequest
from router.policy import PolicyConfig

from tests.replica.scheduler_helpers import FakeClock

from .fakes import BLOCK_SIZE, HASH_SEED, FakeEngineCore, FakeRouterClient

STATS = SchedulerStats(num_running=0, num_waiting=0, kv_usage=0.0, num_preemptions=0, prefix_cache_queries=0,
                       prefix_cache_hits=0)


class FakeObjectRef:
    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def future(self) -> concurrent.futures.Future:
        return self._future


class FakeRouterHandle:
    """A RouterActor reached like a Ray actor handle: calls wait until deliver() runs them in order."""

    def __init__(self, actor: RouterActor):
        self.actor = actor
        self.pending: list[tuple[str, tuple, concurrent.futures.Future]] = []
        self.delivered: list[tuple[str, int]] = []  # (method, seq)

    def __getattr__(self, method: str):
        handle = self

        class FakeActorMethod:
            @staticmethod
            def remote(*args) -> FakeObjectRef:
                future = concurrent.futures.Future()
                handle.pending.append((method, args, future))
                return FakeObjectRef(future)

        return FakeActorMethod

    async def deliver(self, *, lose: bool = False) -> None:
        pending, self.pending = self.pending, []
        for method, args, future in pending:
            if lose:
                future.set_exception(ConnectionError("the router actor died"))
            else:
                self.delivered.append((method, args[1]))
                future.set_result(getattr(self.actor, method)(*args))
        for _ in range(3):  # let the replies' callbacks run
            await asyncio.sleep(0)


def new_router() -> RouterActor:
    return RouterActor(PolicyConfig(), BLOCK_SIZE)


def prompt_hashes(prompt: list[int]) -> list[bytes]:
    return hash_token_blocks(prompt, BLOCK_SIZE, seed=HASH_SEED)


def add_prompt(core: FakeEngineCore, request_id: str, prompt: list[int]) -> None:
    core.add_request(request_id, prompt, SamplingParams(max_tokens=1))


def test_batches_are_numbered_and_mirrored_by_the_router():
    async def test():
        core, handle = FakeEngineCore(), FakeRouterHandle(new_router())
        publisher = RouterPublisher("r1", FakeRouterClient(handle))
        add_prompt(core, "a", list(range(8)))
        await publisher.publish(core)
        add_prompt(core, "b", list(range(12)))
        await publisher.publish(core)
        await publisher.publish(core)
        await handle.deliver()
        return handle

    handle = asyncio.run(test())
    assert handle.delivered == [("publish", 1), ("publish", 2), ("publish", 3)]
    assert handle.actor.index.match(prompt_hashes(list(range(12)))) == {"r1": 3}


def test_a_lost_batch_makes_the_next_publish_a_resync():
    client = FakeRouterClient(FakeRouterHandle(new_router()))

    async def test():
        core, handle = FakeEngineCore(), client.handle
        publisher = RouterPublisher("r1", client)
        add_prompt(core, "a", list(range(8)))
        await publisher.publish(core)
        await handle.deliver(lose=True)
        add_prompt(core, "b", list(range(100, 108)))
        await publisher.publish(core)
        await handle.deliver()
        await publisher.publish(core)
        await handle.deliver()
        return handle

    handle = asyncio.run(test())
    assert client.resets == 1
    assert handle.delivered == [("resync", 2), ("publish", 3)]
    assert handle.actor.index.match(prompt_hashes(list(range(8)))) == {"r1": 2}
    assert handle.actor.index.match(prompt_hashes(list(range(100, 108)))) == {"r1": 2}


def test_a_new_router_gets_a_resync_once():
    async def test():
        core, handle = FakeEngineCore(), FakeRouterHandle(new_router())
        publisher = RouterPublisher("r1", FakeRouterClient(handle))
        add_prompt(core, "a", list(range(8)))
        await publisher.publish(core)
        await handle.deliver()
        handle.actor = new_router()  # restarted: it knows nothing
        await publisher.publish(core)
        await publisher.publish(core)  # in flight when the first refusal comes back
        await handle.deliver()
        await publisher.publish(core)
        await publisher.publish(core)
        await handle.deliver()
        return handle

    handle = asyncio.run(test())
    assert handle.delivered == [("publish", 1), ("publish", 2), ("publish", 3), ("resync", 4), ("publish", 5)]
    assert handle.actor.index.match(prompt_hashes(list(range(8)))) == {"r1": 2}


def test_an_unreachable_router_is_looked_up_again_then_resynced():
    client = FakeRouterClient(FakeRouterHandle(new_router()), unreachable=3)

    async def test():
        core = FakeEngineCore()
        publisher = RouterPublisher("r1", client)
        add_prompt(core, "a", list(range(8)))
        for _ in range(4):  # the first three lost: no router
            await publisher.publish(core)
        await client.handle.deliver()

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    publisher_logger = logging.getLogger("ray.serve.prefixserve.publisher")  # ray's loggers do not propagate
    publisher_logger.addHandler(handler)
    try:
        asyncio.run(test())
    finally:
        publisher_logger.removeHandler(handler)
    assert client.lookups == 4
    assert client.handle.delivered == [("resync", 1)]
    assert [record.getMessage().split(":")[0] for record in records] == [
        "replica r1 cannot reach the router actor", "replica r1 reached the router actor again"]
    assert client.handle.actor.index.match(prompt_hashes(list(range(8)))) == {"r1": 2}


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
