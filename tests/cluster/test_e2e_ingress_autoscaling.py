"""The ingress deployment autoscales on its replicas' ongoing requests (Serve's own policy): held streams add an
ingress replica, requests keep succeeding while it joins, and once idle the deployment is back to one replica,
whose router still sends a shared prefix where it is cached."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ray import serve

from cluster.app import APP_NAME
from cluster.config import ClusterConfig

from .test_e2e import MODEL, served

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE = {"dtype": "float32", "num_kv_blocks": 160, "max_model_len": 512, "max_num_seqs": 8}
# Any ongoing request over one per replica asks for another; Serve's delays off, so the test waits only for its
# metrics (pushed every 10 s, averaged over 30 s).
SCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
           "downscale_delay_s": 0}
HELD_STREAMS = 4
SCALE_TIMEOUT_S = 120
PREFIX = "You are a librarian. " + " ".join(f"Shelf {i} holds the books on topic number {i}." for i in range(8))


def running_ingress_replicas() -> int:
    deployment = serve.status().applications[APP_NAME].deployments["ingress"]
    return deployment.replica_states.get("RUNNING", 0)


def wait_for_ingress_replicas(count: int) -> None:
    deadline = time.monotonic() + SCALE_TIMEOUT_S
    while running_ingress_replicas() != count:
        assert time.monotonic() < deadline, f"the ingress did not reach {count} replicas"
        time.sleep(1)


def stream_until(base_url: str, stop: threading.Event) -> list[int]:
    """Long streams, one after another until stop is set: their status codes."""
    statuses = []
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 64, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            response.read()
            statuses.append(response.status_code)
    return statuses


def cached_tokens(base_url: str, question: str) -> int:
    response = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": f"{PREFIX} Question {question}:", "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_held_streams_add_an_ingress_replica_and_idle_takes_it_away():
    config = ClusterConfig(engine=ENGINE, num_replicas=1, ingress_autoscaling=SCALING)
    with served(config) as base_url:
        assert running_ingress_replicas() == 1
        stop = threading.Event()
        with ThreadPoolExecutor(HELD_STREAMS) as pool:
            streams = [pool.submit(stream_until, base_url, stop) for _ in range(HELD_STREAMS)]
            try:
                wait_for_ingress_replicas(2)
            finally:
                stop.set()
        statuses = [status for stream in streams for status in stream.result()]
        assert set(statuses) == {200}
        wait_for_ingress_replicas(1)
        assert cached_tokens(base_url, "one") == 0
        assert cached_tokens(base_url, "two") == 96  # the prefix's 6 full blocks of 16 tokens
