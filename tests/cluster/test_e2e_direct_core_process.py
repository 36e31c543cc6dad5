"""The direct front door with each engine core in a process of its own: an engine core killed mid-stream under a
replica process that lives on, whose request another replica finishes (relayed by the first) as the undisturbed
run would."""
import glob
import re
import time
from pathlib import Path

import httpx
import psutil
import pytest

from cluster.local_ray import LOOPBACK, free_port

from .test_e2e import MIGRATED, metric_values, stream_killing_its_replica
from .test_e2e_cli import Server
from .test_e2e_direct import stop

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FLAGS = ["--front-door", "direct", "--engine-core", "process", "--replicas", "2", "--num-kv-blocks", "64",
         "--max-model-len", "256", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def server():
    server = Server(free_port(), FLAGS)
    try:
        server.wait_until_serving()
        yield server
    finally:
        stop(server)


def kill_engine_core(server: Server, replica_id: str) -> None:
    """SIGKILL to the engine core process under the engine replica that HAProxy knows by that id."""
    port = replica_port(replica_id)
    [replica] = [process for process in psutil.Process(server.process.pid).children(recursive=True)
                 if any(conn.laddr.port == port and conn.status == psutil.CONN_LISTEN
                        for conn in _connections(process))]
    [core] = [child for child in replica.children() if any("spawn_main" in part for part in child.cmdline())]
    core.kill()


def replica_port(replica_id: str) -> int:
    """The replica's HTTP port, from the HAProxy configuration Serve wrote."""
    for path in sorted(glob.glob("/tmp/haproxy-serve/*/haproxy.cfg"), key=lambda path: -Path(path).stat().st_mtime):
        match = re.search(rf"server SERVE_REPLICA_prefixserve-engine-{replica_id} [\d.]+:(\d+)", Path(path).read_text())
        if match:
            return int(match[1])
    raise AssertionError(f"no HAProxy server for replica {replica_id}")


def _connections(process: psutil.Process) -> list:
    try:
        return process.net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return []


def test_killing_the_engine_core_serving_a_stream_moves_the_request_unnoticed(server):
    base_url = f"http://{LOOPBACK}:{server.port}"
    undisturbed = httpx.post(f"{base_url}/v1/completions", json=MIGRATED, timeout=120).json()
    replica_id, chunks = stream_killing_its_replica(base_url, kill=lambda replica_id: kill_engine_core(server,
                                                                                                      replica_id))
    *text_chunks, usage_chunk = chunks
    assert "".join(chunk["choices"][0]["text"] for chunk in text_chunks) == undisturbed["choices"][0]["text"]
    assert usage_chunk["usage"] == undisturbed["usage"]
    # Serve replaces the replica whose core died (its health check fails); no replica keeps a block.
    deadline = time.monotonic() + 120
    while replica_id in (usage := metric_values(base_url, "kv_cache_usage_perc")) or any(usage.values()):
        assert time.monotonic() < deadline, usage
        time.sleep(0.5)
