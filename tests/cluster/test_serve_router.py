"""PrefixAwareRequestRouter, Serve's side of routing, against a fake router actor (no Ray cluster)."""
import asyncio
from dataclasses import dataclass, field

import pytest
from ray.exceptions import RayActorError
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from replica.async_engine import EngineRequest
from replica.request import SamplingParams
from router.messages import RoutingDecision
from router.serve_router import PrefixAwareRequestRouter

from .fakes import FakeRouterClient

DEPLOYMENT = DeploymentID("engine", "app")
REQUEST = EngineRequest("req-1", [1, 2, 3, 4], [b"h" * 16], SamplingParams(), session_id="chat-1")


class FakeRunningReplica:
    max_ongoing_requests = 8

    def __init__(self, unique_id: str):
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


@dataclass
class FakePendingRequest:
    args: list
    kwargs: dict = field(default_factory=dict)


class FakeRouterActor:
    """Answers choose() with `answer` (a replica id, or an exception to raise, or None to hang)."""

    def __init__(self, answer: str | Exception | None):
        self.answer = answer
        self.chosen: list[tuple] = []
        self.removed: list[str] = []
        self.routed_elsewhere: list[tuple[str, str]] = []

    @property
    def choose(self):
        return FakeMethod(self._choose)

    @property
    def remove_replica(self):
        return FakeMethod(self.removed.append)

    @property
    def routed(self):
        return FakeMethod(lambda request_id, replica_id: self.routed_elsewhere.append((request_id, replica_id)))

    async def _choose(self, request_id, block_hashes, candidates, *, num_prompt_tokens, session_id) -> RoutingDecision:
        self.chosen.append((request_id, block_hashes, candidates, num_prompt_tokens, session_id))
        if self.answer is None:
            await asyncio.Event().wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return RoutingDecision(self.answer, 1, "prefix_hit")


@dataclass
class FakeMethod:
    fn: object

    def remote(self, *args, **kwargs):
        result = self.fn(*args, **kwargs)
        return result if asyncio.iscoroutine(result) else _resolved(result)


async def _resolved(value):
    return value


def run(test, answer):
    """test(router, actor, replicas) with a router over replicas a, b, c."""
    actor = FakeRouterActor(answer)
    client = FakeRouterClient(actor)

    async def main():
        router = PrefixAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(policy={"policy": "prefix"}, block_size=4, timeout_s=0.05, router=client)
        replicas = [FakeRunningReplica(unique_id) for unique_id in "abc"]
        router.update_replicas(replicas)
        result = await test(router, actor, replicas)
        await asyncio.sleep(0)  # let fire-and-forget calls land
        return result
    return asyncio.run(main()), actor, client


def ids(tiers) -> list[list[str]]:
    return [[replica.replica_id.unique_id for replica in tier] for tier in tiers]


async def choose_for_request(router, actor, replicas):
    return await router.choose_replicas(replicas, FakePendingRequest([REQUEST]))


def test_the_actors_choice_comes_first_then_the_others():
    tiers, actor, _ = run(choose_for_request, "b")
    assert ids(tiers) == [["b"], ["a", "c"]]
    assert actor.chosen == [("req-1", REQUEST.block_hashes, ["a", "b", "c"], 4, "chat-1")]


def test_a_request_serve_sends_to_its_second_tier_moves_its_booking():
    async def test(router, actor, replicas):
        pending = FakePendingRequest([REQUEST])
        tiers = await router.choose_replicas(replicas, pending)
        router.on_request_routed(pending, tiers[1][0].replica_id, None)  # b refused it
        other = FakePendingRequest([EngineRequest("req-2", [1], [], SamplingParams())])
        await router.choose_replicas(replicas, other)
        router.on_request_routed(other, replicas[1].replica_id, None)  # where the actor chose

    _, actor, _ = run(test, "b")
    assert actor.routed_elsewhere == [("req-1", "a")]


def test_requests_without_block_hashes_are_left_to_serve():
    async def test(router, actor, replicas):
        return [await router.choose_replicas(replicas, pending) for pending in (None, FakePendingRequest([]))]

    results, actor, _ = run(test, "b")
    assert [ids(tiers) for tiers in results] == [[["a", "b", "c"]]] * 2
    assert actor.chosen == []


@pytest.mark.parametrize("answer, resets", [(None, 0), (RayActorError(), 1)], ids=["slow", "dead"])
def test_a_slow_or_dead_actor_falls_back_to_serves_choice_and_a_dead_one_is_looked_up_again(answer, resets):
    tiers, actor, client = run(choose_for_request, answer)
    assert ids(tiers) == [["a", "b", "c"]]
    assert len(actor.chosen) == 1 and client.resets == resets


def test_a_choice_outside_the_candidates_falls_back():
    async def test(router, actor, replicas):
        return await router.choose_replicas(replicas[:2], FakePendingRequest([REQUEST]))

    tiers, _, _ = run(test, "c")
    assert ids(tiers) == [["a", "b"]]


def test_replicas_that_leave_or_die_are_removed_from_the_actor():
    async def test(router, actor, replicas):
        router.update_replicas(replicas[1:])
        router.on_replica_actor_died(replicas[2].replica_id)

    _, actor, _ = run(test, "b")
    assert actor.removed == ["a", "c"]
