"""What the live benchmarks share: the app on a local Ray cluster (every node on 127.0.0.1, one Serve
port), and the requests they send it through its OpenAI API. openai and httpx are imported where they
are used: bench_agents imports this module for its live runs, and its simulated runs need neither."""
import asyncio
import contextlib
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from cluster.protocol import REPLICA_HEADER

WORDS = ("river stone light garden window paper silver engine market winter harbor candle forest "
         "signal mirror ladder orbit canvas thunder meadow lantern velvet copper shadow").split()


@contextlib.contextmanager
def local_serve(num_cpus: int | None = None) -> Iterator[Callable[..., str]]:
    """Yields run(app, name, route_prefix) -> the app's base URL. Each run replaces the app of that name
    with fresh replicas, which share the machine's cores. num_cpus: the CPUs Ray schedules replicas on
    (default: the machine's), more than the machine has for apps that run side by side."""
    from cluster.local_ray import free_port, init_local_ray

    port = free_port()
    init_local_ray(num_cpus or os.cpu_count() or 1, log_to_driver=False)  # before anything imports ray
    import ray
    from ray import serve

    from cluster.app import APP_NAME

    def run(app, name: str = APP_NAME, route_prefix: str = "/") -> str:
        serve.run(app, name=name, route_prefix=route_prefix)
        return f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}"

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield run
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_num_cpus(num_replicas: int) -> float:
    """Each of num_replicas replicas' share of the machine's cores, at most one."""
    return min(1.0, (os.cpu_count() or 1) / num_replicas)


def app_of(engine: dict, num_replicas: int, **cluster_config):
    """prefixserve's Serve application, its engine replicas sharing the machine's cores."""
    from cluster.app import build
    from cluster.config import ClusterConfig

    return build(ClusterConfig(engine=engine, num_replicas=num_replicas,
                               replica_num_cpus=replica_num_cpus(num_replicas), **cluster_config))


@contextlib.contextmanager
def local_app() -> Iterator[Callable[..., str]]:
    """Yields deploy(engine, num_replicas, **cluster_config) -> the app's base URL. Each deploy replaces
    the app with fresh replicas (cold caches) that share the machine's cores."""
    with local_serve() as run:
        yield lambda engine, num_replicas, **cluster_config: run(app_of(engine, num_replicas, **cluster_config))


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


@contextlib.asynccontextmanager
async def openai_client(base_url: str, **options) -> AsyncIterator[tuple]:
    """A client of the app's OpenAI API (openai.AsyncOpenAI), and the name of the model it serves."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, **options) as client:
        yield client, (await client.models.list()).data[0].id


@dataclass
class Completion:
    """One streamed completion; its times are time.monotonic() readings."""
    sent_s: float
    first_token_s: float
    finished_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    replica_id: str


async def stream_completion(client, model: str, prompt: str, max_tokens: int, headers: dict | None = None,
                            **body) -> Completion:
    """A greedy completion of max_tokens tokens (EOS ignored), streamed with its usage."""
    sent = time.monotonic()
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers, extra_body={"ignore_eos": True, **body})
    first_token, text = None, ""
    async for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].text:
            first_token = first_token or time.monotonic()
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    return Completion(sent, first_token, time.monotonic(), text, usage.prompt_tokens,
                      usage.prompt_tokens_details.cached_tokens, usage.completion_tokens, raw.headers[REPLICA_HEADER])


async def warm_up(client, model: str, num_replicas: int) -> None:
    """Every replica's first forward passes are slow: take them with prompts sharing nothing."""
    await asyncio.gather(*(stream_completion(client, model, f"warm up {i}", 2) for i in range(2 * num_replicas)))


async def metrics_text(base_url: str) -> str:
    import httpx

    async with httpx.AsyncClient() as client:
        return (await client.get(f"{base_url}/metrics")).text
