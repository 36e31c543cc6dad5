"""The real app with the node's KV pool (`--kv-host-pool-gib`): 2 engine replicas on this one node share it.
Round-robin routing sends a prompt's second request to the replica that did not compute it: that one loads
the prompt's blocks from the pool, and a stream whose replica is killed goes on from the pool on the other."""

import httpx
import pytest

from cluster.config import ClusterConfig
from cluster.protocol import REPLICA_HEADER
from tests.cluster.test_e2e import (BLOCK_SIZE, ENGINE, MODEL, PREFIXES, metric_values, served,
                                   stream_killing_its_replica, until_equal)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = {"model": MODEL, "prompt": PREFIXES["astronomy"], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    pool = {"host_pool_gib": 0.1, "host_pool_path": str(tmp_path_factory.mktemp("pool") / "kv")}
    with served(ClusterConfig(engine=ENGINE | pool, num_replicas=2, routing="round_robin")) as url:
        yield url


def complete(base_url: str, body: dict) -> tuple[str, dict]:
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER], response.json()


def test_a_prompt_one_replica_computed_is_loaded_from_the_pool_by_the_other(base_url):
    first, computed = complete(base_url, PROMPT)
    second, loaded = complete(base_url, PROMPT)
    assert first != second
    assert loaded["choices"][0]["text"] == computed["choices"][0]["text"]
    num_prompt_tokens = loaded["usage"]["prompt_tokens"]
    num_loaded = (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert loaded["usage"]["prompt_tokens_details"]["cached_tokens"] == num_loaded
    assert metric_values(base_url, "host_pool_hits_total") == {first: 0.0, second: float(num_loaded)}
    # Idle, the router's index holds what each replica's device and the pool hold: the blocks of the prompt
    # and the output but its last token, on both devices and once in the pool.
    num_blocks = (num_prompt_tokens + PROMPT["max_tokens"] - 1) // BLOCK_SIZE
    until_equal(lambda: metric_values(base_url, "router_index_host_blocks"), {first: num_blocks, second: num_blocks})
    assert metric_values(base_url, "kv_cached_blocks") == {first: num_blocks, second: num_blocks}
    assert metric_values(base_url, "router_index_blocks") == {first: num_blocks, second: num_blocks}


def test_a_stream_whose_replica_is_killed_goes_on_from_the_pool_on_the_other(base_url):
    body = PROMPT | {"prompt": PREFIXES["cooking"], "max_tokens": 24, "stream_options": {"include_usage": True}}
    _, undisturbed = complete(base_url, body)
    survivor, _ = complete(base_url, PROMPT | {"max_tokens": 1})  # round robin: the stream goes to the other
    loaded_before = metric_values(base_url, "host_pool_hits_total")[survivor]
    killed, chunks = stream_killing_its_replica(base_url, body=body)
    assert killed != survivor
    *text_chunks, usage_chunk = chunks
    assert "".join(chunk["choices"][0]["text"] for chunk in text_chunks) == undisturbed["choices"][0]["text"]
    assert usage_chunk["usage"]["completion_tokens"] == undisturbed["usage"]["completion_tokens"]
    assert metric_values(base_url, "host_pool_hits_total")[survivor] > loaded_before
