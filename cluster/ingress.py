"""Ingress: the class of the HTTP deployment; it serves the OpenAI API over the engine deployment."""
import asyncio
from collections.abc import AsyncGenerator

import grpc
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from cluster.api import build_api
from cluster.config import ClusterConfig
from cluster.metrics import ServingMetrics
from cluster.engine_client import EnginesBusy, ReplicaLost
from cluster.serving import OpenAIServing
from replica.async_engine import EngineOutput, EngineRequest
from replica.core_process import EngineCoreLost
from replica.executor.checkpoint import load_checkpoint
from router.follower import running_follower


class ServeEngineClient:
    """The engine deployment as serving's EngineClient; requests go through PrefixAwareRequestRouter. by_reference:
    Ray actor tasks and object refs carry them (ClusterConfig.engine_transport "ray"), else Serve's gRPC."""

    def __init__(self, handle: DeploymentHandle, *, by_reference: bool = False):
        self._handle = handle.options(stream=True, _by_reference=by_reference)

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        responses = None
        try:
            responses = self._handle.generate.remote(request)
            async for item in responses:
                yield item
            responses = None  # finished: nothing to cancel
        except EngineCoreLost as exc:  # its engine core's process died: the replica goes too (over gRPC the error
            raise ReplicaLost(str(exc)) from None  # comes as it is, over Ray actor calls as a RayTaskError that is one)
        except RayTaskError as exc:
            raise exc.cause from None  # the engine's own exception, without the remote traceback
        except BackPressureError as exc:  # the engine deployment's max_queued_requests, counted in this process
            responses = None  # never sent; cancelling it would raise this again
            raise EnginesBusy(exc.retry_after_s) from None
        except (RayActorError, ReplicaUnavailableError) as exc:  # died, unreachable, or removed by Serve
            raise ReplicaLost(str(exc)) from None
        except grpc.aio.AioRpcError as exc:  # the gRPC stream broke in a way Serve passes on as it is
            raise ReplicaLost(f"{exc.code().name}: {exc.details()}") from None
        finally:
            if responses is not None:
                responses.cancel()  # also when the client went away: the replica aborts the request


@serve.ingress()
class Ingress:
    async def __init__(self, engine: DeploymentHandle, config: ClusterConfig):
        model, checkpoint = await asyncio.gather(
            engine.model_info.remote(), asyncio.to_thread(load_checkpoint, config.engine.model))
        self._app_name = serve.get_replica_context().app_name
        self._metrics = ServingMetrics()
        client = ServeEngineClient(engine, by_reference=config.engine_transport == "ray")
        self._serving = OpenAIServing(client, checkpoint.tokenizer, model, self._metrics,
                                      max_migrations=config.max_migrations)
        self._api_key = config.resolved_api_key()
        self._max_body_bytes = config.max_request_body_bytes

    def __serve_build_asgi_app__(self):
        return build_api(self._serving, render_metrics=self._render_metrics, api_key=self._api_key,
                         max_body_bytes=self._max_body_bytes)

    async def _render_metrics(self) -> bytes:
        """This ingress's series and its routing view (the engines' reports through the feed, its decisions)."""
        follower = running_follower(self._app_name)
        snapshot = await follower.snapshot() if follower is not None else None
        return self._metrics.render(snapshot)
