"""Two ingress replicas, each routing in its own process on the view the router feed keeps current: requests
that share a prefix hit its cache whichever ingress takes them, also after an ingress replica and the router
actor are killed, and once idle every view of the index equals the engines' caches. The engines stream with an
interval longer than any request: a stream's first token comes alone, the rest in one output with the finish."""
import json
import time

import httpx
import pytest
import ray

from cluster.config import ClusterConfig
from cluster.protocol import REPLICA_HEADER

from .test_e2e import MODEL, metric_values, served

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE = {"dtype": "float32", "num_kv_blocks": 160, "max_model_len": 512, "max_num_seqs": 8}
PREFIX = "You are a librarian. " + " ".join(f"Shelf {i} holds the books on topic number {i}." for i in range(24))
MIN_PREFIX_TOKENS = 256
REQUESTS_PER_ROUND = 12
IDLE_TIMEOUT_S = 60
STREAM_INTERVAL_S = 3600


@pytest.fixture(scope="module")
def base_url():
    with served(ClusterConfig(engine=ENGINE, num_replicas=2, ingress_replicas=2,
                              stream_interval_s=STREAM_INTERVAL_S)) as url:
        yield url


def complete(base_url: str, question: str) -> tuple[str, int]:
    """(engine replica, cached prompt tokens) of one completion, on a connection of its own."""
    response = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": f"{PREFIX} Question {question}:", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER], response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def a_round(base_url: str, name: str) -> set[tuple[str, int]]:
    return {complete(base_url, f"{name} {i}") for i in range(REQUESTS_PER_ROUND)}


def kill_actor(name_part: str, namespace: str) -> None:
    """Kill the first named actor of the namespace whose name has name_part."""
    actor = next(actor for actor in ray.util.list_named_actors(all_namespaces=True)
                 if name_part in actor["name"] and actor["namespace"] == namespace)
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


def test_a_stream_sends_its_first_token_alone_and_the_rest_with_the_finish(base_url):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=120, json=body | {"stream": True}) as response:
        events = response.read().decode().split("\n\n")
    chunks = [json.loads(event.removeprefix("data: "))["choices"][0] for event in events[:-2]]
    assert events[-2:] == ["data: [DONE]", ""]
    assert [chunk["finish_reason"] for chunk in chunks] == [None, "length"]
    whole = httpx.post(f"{base_url}/v1/completions", timeout=120, json=body).json()
    assert "".join(chunk["text"] for chunk in chunks) == whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 6


def test_a_shared_prefix_hits_whichever_ingress_routes_it_and_after_an_ingress_and_the_feed_die(base_url):
    holder, _ = complete(base_url, "zero")
    time.sleep(1)  # the feed carries the prefix's blocks to both ingress replicas
    [(replica, cached)] = a_round(base_url, "first")
    assert (replica, cached >= MIN_PREFIX_TOKENS) == (holder, True)

    kill_actor("router:", "prefixserve")  # first: the ingress replica that created it takes it down with it
    kill_actor("#ingress#", "serve")
    assert a_round(base_url, "second") == {(holder, cached)}


def test_once_idle_every_ingress_sees_the_engines_caches(base_url):
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    agreeing_scrapes = 0
    while agreeing_scrapes < 6:  # scrapes land on either ingress replica
        assert time.monotonic() < deadline, (metric_values(base_url, "router_index_blocks"),
                                             metric_values(base_url, "kv_cached_blocks"))
        index, cached = metric_values(base_url, "router_index_blocks"), metric_values(base_url, "kv_cached_blocks")
        agreeing_scrapes = agreeing_scrapes + 1 if index == cached and len(cached) == 2 else 0
        time.sleep(0.5)
