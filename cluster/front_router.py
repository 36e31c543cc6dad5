"""FrontRouter: the direct front door's router (Serve's ingress request router).

HAProxy hands it each POST's body before forwarding the request; it prepares the body as an engine replica
would (template, tokens, block hashes), makes the prefix-aware decision on its process's FollowingRouter (the
engine deployment's PrefixAwareRequestRouter, through Serve's choose_replica) and answers with the replica,
and the request id the decision was booked under, which the replica then serves the request as. The tokens
then stream from the engine replica to HAProxy to the client: no Serve proxy, no ingress replica between.
"""
import asyncio
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import ReplicaID

from cluster.config import ClusterConfig
from cluster.preparing import RequestPreparer
from cluster.protocol import SESSION_HEADER
from replica.executor.checkpoint import load_checkpoint
from router.follower import running_follower
from router.messages import RouterSnapshot

# Serve's HAProxy strips headers of this prefix from what clients send and sets those the router names.
ROUTED_REQUEST_ID_HEADER = "x-serve-router-request-id"
DEPLOYMENT_NAME = "router"

router_api = FastAPI(openapi_url=None)


@serve.ingress(router_api)
class FrontRouter:
    async def __init__(self, engine: DeploymentHandle, config: ClusterConfig):
        model, checkpoint = await asyncio.gather(
            engine.model_info.remote(), asyncio.to_thread(load_checkpoint, config.engine.model))
        self._preparer = RequestPreparer(checkpoint.tokenizer, model)
        self._engine = engine
        self._app_name = serve.get_replica_context().app_name

    @router_api.post("/internal/route")
    async def route(self, request: Request) -> dict[str, Any]:
        """Serve's contract: {"replica_id": the replica's full id, "request_headers": headers to add}. A body that
        the replicas refuse goes where load alone sends it, to get its 4xx there."""
        raw_body = await request.body()
        session_id = request.headers.get(SESSION_HEADER)
        routable = await self._preparer.off_loop(self._preparer.routable, raw_body, session_id)
        async with self._engine.choose_replica(*(() if routable is None else (routable,)), _reserve=False) as chosen:
            replica_id = ReplicaID(chosen.replica_id, self._engine.deployment_id).to_full_id_str()
        headers = {} if routable is None else {ROUTED_REQUEST_ID_HEADER: routable.request_id}
        return {"replica_id": replica_id, "request_headers": headers}

    async def snapshot(self) -> RouterSnapshot | None:
        """This router's view (the engines' reports through the feed, its decisions); None before its first."""
        follower = running_follower(self._app_name)
        return await follower.snapshot() if follower is not None else None
