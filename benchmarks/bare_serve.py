"""The bare Ray Serve app that bench_front_door.py measures prefixserve against: a FastAPI ingress reads
the JSON body, streams a chunk a token (max_tokens) from another deployment through a DeploymentHandle
and answers a small OpenAI-like completion, or streams each chunk on as a server-sent event. No
tokenizing, no routing policy, no engine."""
import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from cluster.app import INGRESS_MAX_ONGOING_REQUESTS

CHUNK = "<7>"


def bare_api(stream: Callable[[dict], AsyncIterator[str]]) -> FastAPI:
    app = FastAPI(openapi_url=None)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> dict | StreamingResponse:
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(_events(body["model"], stream(body)), media_type="text/event-stream")
        chunks = [chunk async for chunk in stream(body)]
        num_prompt_tokens = len(body["prompt"])
        return {"id": "cmpl-bare", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": "".join(chunks), "finish_reason": "length"}],
                "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": len(chunks),
                          "total_tokens": num_prompt_tokens + len(chunks)}}

    return app


async def _events(model: str, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    async for chunk in chunks:
        event = {"id": "cmpl-bare", "object": "text_completion", "model": model,
                 "choices": [{"index": 0, "text": chunk, "finish_reason": None}]}
        yield f"data: {json.dumps(event)}\n\n"
    yield "data: [DONE]\n\n"


class Chunks:
    async def generate(self, body: dict) -> AsyncIterator[str]:
        for _ in range(body["max_tokens"]):
            yield CHUNK


@serve.ingress()
class BareIngress:
    def __init__(self, chunks: DeploymentHandle, by_reference: bool):
        self._chunks = chunks.options(stream=True, _by_reference=by_reference)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return bare_api(self._chunks.generate.remote)


def build_bare(num_replicas: int, replica_num_cpus: float, transport: str = "ray",
               ingress_replicas: int = 1) -> Application:
    """ingress_replicas ingress replicas (prefixserve's default: one) in front of num_replicas chunk replicas.
    Both take as many requests at once as prefixserve's ingress does: Serve's default (5) would queue them in
    the proxy. transport: how the ingress calls the chunks, as prefixserve's ClusterConfig.engine_transport;
    "ray", Serve's default handle, unless told otherwise."""
    chunks = serve.deployment(Chunks, name="chunks").options(
        num_replicas=num_replicas, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": replica_num_cpus})
    ingress = serve.deployment(BareIngress, name="ingress").options(
        num_replicas=ingress_replicas, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(chunks.bind(), transport == "ray")
