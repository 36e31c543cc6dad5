"""PrefixAwareRequestRouter: Ray Serve's request router for the engine deployment.

It runs inside every process holding a handle to the engines (each ingress replica) and decides
there, on that process's FollowingRouter: no call to another process sits between a request's
arrival and its dispatch. The router actor only feeds every ingress the engines' reports and the
bookings of the others, in the background. Replicas that leave are removed from the view.
"""
import asyncio
from collections.abc import Iterable
from typing import Any, Protocol

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from replica.kv_cache import BlockHash
from router.actor import RouterClient
from router.follower import following_router
from router.policy import PolicyConfig


class Routable(Protocol):
    """What the router reads from a request: the first argument of the engine call."""
    request_id: str
    num_tokens: int  # to compute before it generates: its prompt, and the output of a migrated request
    block_hashes: list[BlockHash]  # of those tokens' full blocks
    session_id: str | None
    route_to: str | None  # the replica it must go to while it is there
    lost_on: str | None  # the replica it must not go back to, unless it is the only one


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, policy: dict[str, Any] | None = None, block_size: int = 16,
                         sync_interval_s: float = 0.02, feed: RouterClient | None = None) -> None:
        """Serve passes RequestRouterConfig.request_router_kwargs here; `feed` is for tests."""
        config = PolicyConfig.model_validate(policy or {})
        self._following = following_router(self.app_name, config, block_size, sync_interval_s, feed)
        self._choices: dict[str, str] = {}  # request id -> the replica chosen, until Serve routes it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._following.start(asyncio.get_running_loop())  # Serve's routing loop, which the first call runs on
        await self._following.wake()
        request = _routable(pending_request)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if request.lost_on in by_id and len(by_id) > 1:
            lost = by_id.pop(request.lost_on)
            candidate_replicas = [replica for replica in candidate_replicas if replica is not lost]
        decision = self._following.choose(request.request_id, request.block_hashes, list(by_id),
                                          num_prompt_tokens=request.num_tokens, session_id=request.session_id,
                                          route_to=request.route_to)
        chosen = by_id[decision.replica_id]
        self._choices[request.request_id] = decision.replica_id
        # Should the chosen replica refuse (queue full), Serve moves on to the second tier.
        return [[chosen], [replica for replica in candidate_replicas if replica is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Where Serve sent the request: if not where it was chosen, its booking moves there."""
        request = _routable(pending_request)
        chosen = self._choices.pop(request.request_id, None) if request is not None else None
        if chosen is not None and chosen != replica_id.unique_id:
            self._following.routed(request.request_id, replica_id.unique_id, request.block_hashes,
                                   num_prompt_tokens=request.num_tokens, session_id=request.session_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = self._replica_id_set - {replica.replica_id for replica in replicas}
        super().update_replicas(replicas)
        self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget([replica_id])

    def _forget(self, replica_ids: Iterable[ReplicaID]) -> None:
        for replica_id in replica_ids:
            self._following.remove_replica(replica_id.unique_id)


def _routable(pending_request: PendingRequest | None) -> Routable | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if hasattr(request, "block_hashes") else None
