"""A Ray cluster of three nodes on this machine, every one on 127.0.0.1, loses a node under load.

The head holds Serve's controller and proxy (no CPUs, so no engine replica); two worker nodes of 2
CPUs hold the 2 engine replicas (1 CPU each, spread by Serve). The ingress (and with it the router
actor) may land on any node. While greedy streams run on both replicas, the node under one of them,
not the ingress's, is removed: its streams migrate and end exactly as an undisturbed run does (fp32, as
the README's Migration says), Serve starts a replacement on the surviving node, and the router forgets
the dead replica. (Losing the ingress's node drops its client connections: a load balancer's retry, not
migration, covers that.)
"""
import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.app import APP_NAME, build
from cluster.config import ClusterConfig
from cluster.local_ray import LOOPBACK, free_port, keep_ray_on_loopback
from cluster.protocol import REPLICA_HEADER

from .test_e2e import MODEL, metric_values

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = ClusterConfig(engine={"dtype": "float32", "num_kv_blocks": 96, "max_model_len": 256, "max_num_seqs": 8},
                       num_replicas=2)
PROMPTS = [f"Story {i}: once upon a time, in a town by the sea," for i in range(6)]
MAX_TOKENS = 64
RECOVERY_TIMEOUT_S = 120


@contextlib.contextmanager
def three_nodes(config: ClusterConfig) -> Iterator[tuple[Cluster, list, str]]:
    """The app on a head (Serve's controller and proxy, no CPUs) and two worker nodes of 2 CPUs, all on
    127.0.0.1 -> (the cluster, its worker nodes, the app's base URL)."""
    keep_ray_on_loopback()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": False,
        "env_vars": {"RAY_AUTH_MODE": "disabled"}})
    workers = [cluster.add_node(num_cpus=2, node_ip_address=LOOPBACK) for _ in range(2)]
    ray.init(address=cluster.address, _node_ip_address=LOOPBACK)
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": LOOPBACK, "port": port})
        serve.run(build(config), name=APP_NAME, route_prefix="/")
        yield cluster, workers, f"http://{LOOPBACK}:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def cluster():
    with three_nodes(CONFIG) as cluster:
        yield cluster


def deployment_replicas(deployment: str = "engine") -> dict[str, tuple[str, str]]:
    """The deployment's replicas by id: (state, node id; None until placed), from the Serve controller's view."""
    details = serve.context._get_global_client().get_serve_details()
    replicas = details["applications"][APP_NAME]["deployments"][deployment]["replicas"]
    return {replica["replica_id"]: (replica["state"], replica.get("node_id")) for replica in replicas}


async def stream(client: httpx.AsyncClient, prompt: str, started: asyncio.Queue, *, model: str = MODEL,
                 max_tokens: int = MAX_TOKENS) -> tuple[str, str | None]:
    """A greedy streamed completion -> (its text, its finish_reason); puts its replica on `started` at the
    first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish_reason = "", None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            if not text and chunk["choices"][0]["text"]:
                started.put_nowait(response.headers[REPLICA_HEADER])
            text += chunk["choices"][0]["text"]
            finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
    return text, finish_reason


async def run_and_remove_a_node(base_url: str, cluster: Cluster, workers: list) -> tuple[list, str]:
    """Streams PROMPTS at once; when both replicas stream, removes the node of one that does not hold the
    ingress. -> (results, its replica)"""
    started: asyncio.Queue = asyncio.Queue()
    async with httpx.AsyncClient(base_url=base_url, timeout=RECOVERY_TIMEOUT_S) as client:
        streams = asyncio.gather(*(stream(client, prompt, started) for prompt in PROMPTS))
        streaming = set()
        while len(streaming) < 2:
            streaming.add(await asyncio.wait_for(started.get(), RECOVERY_TIMEOUT_S))
        ingress_nodes = {node for _, node in deployment_replicas("ingress").values()}
        placed = deployment_replicas()
        victim = next(replica for replica in sorted(streaming) if placed[replica][1] not in ingress_nodes)
        victim_node = placed[victim][1]
        [worker] = [worker for worker in workers if worker.node_id == victim_node]
        await asyncio.to_thread(cluster.remove_node, worker)
        return await asyncio.wait_for(streams, RECOVERY_TIMEOUT_S), victim


def test_losing_a_node_under_load_migrates_its_streams_and_replaces_its_replica(cluster):
    cluster, workers, base_url = cluster
    assert len({node for _, node in deployment_replicas().values()}) == 2  # one replica per worker node
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    undisturbed = [httpx.post(f"{base_url}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
                   .json()["choices"][0]["text"] for prompt in PROMPTS]

    results, victim = asyncio.run(run_and_remove_a_node(base_url, cluster, workers))

    assert_migrated_and_replaced(base_url, body, PROMPTS, results, undisturbed, victim)


def assert_migrated_and_replaced(base_url: str, body: dict, prompts: list[str], results: list[tuple[str, str | None]],
                                 undisturbed: list[str], victim: str) -> None:
    """The streams of prompts ended as undisturbed runs, at least one of them after a migration; Serve replaced the
    victim replica (2 run, none of them the victim), the router forgot it, and the app serves as before."""
    assert [text for text, _ in results] == undisturbed
    assert {finish_reason for _, finish_reason in results} == {"length"}
    migrations = re.search(r"^prefixserve:request_migrations_total (\S+)$", httpx.get(f"{base_url}/metrics").text, re.M)
    assert float(migrations[1]) >= 1
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        replicas = deployment_replicas()
        running = {replica for replica, (state, _) in replicas.items() if state == "RUNNING"}
        routed = set(metric_values(base_url, "router_index_blocks"))
        if len(running) == 2 and victim not in replicas and victim not in routed:
            break
        time.sleep(2)
    assert victim not in replicas and len(running) == 2, replicas
    assert victim not in routed
    after = httpx.post(f"{base_url}/v1/completions", json={**body, "prompt": prompts[0]}, timeout=120)
    assert after.json()["choices"][0]["text"] == undisturbed[0]
