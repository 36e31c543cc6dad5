"""PrefixAwareRequestRouter: Ray Serve's request router for the engine deployment.

It runs inside every process holding a handle to the engines (the ingress) and asks the app's
RouterActor which replica gets each request, without blocking the event loop. When the actor is
slow or gone it falls back to Serve's own choice (the least queued of all candidates), so routing
degrades to load balancing, never to a stall. Replicas that leave are removed from the actor.
"""
import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Protocol

from ray.exceptions import RayActorError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from replica.kv_cache import BlockHash
from router.actor import RouterClient
from router.messages import RoutingDecision
from router.policy import PolicyConfig

logger = logging.getLogger("ray.serve.prefixserve.router")


class Routable(Protocol):
    """What the router reads from a request: the first argument of the engine call."""
    request_id: str
    num_tokens: int  # to compute before it generates: its prompt, and the output of a migrated request
    block_hashes: list[BlockHash]  # of those tokens' full blocks
    session_id: str | None


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, policy: dict[str, Any] | None = None, block_size: int = 16,
                         timeout_s: float = 0.2, router: RouterClient | None = None) -> None:
        """Serve passes RequestRouterConfig.request_router_kwargs here; `router` is for tests."""
        self._policy = PolicyConfig.model_validate(policy or {})
        self._router = router or RouterClient(self.app_name, self._policy, block_size)
        self._timeout_s = timeout_s
        self._actor_ok = True
        self._choices: dict[str, str] = {}  # request id -> the replica the actor chose, until Serve routes it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = _routable(pending_request)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        decision = await self._ask(request, list(by_id))
        chosen = by_id.get(decision.replica_id) if decision is not None else None
        if chosen is None:
            return [candidate_replicas]
        self._choices[request.request_id] = decision.replica_id
        # Should the chosen replica refuse (queue full), Serve moves on to the second tier.
        return [[chosen], [replica for replica in candidate_replicas if replica is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Where Serve sent the request: if not where the actor chose, its booking moves there."""
        request = _routable(pending_request)
        chosen = self._choices.pop(request.request_id, None) if request is not None else None
        if chosen is not None and chosen != replica_id.unique_id:
            # Should this fail, the booking stays where it was until the request finishes.
            self._event_loop.create_task(self._tell("routed", request.request_id, replica_id.unique_id,
                                                    failure="could not move request %s's booking to %s"))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = self._replica_id_set - {replica.replica_id for replica in replicas}
        super().update_replicas(replicas)
        self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget([replica_id])

    async def _ask(self, request: Routable, candidates: list[str]) -> RoutingDecision | None:
        try:
            async with asyncio.timeout(self._timeout_s):
                router = await self._router.get()
                decision = await router.choose.remote(request.request_id, request.block_hashes, candidates,
                                                      num_prompt_tokens=request.num_tokens,
                                                      session_id=request.session_id)
        except Exception as exc:  # slow, dead or unreachable: any of them means Serve routes this one
            if isinstance(exc, RayActorError):
                self._router.reset()
            if self._actor_ok:
                logger.warning("router actor did not answer (%r); falling back to Serve's routing", exc)
            self._actor_ok = False
            return None
        if not self._actor_ok:
            logger.info("router actor answers again; routing by %s", self._policy.policy)
        self._actor_ok = True
        return decision

    def _forget(self, replica_ids: Iterable[ReplicaID]) -> None:
        for replica_id in replica_ids:
            self._event_loop.create_task(self._tell(
                "remove_replica", replica_id.unique_id, failure="could not remove replica %s from the router"))

    async def _tell(self, method: str, *args: str, failure: str) -> None:
        """Call the router actor's method; if that fails, log `failure` (formatted with args) and go on."""
        try:
            router = await self._router.get()
            await getattr(router, method).remote(*args)
        except Exception as exc:
            if isinstance(exc, RayActorError):
                self._router.reset()
            logger.warning(failure + ": %s", *args, exc)


def _routable(pending_request: PendingRequest | None) -> Routable | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if hasattr(request, "block_hashes") else None
