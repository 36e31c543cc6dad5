"""The real app with each engine replica's core in a process of its own (`--engine-core process`): prefix routing
fed by the core's KV events, and an engine core killed mid-stream under a replica that lives on, whose request
the other replica finishes as the undisturbed run would."""
import os
import signal
import time

import httpx
import openai
import psutil
import pytest
import ray

from cluster.config import ClusterConfig
from tests.cluster.test_e2e import (ENGINE, MIGRATED, metric_values, send_groups, served,
                                    stream_killing_its_replica)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def base_url():
    with served(ClusterConfig(engine=ENGINE, num_replicas=2, engine_core="process")) as url:
        yield url


def core_process_of(replica_id: str) -> int:
    """The pid of the engine core process under the Serve replica that the response header named."""
    [actor] = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
               if actor["name"].endswith(f"#{replica_id}")]
    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
    children = ray.get(handle.__ray_call__.remote(
        lambda _: [(child.pid, child.cmdline()) for child in psutil.Process().children()]))
    [pid] = [pid for pid, cmdline in children if any("spawn_main" in part for part in cmdline)]
    return pid


def test_prefix_routing_keeps_each_group_where_its_core_cached_it(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for group, served_by in send_groups(client).items():
            assert len({replica_id for replica_id, _ in served_by}) == 1, f"{group}: {served_by}"
            assert all(cached >= 160 for _, cached in served_by[1:]), served_by


def test_killing_the_engine_core_serving_a_stream_moves_the_request_unnoticed(base_url):
    undisturbed = httpx.post(f"{base_url}/v1/completions", json=MIGRATED, timeout=120).json()
    replica_id, chunks = stream_killing_its_replica(
        base_url, kill=lambda replica_id: os.kill(core_process_of(replica_id), signal.SIGKILL))
    *text_chunks, usage_chunk = chunks
    assert "".join(chunk["choices"][0]["text"] for chunk in text_chunks) == undisturbed["choices"][0]["text"]
    assert usage_chunk["usage"] == undisturbed["usage"]
    assert "prefixserve:request_migrations_total 1.0" in httpx.get(f"{base_url}/metrics").text.splitlines()
    # Serve replaces the replica whose core died (its health check fails); no replica keeps a block.
    deadline = time.monotonic() + 120
    while replica_id in (usage := metric_values(base_url, "kv_cache_usage_perc")) or any(usage.values()):
        assert time.monotonic() < deadline, usage
        time.sleep(0.5)
