"""Backpressure on the real app: one engine replica with room for one request, an ingress queue of one.

Requests past both get 429 with Retry-After from Serve's max_queued_requests, and a body past the limit
gets 413; the accepted ones complete and leave no KV block behind.
"""
import asyncio
import time

import httpx
import pytest

from cluster.config import ClusterConfig

from .test_e2e import MODEL, metric_values, served

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = ClusterConfig(engine={"num_kv_blocks": 64, "max_model_len": 256, "max_num_seqs": 1}, num_replicas=1,
                       max_waiting_requests=0, max_queued_requests=1, max_request_body_bytes=2048)
CAPACITY = (CONFIG.num_replicas * (CONFIG.engine.scheduler.max_num_seqs + CONFIG.max_waiting_requests)
            + CONFIG.max_queued_requests)  # 2: one running, one queued in the ingress
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def base_url():
    with served(CONFIG) as url:
        yield url


async def send_while_one_runs(base_url: str, count: int) -> tuple[httpx.Response, list[httpx.Response]]:
    """Streams a long request and, once it runs, sends `count` more at once: they find the replica full for all
    its 160 tokens, so how many of them are accepted does not depend on how fast the machine generates."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=BODY | {"max_tokens": 160, "stream": True}) as held:
            lines = held.aiter_lines()
            await anext(lines)  # its first chunk: it runs
            responses = await asyncio.gather(*(client.post("/v1/completions", json=BODY) for _ in range(count)))
            assert "data: [DONE]" in [line async for line in lines]
    return held, responses


def test_requests_past_the_replica_and_the_ingress_queue_get_429(base_url):
    held, responses = asyncio.run(send_while_one_runs(base_url, 5))
    assert held.status_code == 200
    assert sorted(response.status_code for response in responses) == [200] * (CAPACITY - 1) + [429] * (6 - CAPACITY)
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "server_overloaded"
        else:
            assert response.json()["usage"]["completion_tokens"] == 48
    deadline = time.monotonic() + 30
    while any(metric_values(base_url, "kv_cache_usage_perc").values()) or \
            any(metric_values(base_url, "num_requests_running").values()):
        assert time.monotonic() < deadline, "blocks still held after every request ended"
        time.sleep(0.5)


def test_a_body_past_the_limit_gets_413(base_url):
    response = httpx.post(f"{base_url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "word " * 500, "max_tokens": 1})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
