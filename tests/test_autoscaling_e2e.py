"""The real Serve app (cluster.app:build_app) autoscales 1 -> 2 -> 1 engine replicas under load."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from ray import serve

from cluster.app import APP_NAME, build_app
from cluster.local_ray import free_port, init_local_ray

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_CLIENTS = 6
# One running request per replica, so that the other clients wait in its queue.
ARGS = {
    "engine": {"num_kv_blocks": 64, "max_num_seqs": 1, "max_num_batched_tokens": 256},
    "replica_num_cpus": 0.0,
    "autoscaling": {"min_replicas": 1, "max_replicas": 2, "policy_kwargs": {
        "scale_up_waiting_requests": 2.0, "upscale_sustain_s": 1.0, "downscale_quiet_s": 3.0}},
}


def wait_for_engine_replicas(expected: int, timeout_s: float) -> None:
    """Until exactly `expected` engine replicas run, and none start or stop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = serve.status().applications[APP_NAME].deployments["engine"].replica_states
        if states.get("RUNNING", 0) == expected and sum(states.values()) == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"not {expected} engine replicas after {timeout_s} s: {states}")


class FakeClients:
    """NUM_CLIENTS clients sending completions back to back until stopped."""

    def __init__(self, base_url: str, model: str):
        self.base_url, self.model = base_url, model
        self.stopped = threading.Event()
        self.statuses: list[int] = []
        self.pool = ThreadPoolExecutor(NUM_CLIENTS)

    def start(self) -> None:
        for i in range(NUM_CLIENTS):
            self.pool.submit(self._loop, i)

    def stop(self) -> None:
        self.stopped.set()
        self.pool.shutdown(wait=True)

    def _loop(self, client_id: int) -> None:
        body = {"model": self.model, "prompt": f"Client {client_id} counts to one hundred:", "max_tokens": 24,
                "temperature": 0}
        with httpx.Client(base_url=self.base_url, timeout=120) as client:
            while not self.stopped.is_set():
                self.statuses.append(client.post("/v1/completions", json=body).status_code)


def test_engine_scales_up_under_load_and_back_down_when_quiet(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    port = free_port()
    init_local_ray(2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(ARGS), name=APP_NAME, route_prefix="/")
        wait_for_engine_replicas(1, timeout_s=120)
        base_url = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        clients = FakeClients(base_url, model)
        clients.start()
        try:
            wait_for_engine_replicas(2, timeout_s=180)
        finally:
            clients.stop()
        wait_for_engine_replicas(1, timeout_s=120)
        assert clients.statuses and set(clients.statuses) == {200}
    finally:
        serve.shutdown()
        ray.shutdown()
